"""Tensor parallelism over gloo on the CPU: TP=2 gives TP=1's (and HF's) greedy tokens.

Tiny random models of each sharding pattern: Llama with GQA and an untied LM head, Qwen2 with
q/k/v bias and a tied embedding, GPT-2 with its fused c_attn. The vocabulary (387) is odd, so the
last vocabulary shard is padded and the logits gather must cut it off. Block size 4 and a small
step budget make the batches mix prefills, prompt chunks, prefix-cache hits and decodes, so every
field of the broadcast step inputs matters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    Llama4TextConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

from engine_core.llm import LLM, CompletionOutput
from engine_core.models.layers import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    TPSharded,
    VocabParallelEmbedding,
)
from engine_core.parallel import get_tp_group
from protocol.address import private_ipc_address, remove_ipc_files
from protocol.client import EngineClient
from protocol.messages import RequestError, SamplingParams, StepOutputs
from tests.factories import tiny_hf_sizes
from tests.paged_harness import hf_greedy

VOCAB = 387
NEW_TOKENS = 16
ENGINE_ARGS = {"block_size": 4, "num_kv_blocks": 96, "max_model_len": 128}
SIZES = tiny_hf_sizes(VOCAB)
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    # Positions past 256: the warm-up's shared-prefix decodes (test_tp2_warm_up_...).
    "llama": lambda: LlamaConfig(
        **{**SIZES, "max_position_embeddings": 512}, tie_word_embeddings=False
    ),
    "qwen2_tied": lambda: Qwen2Config(**SIZES, tie_word_embeddings=True),
    # Mixture of experts: every expert's width split over the ranks, the router replicated; the
    # Qwen3-MoE has a dense layer (mlp_only_layers) between two sparse ones.
    "mixtral": lambda: MixtralConfig(**SIZES, num_local_experts=6, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **(SIZES | {"num_hidden_layers": 3}),
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # KV layer groups (engine_core/kv_groups.py): a sliding layer beside a full one, so each
    # rank unpacks a table and a slot mapping per group, and gives window blocks back.
    "gemma3_groups": lambda: Gemma3TextConfig(
        **SIZES, head_dim=16, sliding_window=4, sliding_window_pattern=2
    ),
    # Llama 4: chunked layers (chunk 8: the prompts cross chunks) beside a NoPE one, the query
    # temperature and L2 QK norm per head, the MoE's experts and shared expert split, the router
    # replicated.
    "llama4": lambda: Llama4TextConfig(
        **(SIZES | {"num_hidden_layers": 4, "intermediate_size": 32}),
        head_dim=16,
        intermediate_size_mlp=64,
        num_local_experts=4,
        interleave_moe_layer_step=2,
        attention_chunk_size=8,
        floor_scale=4,
        attn_scale=0.5,
    ),
    "gpt2": lambda: GPT2Config(
        vocab_size=VOCAB,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
    ),  # fmt: skip
}


def make_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 23)]
    # Shares the first 20 tokens (5 blocks of 4) with the 23-token prompt: a prefix-cache hit.
    prompts.append(prompts[2][:20] + [1, 2, 3])
    return prompts


PROMPTS = make_prompts()


def write_model(name: str, folder: Path, config: PretrainedConfig | None = None) -> nn.Module:
    """A random HF model (CONFIGS[name], or ``config``) saved to ``folder``; every parameter
    random (HF zero-initialises biases, which would hide a bias-sharding bug), norm scales
    near 1."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config or CONFIGS[name]()).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(1 + noise if param.ndim == 1 and pname.endswith("weight") else noise)
    model.save_pretrained(folder)
    return model


