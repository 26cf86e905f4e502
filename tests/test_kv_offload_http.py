"""The host KV tier through `tandem serve` (real processes, the official openai client): a prefix
evicted from a 16-block KV pool comes back from the tier, with the same text, and /metrics
counts it."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixture import Server, start_server, stop_server, wait_address_idle

pytestmark = pytest.mark.slow

BLOCK = 16
# The tiny model's block: 16 tokens x 2 layers x (K, V) x 2 KV heads x head dim 16 x 4 bytes.
BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4
HOST_BLOCKS = 64


@pytest.fixture(scope="module")
def offload_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[Server]:
    args = [
        "--num-kv-blocks", "16",
        "--max-model-len", "160",
        "--kv-offload-gb", repr(HOST_BLOCKS * BLOCK_BYTES / 2**30),
    ]  # fmt: skip
    server = start_server(
        tmp_path_factory.mktemp("serve-offload"), model=str(tiny_model_dir), args=args
    )
    yield server
    stop_server(server)


def scrape(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


def settled(server: Server) -> dict[str, float]:
    """/metrics once it reflects the idle engine: a stats poll after its last step."""
    steps = wait_address_idle(server.engine_address).num_steps
    deadline = time.monotonic() + 30
    while (samples := scrape(server)).get("tandem_engine_steps") != steps:
        assert time.monotonic() < deadline, "/metrics never caught up with the engine"
        time.sleep(0.1)
    return samples


def complete(client: openai.OpenAI, prompt: list[int]) -> str:
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def test_a_prefix_evicted_to_the_host_tier_comes_back_and_is_counted(
    offload_server: Server,
) -> None:
    client = openai.OpenAI(
        base_url=f"{offload_server.base_url}/v1", api_key="none", max_retries=0, timeout=120
    )
    rng = random.Random(65)
    shared = [rng.randrange(3, 49152) for _ in range(3 * BLOCK + 5)]  # 3 full blocks
    fillers = [[rng.randrange(3, 49152) for _ in range(100)] for _ in range(3)]  # 7 blocks each
    before = settled(offload_server)
    first = complete(client, shared)
    for filler in fillers:  # the 16-block pool evicts the shared prefix's cached blocks
        complete(client, filler)
    again = complete(client, shared)
    after = settled(offload_server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert again == first
    assert delta("tandem_kv_offload_queries_total") == len(shared) * 2 + 300
    assert delta("tandem_kv_offload_hits_total") == 3 * BLOCK
    assert delta("tandem_kv_offload_restored_blocks_total") == 3
    assert delta("tandem_kv_offload_stored_blocks_total") >= 3
    assert delta("tandem_prefix_cache_hits_total") == 0  # the device pool had lost them
    # Tokens computed: every prompt, less the 48 restored, and 3 decodes each.
    computed = len(shared) * 2 - 3 * BLOCK + sum(len(f) for f in fillers) + 3 * 5
    assert delta("tandem_iteration_tokens_total_sum") == computed
    assert 0 < after["tandem_kv_offload_usage_perc"] <= 1
