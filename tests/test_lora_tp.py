"""LoRA under tensor parallelism, over gloo on the CPU in real worker processes: at TP=2 a batch
mixing PEFT adapters (written by peft on a tiny random Llama with GQA) and the base model gives
each request HF transformers + PEFT's greedy tokens and TP=1's logprobs; adapters of different
ranks and targets share the slots; an adapter written while the engine serves loads on every
rank; Phi-3's fused targets are cut per part; a Qwen3-MoE's expert adapters are cut as its
experts are; what is not built yet is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.llm import LLM, CompletionOutput
from engine_core.parallel import get_tp_group
from protocol.messages import LoraRef, SamplingParams
from tests.factories import write_tiny_llama
from tests.lora_fixtures import peft_greedy, write_adapter, write_moe_case

NEW_TOKENS = 8
PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [200, 31, 77]]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
Job = tuple[str | None, int]  # (adapter name or None for the base model, prompt index)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (4 heads, 2 KV heads: one KV head a rank at TP=2) and two adapters: every
    projection at rank 4; q/v only at rank 8 with rsLoRA."""
    root = tmp_path_factory.mktemp("lora-tp")
    base = write_tiny_llama(root / "base")
    return {
        "root": root,
        "base": base,
        "all": write_adapter(base, root / "all", seed=1),
        "qv": write_adapter(
            base, root / "qv", seed=2, r=8, lora_alpha=4, use_rslora=True,
            target_modules=["q_proj", "v_proj"],
        ),
    }  # fmt: skip


def peft_tokens(case: dict[str, Path], jobs: list[Job]) -> list[list[int]]:
    return [
        peft_greedy(case["base"], None if name is None else case[name], PROMPTS[i], NEW_TOKENS)
        for name, i in jobs
    ]


def make_llm(case: dict[str, Path], tp: int, **kwargs: object) -> LLM:
    fields = dict(
        device="cpu", block_size=4, num_kv_blocks=128, max_model_len=128, max_num_seqs=8,
        max_num_batched_tokens=16, enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    return LLM(str(case["base"]), tensor_parallel_size=tp, **{**fields, **kwargs})


def run(llm: LLM, case: dict[str, Path], jobs: list[Job]) -> list[CompletionOutput]:
    """The jobs in one batch (a small step budget: prefills, chunks and decodes mix)."""
    refs = [None if name is None else LoraRef(name, str(case[name])) for name, _ in jobs]
    return llm.generate([PROMPTS[i] for _, i in jobs], GREEDY, detokenize=False, lora=refs)


def logprobs(outs: list[CompletionOutput]) -> torch.Tensor:
    return torch.tensor([[lp.logprob for lp in o.logprobs] for o in outs])


def test_tp2_mixes_two_adapters_and_the_base_like_peft_and_tp1(case: dict[str, Path]) -> None:
    """Nine requests in one batch, each prompt under each adapter and the base: TP=2 gives
    each HF + PEFT's tokens, and TP=1's logprobs (the whole LoRA delta crossed the shards: a
    row-parallel delta summed twice or a column shard's B rows from the wrong rank would move
    them)."""
    jobs: list[Job] = [(name, i) for i in range(len(PROMPTS)) for name in ("all", None, "qv")]
    want = peft_tokens(case, jobs)
    by_job = dict(zip(jobs, want, strict=True))
    prompts = range(len(PROMPTS))
    for name in ("all", "qv"):  # the reference is not vacuous
        assert [by_job[name, i] for i in prompts] != [by_job[None, i] for i in prompts], name
    outs: dict[int, list[CompletionOutput]] = {}
    for tp in (1, 2):
        llm = make_llm(case, tp)
        try:
            outs[tp] = run(llm, case, jobs)
        finally:
            llm.engine.shutdown()
    assert [o.token_ids for o in outs[2]] == want
    assert [o.token_ids for o in outs[1]] == want
    torch.testing.assert_close(logprobs(outs[2]), logprobs(outs[1]), atol=1e-4, rtol=0)
    assert get_tp_group().size == 1, "the group outlived its engine"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_on_two_gpus_with_graphs_gives_peft_tokens(case: dict[str, Path]) -> None:
    """The same batch on two GPUs: NCCL (or the peer all-reduce), the Triton LoRA kernels over
    each rank's share, the row-parallel delta in the sum the next norm makes, decode graphs
    with and without the LoRA kernels on both ranks."""
    jobs: list[Job] = [(name, i) for i in range(len(PROMPTS)) for name in ("all", None, "qv")]
    llm = make_llm(case, 2, device="cuda", dtype="float32", block_size=16, max_num_seqs=16)
    try:
        outs = run(llm, case, jobs)
        base_only = run(llm, case, [(None, 1)])  # a step with no adapter row: the base graphs
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in outs] == peft_tokens(case, jobs)
    assert [o.token_ids for o in base_only] == peft_tokens(case, [(None, 1)])