def saved_case(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """CONFIGS[name] saved to a folder of its own, and HF's greedy tokens for PROMPTS on it."""
    folder = tmp_path_factory.mktemp(name)
    hf_model = write_model(name, folder)
    return folder, [hf_greedy(hf_model, p, NEW_TOKENS).tokens[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The Llama case, written once for every test of the module that only reads it."""
    return saved_case("llama", tmp_path_factory)


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]]]:
    if request.param == "llama":
        return request.getfixturevalue("llama")
    return saved_case(request.param, tmp_path_factory)


def run_llm(folder: Path, tp: int, params: SamplingParams) -> list[CompletionOutput]:
    """PROMPTS through the offline API at tensor-parallel size ``tp``."""
    llm = LLM(
        str(folder),
        tensor_parallel_size=tp,
        max_num_batched_tokens=16,
        max_num_seqs=16,
        **ENGINE_ARGS,
    )
    try:
        return llm.generate(PROMPTS, params, detokenize=False)
    finally:
        llm.engine.shutdown()


def generate(folder: Path, tp: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and the chosen tokens' logprobs, run through the offline API."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    outs = run_llm(folder, tp, params)
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


def test_tp2_matches_tp1_and_hf(case: tuple[Path, list[list[int]]]) -> None:
    folder, reference = case
    tokens1, logprobs1 = generate(folder, tp=1)
    tokens2, logprobs2 = generate(folder, tp=2)
    assert tokens1 == reference
    assert tokens2 == tokens1
    # The whole distribution crossed the gather intact, not just its argmax.
    torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-4, rtol=0)
    assert get_tp_group().size == 1, "the group outlived its engine"


def test_tp2_scores_prompt_tokens_like_tp1(llama: tuple[Path, list[list[int]]]) -> None:
    """Prompt logprobs under tensor parallelism: rank 0 sends the scored rows with each step and
    every rank projects them (the logits gather is a collective), in 16-token chunks here."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    scored = []
    for tp in (1, 2):
        outs = run_llm(llama[0], tp, params)
        scored.append([[lp.logprob for lp in o.prompt_logprobs or []] for o in outs])
    assert (
        [len(s) for s in scored[1]] == [len(s) for s in scored[0]] == [len(p) - 1 for p in PROMPTS]
    )
    flat1, flat2 = (torch.tensor([lp for s in one for lp in s]) for one in scored)
    torch.testing.assert_close(flat2, flat1, atol=1e-4, rtol=0)


def test_tp2_warm_up_changes_no_later_token(llama: tuple[Path, list[list[int]]]) -> None:
    """The start-up warm-up steps (engine_core/warm_up.py), which rank 0 runs on CUDA once its
    step channel is open: the worker follows them as any step (the shared-prefix decodes
    too: contexts of 256 tokens fit), and greedy, sampled and prompt-logprob outputs after it
    are those of an engine that never ran it. Called by hand: on the CPU no runner runs it."""
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.9, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    ]

    def outputs(warm_up: bool) -> list[tuple[object, ...]]:
        llm = LLM(
            str(llama[0]),
            tensor_parallel_size=2,
            max_num_batched_tokens=64,  # every sampler path (tests/test_warm_up.py)
            max_num_seqs=16,
            **{**ENGINE_ARGS, "max_model_len": 260},
        )
        try:
            if warm_up:
                assert len(llm.engine.runner.warm_up_plans()) == 7
                llm.engine.runner.warm_up()
            outs = llm.generate(PROMPTS, params, detokenize=False)
        finally:
            llm.engine.shutdown()
        return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in outs]

    assert outputs(warm_up=True) == outputs(warm_up=False)


def test_a_tp2_step_cut_by_ctrl_c_stops_the_workers_and_the_llm_says_so(
    llama: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C inside a step, after rank 0 sent it to the worker: the worker waits in a
    collective rank 0 left, so no step can follow. The worker is stopped, and the next call
    raises at once naming why (it would have hung in that collective)."""
    llm = LLM(str(llama[0]), tensor_parallel_size=2, max_num_seqs=16, **ENGINE_ARGS)
    try:
        workers = list(llm.engine.runner.workers)
        real_forward, calls = llm.engine.runner.forward, []

        def cut_forward(*args: Any, **kwargs: Any) -> Any:
            calls.append(None)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real_forward(*args, **kwargs)

        monkeypatch.setattr(llm.engine.runner, "forward", cut_forward)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, params, detokenize=False)
        for worker in workers:
            worker.join(timeout=30)
            assert not worker.is_alive(), "a worker outlived the cut step"
        with pytest.raises(RuntimeError, match="a step of its parallel ranks was cut"):
            llm.generate(PROMPTS, params, detokenize=False)
    finally:
        llm.engine.shutdown()


def test_tp1_builds_the_plain_layers(llama: tuple[Path, list[list[int]]]) -> None:
    """TP=1 keeps the single-process path: plain torch layers, no collective anywhere."""
    llm = LLM(str(llama[0]), **ENGINE_ARGS)
    model = llm.engine.runner.model
    sharded = (RowParallelLinear, ColumnParallelLinear, VocabParallelEmbedding)
    assert not any(isinstance(m, sharded) for m in model.modules())
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert type(model.model.layers[0].self_attn.o_proj) is Linear
    # Merged q/k/v and gate/up keep their full widths.
    merged = [m for m in model.modules() if isinstance(m, TPSharded)]
    assert merged and all(m.out_features in (64 + 2 * 32, 2 * 128) for m in merged)


@pytest.mark.parametrize("size", [3, 4])
def test_sizes_that_do_not_divide_the_heads_are_refused(
    llama: tuple[Path, list[list[int]]], size: int
) -> None:
    """4 heads and 2 KV heads: 3 divides neither, 4 not the KV heads; refused before any
    worker starts (a worker left waiting for its peers would hang)."""
    with pytest.raises(ValueError, match=f"--tensor-parallel-size {size} must .* KV heads"):
        LLM(str(llama[0]), tensor_parallel_size=size, **ENGINE_ARGS)
    assert children_running_spawn(os.getpid()) == []


# ---- a real `tandem engine --tensor-parallel-size 2` ------------------------------------------


def children_running_spawn(pid: int) -> list[int]:
    """Child processes of ``pid`` started by multiprocessing's spawn (the TP workers)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = []
    for child in out.split():
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            kids.append(int(child))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def collect(client: EngineClient, ids: set[str], timeout: float = 120) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    pending = set(ids)
    deadline = time.monotonic() + timeout
    while pending:
        assert time.monotonic() < deadline, f"never finished: {sorted(pending)}"
        msg = client.recv(timeout=1.0)
        assert not isinstance(msg, RequestError), msg
        if isinstance(msg, StepOutputs):
            for out in msg.outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    pending.discard(out.request_id)
    return tokens


@pytest.mark.slow
def test_tp2_engine_process_serves_hf_tokens_and_takes_its_workers_along(
    llama: tuple[Path, list[list[int]]],
) -> None:
    folder, reference = llama
    address = private_ipc_address()
    cmd = [sys.executable, "-m", "frontend.cli", "engine", "--model", str(folder),
           "--address", str(address), "--tensor-parallel-size", "2", "--block-size", "4",
           "--num-kv-blocks", "96", "--max-model-len", "128", "--max-num-batched-tokens", "16",
           "--max-num-seqs", "16",
           "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(cmd)
    try:
        with EngineClient(address) as client:
            client.connect(timeout=120)
            workers = children_running_spawn(proc.pid)
            assert len(workers) == 1, "one worker process for rank 1"
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            for i, prompt in enumerate(PROMPTS):  # all in flight at once: mixed batches
                client.add_request(f"r{i}", prompt, params)
            got = collect(client, {f"r{i}" for i in range(len(PROMPTS))})
            assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 15
        while any(alive(w) for w in workers):
            assert time.monotonic() < deadline, "a TP worker outlived its engine"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remove_ipc_files(address)


@pytest.mark.slow
def test_an_engine_whose_worker_dies_exits_instead_of_hanging(
    llama: tuple[Path, list[list[int]]],
) -> None:
    """SIGKILL rank 1 of an idle TP=2 engine: rank 0 would wait for it in its next collective
    for days; it must end its process at once with WORKER_LOST_EXIT_CODE (which `tandem serve`
    answers by starting a new engine core)."""
    from engine_core.tp_runner import WORKER_LOST_EXIT_CODE

    address = private_ipc_address()
    cmd = [sys.executable, "-m", "frontend.cli", "engine", "--model", str(llama[0]),
           "--address", str(address), "--tensor-parallel-size", "2", "--block-size", "4",
           "--num-kv-blocks", "96", "--max-model-len", "128", "--log-level", "WARNING"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        with EngineClient(address) as client:
            client.connect(timeout=120)
        (worker,) = children_running_spawn(proc.pid)
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=15) == WORKER_LOST_EXIT_CODE
        assert "tensor-parallel worker tandem-tp1" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        remove_ipc_files(address)


def test_tp2_honours_constraints_like_tp1(tiny_model_dir: Path) -> None:
    """A JSON-schema constraint under TP=2 (sampling on rank 0) gives TP=1's tokens, and every
    output validates."""
    import json

    import jsonschema

    from protocol.messages import Constraint, ConstraintKind
    from tests.structured_cases import SCHEMAS

    schema = SCHEMAS["flat object"]
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    params = [
        SamplingParams(max_tokens=48, temperature=1.0, seed=s, constraint=constraint)
        for s in range(3)
    ]
    runs = []
    for tp in (1, 2):
        llm = LLM(str(tiny_model_dir), tensor_parallel_size=tp, max_num_seqs=8, **ENGINE_ARGS)
        try:
            runs.append(llm.generate([[1, 2, 3]] * 3, params))
        finally:
            llm.engine.shutdown()
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    for out in runs[1]:
        jsonschema.validate(json.loads(out.text), schema)


def vote_in_rank(rank: int, port: int, results: Any) -> None:
    from engine_core.parallel import connect_store, join_tp_group, leave_tp_group
    from engine_core.peer_all_reduce import agree

    tp = join_tp_group(connect_store(port, 2), rank, 2, torch.device("cpu"))
    try:
        results.put((rank, agree(rank == 0, 132 - rank, tp.cpu_group)))
    finally:
        leave_tp_group()


def test_the_ranks_agree_on_the_peer_all_reduce() -> None:
    """One rank unable (no peer atomics, or a second group in its process) turns it off on every
    rank, and all size the buffer for the GPU with the fewest multiprocessors: a rank that took
    the peer kernel while another took NCCL would wait for ever."""
    from engine_core.parallel import create_store

    store = create_store(2)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=vote_in_rank, args=(r, store.port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert got == {0: (False, 131), 1: (False, 131)}


def test_tp2_ngram_speculation_gives_tp1_s_tokens(llama: tuple[Path, list[list[int]]]) -> None:
    """N-gram speculation at TP=2: the workers compute the drafted rows' logits in rank 0's one
    product, so prompts that repeat (drafts kept and rejected) give the plain TP=1 engine's
    greedy tokens and logprobs."""
    folder, _ = llama
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13] * 3, [3, 4, 5]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    runs, counts = [], None
    for tp, extra in ((1, {}), (2, {"speculative_config": spec})):
        llm = LLM(str(folder), tensor_parallel_size=tp, max_num_seqs=8, **ENGINE_ARGS, **extra)
        try:
            runs.append(llm.generate(prompts, params, detokenize=False))
            counts = llm.engine.scheduler.counts()
        finally:
            llm.engine.shutdown()
    assert counts is not None and counts.spec_draft_tokens > counts.spec_accepted_tokens > 0
    assert [o.token_ids for o in runs[1]] == [o.token_ids for o in runs[0]]
    for theirs, ours in zip(runs[0], runs[1], strict=True):
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in ours.logprobs]),
            torch.tensor([lp.logprob for lp in theirs.logprobs]),
            atol=1e-4,
            rtol=0,
        )
