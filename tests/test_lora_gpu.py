"""GPU tests of LoRA: the tile kernels (engine_core/lora/triton_lora.py), the fused kernel and
the shrink-then-expand pair each, against the torch reference (layers.add_lora_reference) over
llama-8b's projection shapes (decode batches whose rows take eight adapters and the base model
in turn, prefill runs, bf16 and fp16, ranks 8 to 64); a CUDA graph of the kernels replayed over
changing tile tables; and the engine with CUDA graphs and LoRA on a tiny Llama: HF + PEFT's
greedy tokens per adapter, mixed with the base model in one batch, the eager engine's tokens, a
slot rewritten with another adapter between replays, and steps of the base model alone replaying
the decode graphs captured without the LoRA kernels.

    .venv/bin/python -m pytest -q tests/test_lora_gpu.py
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.llm import LLM  # noqa: E402
from engine_core.lora.batch import (  # noqa: E402
    NO_SLOT,
    TILE_ROWS,
    lora_batch,
    tile_capacity,
    tiles_of,
)
from engine_core.lora.layers import add_lora_reference  # noqa: E402
from engine_core.lora.triton_lora import add_lora_fused, add_lora_split, add_lora_tiles  # noqa: E402
from protocol.messages import LoraRef, SamplingParams  # noqa: E402
from tests.lora_fixtures import count_graph_replays, peft_greedy, write_adapter  # noqa: E402

CUDA = torch.device("cuda")
SLOTS = 8
# (input, shards' outputs) of llama-8b's fused qkv, o, fused gate/up and down projections.
SHAPES = ((4096, (4096, 1024, 1024)), (4096, (4096,)), (4096, (14336, 14336)), (14336, (4096,)))


def decode_rows(streams: int) -> list[tuple[int, int]]:
    """One row per stream, the streams taking the slots and the base model in turn."""
    return [(1, NO_SLOT if i % (SLOTS + 1) == SLOTS else i % (SLOTS + 1)) for i in range(streams)]


PREFILL_ROWS = [(300, 3), (77, NO_SLOT), (129, 0), (1, 7), (64, 3)]


def slot_weights(
    gen: torch.Generator, inp: int, sizes: tuple[int, ...], rank: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, shards * rank, in] and B [S, out, shards * rank] as LoraLinear lays them out:
    shard i's output rows read only its rank columns."""
    width = len(sizes) * rank
    a = torch.randn(SLOTS, width, inp, generator=gen, device=CUDA) / inp**0.5
    b = torch.zeros(SLOTS, sum(sizes), width, device=CUDA)
    first = 0
    for shard, size in enumerate(sizes):
        cols = slice(shard * rank, (shard + 1) * rank)
        b[:, first : first + size, cols] = torch.randn(
            SLOTS, size, rank, generator=gen, device=CUDA
        )
        first += size
    return a.to(dtype), (b / rank**0.5).to(dtype)


WAYS = {"tiles": add_lora_tiles, "fused": add_lora_fused, "split": add_lora_split}


def check(
    row_slots: list[tuple[int, int]],
    inp: int,
    sizes: tuple[int, ...],
    rank: int,
    dtype: torch.dtype,
    way: str = "tiles",
) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(inp + sum(sizes) + rank)
    rows = sum(n for n, _ in row_slots)
    x = torch.randn(rows, inp, generator=gen, device=CUDA, dtype=dtype)
    a, b = slot_weights(gen, inp, sizes, rank, dtype)
    base = torch.randn(rows, sum(sizes), generator=gen, device=CUDA, dtype=dtype)
    batch = lora_batch(row_slots, CUDA)
    assert batch is not None
    want = add_lora_reference(base.float(), x.float(), a.float(), b.float(), batch)
    got = WAYS[way](base.clone(), x, a, b, batch.tiles, sizes)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=3e-2)
    untouched = torch.tensor([s == NO_SLOT for n, s in row_slots for _ in range(n)], device=CUDA)
    assert torch.equal(got[untouched], base[untouched])


@pytest.mark.parametrize(("inp", "sizes"), SHAPES)
@pytest.mark.parametrize("streams", [1, 9, 64, 128])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_decode_batches_match_the_reference(
    inp: int, sizes: tuple[int, ...], streams: int, way: str
) -> None:
    check(decode_rows(streams), inp, sizes, 16, torch.bfloat16, way)