def test_tp2_loads_an_adapter_written_while_it_serves(case: dict[str, Path]) -> None:
    """One slot and room for one adapter in host memory: an adapter is served, then another of
    other ranks (r=2, down_proj at 6, o_proj's own alpha) is written while the engine runs and
    a batch mixes it with the first and the base. Every slot write (and every re-read after an
    eviction) happens on both ranks, or the tokens would not be PEFT's."""
    llm = make_llm(case, 2, max_loras=1, max_cpu_loras=1)
    try:
        first: list[Job] = [("all", 0)]
        assert [o.token_ids for o in run(llm, case, first)] == peft_tokens(case, first)
        case["pattern"] = write_adapter(
            case["base"], case["root"] / "pattern", seed=3, r=2, lora_alpha=16,
            rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 3},
        )  # fmt: skip
        jobs: list[Job] = [("pattern", 1), ("all", 2), (None, 0), ("pattern", 2)]
        assert [o.token_ids for o in run(llm, case, jobs)] == peft_tokens(case, jobs)
        assert llm.engine.runner.loras is not None
        # all, then pattern into the same slot (and all again if pattern ran first)
        assert llm.engine.runner.loras.loads >= 2
    finally:
        llm.engine.shutdown()


def test_what_lora_does_not_compose_with_yet_is_refused_by_name(case: dict[str, Path]) -> None:
    base = str(case["base"])
    with pytest.raises(ValueError, match="--enable-lora with --enable-expert-parallel"):
        EngineConfig(base, enable_lora=True, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="--enable-lora with --pipeline-parallel-size > 1"):
        EngineConfig(base, enable_lora=True, pipeline_parallel_size=2)


def test_an_moe_model_at_tp2_gives_peft_tokens_with_expert_adapters(tmp_path: Path) -> None:
    """A tiny Qwen3-MoE at TP=2 (every expert's intermediate dimension split over the ranks,
    each rank's expert slots holding its share): an adapter of the experts, one of q/o and the
    experts' gate_up, and the base model in one batch give HF + PEFT's tokens."""
    moe = write_moe_case(tmp_path)
    jobs: list[Job] = [("both", 0), (None, 0), ("experts", 1), ("both", 2), ("experts", 2)]
    llm = make_llm(moe, 2)
    try:
        out = run(llm, moe, jobs)
    finally:
        llm.engine.shutdown()
    want = peft_tokens(moe, jobs)
    assert [o.token_ids for o in out] == want
    assert out[0].token_ids != out[1].token_ids  # the adapter changed prompt 0's tokens


def test_phi3_fused_targets_at_tp2_give_peft_tokens(tmp_path: Path) -> None:
    """Phi-3's adapters target its fused qkv_proj and gate_up_proj whole: each rank takes its
    rows of q's, k's and v's part of B (and of gate's and up's), as the base weight is cut."""
    from tests.test_models_gemma_phi import make_hf_model

    base = tmp_path / "phi3"
    make_hf_model("phi3_shortrope").save_pretrained(base)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    phi = {"base": base, "a": write_adapter(base, tmp_path / "a", seed=31, target_modules=targets)}
    jobs: list[Job] = [("a", 1), (None, 1), ("a", 0)]
    want = peft_tokens(phi, jobs)
    assert want[0] != want[1]
    llm = make_llm(phi, 2, max_loras=1, max_num_seqs=4, max_model_len=None)  # its 48 positions
    try:
        assert [o.token_ids for o in run(llm, phi, jobs)] == want
    finally:
        llm.engine.shutdown()