@pytest.mark.parametrize(("inp", "sizes"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_prefill_runs_match_the_reference(
    inp: int, sizes: tuple[int, ...], dtype: torch.dtype, way: str
) -> None:
    check(PREFILL_ROWS, inp, sizes, 16, dtype, way)


@pytest.mark.parametrize("rank", [8, 24, 64])
@pytest.mark.parametrize("way", ["fused", "split"])
def test_ranks_match_the_reference(rank: int, way: str) -> None:
    check(decode_rows(33), 4096, (4096, 1024, 1024), rank, torch.bfloat16, way)


@pytest.mark.parametrize("way", ["fused", "split"])
def test_a_graph_of_the_kernels_follows_its_static_table(way: str) -> None:
    """The kernels captured once over a static tile table (as cuda_graph.py captures them),
    then replayed after copying in the tables of steps with different mixes of adapters and
    padding rows, and of none: each replay gives its step's reference."""
    add = WAYS[way]
    inp, sizes, graph_rows = 4096, (4096, 1024, 1024), 64
    gen = torch.Generator(device=CUDA).manual_seed(1)
    a, b = slot_weights(gen, inp, sizes, 16, torch.bfloat16)
    x = torch.randn(graph_rows, inp, generator=gen, device=CUDA, dtype=torch.bfloat16)
    capacity = tile_capacity(256, SLOTS)
    static = torch.full((capacity * (1 + TILE_ROWS),), NO_SLOT, dtype=torch.int32, device=CUDA)
    tiles = tiles_of(static, tile_capacity(graph_rows, SLOTS))
    out = torch.zeros(graph_rows, sum(sizes), device=CUDA, dtype=torch.bfloat16)
    add(out, x, a, b, tiles, sizes)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.zero_()
        add(out, x, a, b, tiles, sizes)
    for step in (decode_rows(64), decode_rows(50), [(1, 5)] * 40 + [(1, NO_SLOT)] * 3):
        batch = lora_batch(step, CUDA, min_tiles=capacity)
        assert batch is not None
        static.copy_(batch.tiles.table)
        out.fill_(7.0)
        graph.replay()
        real = len(step)
        want = add_lora_reference(
            torch.zeros(real, sum(sizes), device=CUDA), x[:real].float(), a.float(), b.float(),
            batch,
        )  # fmt: skip
        torch.testing.assert_close(out[:real].float(), want, rtol=2e-2, atol=3e-2)
        assert not out[real:].any()  # padding rows: in no tile
    static[:capacity].fill_(NO_SLOT)
    graph.replay()
    assert not out.any()


# ---- the engine: CUDA graphs with LoRA ---------------------------------------------------------

NEW_TOKENS = 12
PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [200, 31, 77]]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def write_llama(path: Path) -> Path:
    """A 2-layer random Llama whose q/k/v and gate/up boundaries fall on the expand's tiles
    (q 128, k and v 64 each; gate and up 256 each), so the kernels read each shard's own rank
    columns, as they do on real models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # well separated greedy choices
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_gpu")
    base = write_llama(root / "base")
    return {
        "base": base,
        "all": write_adapter(base, root / "all", seed=1, r=8, lora_alpha=16),
        "qv": write_adapter(base, root / "qv", seed=2, r=4, target_modules=["q_proj", "v_proj"]),
        "mlp": write_adapter(
            base, root / "mlp", seed=3, r=8, target_modules=["gate_proj", "up_proj", "down_proj"]
        ),
    }


@pytest.fixture(scope="module")
def expected(case: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """HF + PEFT's greedy tokens (float32, on the CPU) per adapter; None: the base model."""
    names: list[str | None] = [None, "all", "qv", "mlp"]
    return {
        name: [
            peft_greedy(case["base"], None if name is None else case[name], p, NEW_TOKENS)
            for p in PROMPTS
        ]
        for name in names
    }


def make_llm(case: dict[str, Path], enforce_eager: bool, max_loras: int) -> LLM:
    return LLM(
        str(case["base"]), device="cuda", dtype="float32", block_size=16, num_kv_blocks=128,
        max_model_len=128, max_num_seqs=16, enable_lora=True, max_loras=max_loras,
        max_lora_rank=8, enforce_eager=enforce_eager,
    )  # fmt: skip


@pytest.fixture
def counted_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that each graph replay of the engines built in the test appends its rows to."""
    return count_graph_replays(monkeypatch)


def generate(
    llm: LLM, case: dict[str, Path], jobs: list[tuple[str | None, int]]
) -> list[list[int]]:
    loras = [None if name is None else LoraRef(name, str(case[name])) for name, _ in jobs]
    out = llm.generate([PROMPTS[i] for _, i in jobs], GREEDY, detokenize=False, lora=loras)
    return [o.token_ids for o in out]


def test_graphs_with_mixed_adapters_give_peft_and_eager_tokens(
    case: dict[str, Path], expected: dict, counted_replays: list[int]
) -> None:
    """Three adapters and the base model on every prompt in one batch, through the decode
    graphs: each request gets HF + PEFT's tokens, and the eager engine's."""
    names: list[str | None] = ["all", None, "qv", "mlp"]
    jobs = [(name, i) for i in range(len(PROMPTS)) for name in names]
    want = [expected[name][i] for name, i in jobs]
    llm = make_llm(case, enforce_eager=False, max_loras=3)
    try:
        assert llm.engine.runner.graph_runner is not None
        assert generate(llm, case, jobs) == want
    finally:
        llm.engine.shutdown()
    assert counted_replays, "no step replayed a graph"
    eager = make_llm(case, enforce_eager=True, max_loras=3)
    try:
        assert eager.engine.runner.graph_runner is None
        assert generate(eager, case, jobs) == want
    finally:
        eager.engine.shutdown()


def test_a_slot_rewritten_between_replays_serves_its_new_adapter(
    case: dict[str, Path], expected: dict, counted_replays: list[int]
) -> None:
    """One slot: each adapter's requests in turn copy its weights into the slot the captured
    graphs read, and get that adapter's tokens; then the first adapter again."""
    llm = make_llm(case, enforce_eager=False, max_loras=1)
    try:
        for name in ("all", "mlp", "qv", "all"):
            jobs: list[tuple[str | None, int]] = [(name, i) for i in range(len(PROMPTS))]
            replays_before = len(counted_replays)
            assert generate(llm, case, jobs) == [expected[name][i] for i in range(len(PROMPTS))]
            assert len(counted_replays) > replays_before, name
        assert llm.engine.runner.loras is not None
        assert llm.engine.runner.loras.loads == 4
    finally:
        llm.engine.shutdown()


@pytest.fixture
def decode_graph_kinds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that each decode graph replay of the engines built in the test appends to: "base"
    for a graph captured without the LoRA kernels, "lora" for one with them."""
    from engine_core.cuda_graph import CudaGraphRunner

    kinds: list[str] = []
    run_decode = CudaGraphRunner._run_decode

    def recording(self: CudaGraphRunner, *args, **kwargs) -> torch.Tensor:
        graphs = inspect.signature(run_decode).bind(self, *args, **kwargs).arguments["graphs"]
        kinds.append("base" if graphs is self.base_graphs else "lora")
        return run_decode(self, *args, **kwargs)

    monkeypatch.setattr(CudaGraphRunner, "_run_decode", recording)
    return kinds


def test_steps_of_the_base_model_alone_replay_graphs_without_lora(
    case: dict[str, Path], expected: dict, decode_graph_kinds: list[str]
) -> None:
    """On a LoRA engine, a batch of the base model alone decodes through the graphs captured
    without the LoRA kernels and gets the base model's tokens; a batch with an adapter then
    decodes through the LoRA graphs (even after the base-only steps left the static table as it
    was) and gets the adapter's; then the base model's batch again."""
    llm = make_llm(case, enforce_eager=False, max_loras=2)
    try:
        runner = llm.engine.runner.graph_runner
        assert runner is not None
        assert sorted(runner.base_graphs) == sorted(runner.graphs)
        for jobs, kind in (
            ([(None, i) for i in range(len(PROMPTS))], "base"),
            ([("all", i) for i in range(len(PROMPTS))], "lora"),
            ([(None, i) for i in range(len(PROMPTS))], "base"),
        ):
            decode_graph_kinds.clear()
            assert generate(llm, case, jobs) == [expected[name][i] for name, i in jobs]
            assert decode_graph_kinds and set(decode_graph_kinds) == {kind}
    finally:
        llm.engine.shutdown()


def test_a_decode_graph_launches_one_lora_kernel_a_wrapped_projection(
    case: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LoRA launches each graph captured at start-up (its eager run before the capture and
    the captured one: twice each): a graph with LoRA the fused kernel once a wrapped projection
    where its table has at most FUSED_MAX_TILES tiles (every decode graph here), else the
    shrink and the expand; a decode graph's base-only twin none."""
    from collections import Counter

    from engine_core.attention.base import AttentionMetadata
    from engine_core.cuda_graph import CudaGraphRunner
    from engine_core.lora.triton_lora import FUSED_MAX_TILES
    from tests.lora_fixtures import count_lora_launches

    launches = count_lora_launches(monkeypatch)
    captured: list[tuple[bool, bool, int, Counter[str]]] = []
    capture_one = CudaGraphRunner._capture_one

    def recording(
        self: CudaGraphRunner, rows: int, meta: AttentionMetadata, *args, **kwargs
    ) -> torch.cuda.CUDAGraph:
        before = Counter(launches)
        graph = capture_one(self, rows, meta, *args, **kwargs)
        lora = kwargs.get("lora", True)
        captured.append((meta.is_decode_only, lora, rows, Counter(launches) - before))
        return graph

    monkeypatch.setattr(CudaGraphRunner, "_capture_one", recording)
    llm = make_llm(case, enforce_eager=False, max_loras=3)
    try:
        assert llm.engine.runner.loras is not None
        wrapped = len(llm.engine.runner.loras.layers)
        runner = llm.engine.runner.graph_runner
        assert runner is not None
    finally:
        llm.engine.shutdown()
    assert wrapped == 4 * 2
    decode = [(lora, rows, n) for is_decode, lora, rows, n in captured if is_decode]
    assert sorted(rows for lora, rows, _ in decode if lora) == runner.batch_sizes
    assert sorted(rows for lora, rows, _ in decode if not lora) == runner.batch_sizes
    fused = Counter({"_fused_kernel": 2 * wrapped})
    split = Counter({"_shrink_kernel": 2 * wrapped, "_expand_kernel": 2 * wrapped})

    def with_lora(rows: int) -> Counter[str]:
        return fused if tile_capacity(rows, 3) <= FUSED_MAX_TILES else split

    assert FUSED_MAX_TILES == 0 or with_lora(runner.max_batch) == fused
    for lora, rows, counts in decode:
        assert counts == (with_lora(rows) if lora else Counter()), rows
    prefill = [(rows, n) for is_decode, _, rows, n in captured if not is_decode]
    assert prefill
    for rows, counts in prefill:
        assert counts == with_lora(rows), rows


# ---- nothing compiles mid-serving ----------------------------------------------------------------


def compiled_in_lora_workloads(base: str, first: str, second: str) -> tuple[list[str], int]:
    """The Triton kernels an engine with LoRA and graphs builds for a second workload after a
    first with the same features at other sizes (eager prefills of 150 and then 248 tokens,
    prefill graphs up to 32 tokens only, decode batches shrinking to one row), two adapters and
    the base model mixed in each; and the tokens the second generated."""
    import random

    import triton

    # The engine of tests/test_cuda_graph.py's check for the base model, with LoRA.
    llm = LLM(
        base, device="cuda", dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=8,
        enable_lora=True, max_loras=2, max_lora_rank=8, max_prefill_graph_tokens=32,
    )  # fmt: skip
    rng = random.Random(3)
    adapters = [LoraRef("first", first), None, LoraRef("second", second)]

    def workload(lengths: tuple[int, ...], max_tokens: tuple[int, ...]) -> int:
        prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
        loras = [adapters[i % len(adapters)] for i in range(len(prompts))]
        out = llm.generate(prompts, params, detokenize=False, lora=loras)
        return sum(len(o.token_ids) for o in out)

    try:
        workload((40, 50, 60), (8, 8, 8))
        compiled: list[str] = []
        triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["repr"])
        tokens = workload((20, 33, 47, 70, 78), (90, 70, 50, 30, 20))
    finally:
        llm.engine.shutdown()
    return compiled, tokens


def _compiled_in_lora_workloads_main() -> None:
    """Child process entry: compiled_in_lora_workloads(*argv) as JSON on stdout's last line."""
    import json
    import sys

    print(json.dumps(compiled_in_lora_workloads(*sys.argv[1:4])))


def test_nothing_compiles_mid_serving_with_lora(case: dict[str, Path]) -> None:
    """Once a LoRA workload has run, one of other sizes compiles no Triton kernel: the tile
    table starts aligned and the kernels do not specialize on what changes with a step's rows
    (a compilation mid-serving stalls every running request). In a fresh process, where no
    earlier test built a variant that would hide one."""
    import json
    import subprocess
    import sys

    code = "from tests.test_lora_gpu import _compiled_in_lora_workloads_main as m; m()"
    args = [str(case["base"]), str(case["all"]), str(case["mlp"])]
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert tokens == 90 + 70 + 50 + 30 + 20  # the workload ran to the end
    assert compiled == []
