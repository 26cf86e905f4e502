"""Qwen3-Next on the CPU against HF transformers: a tiny random ``Qwen3NextForCausalLM`` (two
gated DeltaNet layers, two gated full-attention layers, routed experts with a shared one) saved
with ``save_pretrained`` gives HF's greedy tokens through the real engine (scheduler, block
manager with its state slots, runner): alone, batched, with a prompt split into chunks, under
preemption; an abort gives its slot back. The delta rule's chunked form is checked against the
token-by-token recurrence, and the config fields we do not implement are refused by name."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3NextConfig

from engine_core.config import EngineConfig, LinearAttentionConfig
from engine_core.forward_context import StateRows
from engine_core.llm import LLM
from engine_core.memory_plan import (
    Budget,
    kv_block_bytes,
    min_kv_bytes,
    plan_memory,
    state_slot_bytes,
)
from engine_core.models import build_model, model_config_from_hf
from engine_core.models.delta_rule import (
    FlaKernels,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
)
from engine_core.models.qwen3_next import GatedDeltaNet
from engine_core.presets import PRESETS, hf_config
from engine_core.request import Request
from protocol.messages import SamplingParams
from tests.paged_harness import hf_greedy, load_float32, random_prompts, randomize

VOCAB = 320
NEW_TOKENS = 16
BLOCK = 16


def tiny_config(**overrides: Any) -> Qwen3NextConfig:
    """Four layers, every second fully attending; key heads serve two value heads each; a
    quarter of each 16-dim attention head rotates; four experts (top 2) and a shared one."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "full_attention_interval": 2,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    return Qwen3NextConfig(**(fields | overrides))


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config()).eval()
    randomize(model, 0)
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 2
    folder = tmp_path_factory.mktemp("qwen3-next")
    model.save_pretrained(folder)
    return folder, model


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def make_llm(folder: Path, **kwargs: Any) -> LLM:
    settings = {
        "block_size": BLOCK,
        "num_kv_blocks": 128,
        "max_model_len": 400,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 4,
    }
    return LLM(str(folder), **(settings | kwargs))


def expected_tokens(hf_model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf_model, prompt, NEW_TOKENS).tokens[0] for prompt in prompts]


def check_all_given_back(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    bm.check_integrity()
    assert bm.num_used_blocks == 0
    assert bm.num_free_state_slots == bm.num_state_slots == 4


@pytest.mark.parametrize("length", [1, 7, 150])
def test_one_request_matches_hf(qwen3_next: tuple[Path, torch.nn.Module], length: int) -> None:
    """Alone: a one-token prompt, one shorter than the delta rule's 64-token blocks and the
    attention's block, and one over two of them (the chunked form's block loop)."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (length,))
    llm = make_llm(folder)
    try:
        got = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in got] == expected_tokens(hf_model, prompts)
        check_all_given_back(llm)
    finally:
        llm.engine.shutdown()


def test_a_batch_of_different_lengths_matches_hf(qwen3_next: tuple[Path, torch.nn.Module]) -> None:
    """Four prompts prefilled in one step, then decoded together (each row its own slot)."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (5, 33, 97, 150))
    llm = make_llm(folder)
    try:
        got = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in got] == expected_tokens(hf_model, prompts)
        check_all_given_back(llm)
    finally:
        llm.engine.shutdown()


def test_chunked_prefill_carries_the_state_across_chunks(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """A budget of 23 tokens a step splits a 150-token prompt into seven chunks (mid
    convolution window, mid attention block, mid delta-rule block), while another request
    decodes beside them: each chunk continues from the state the chunk before left."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (150, 9))
    llm = make_llm(folder, max_num_batched_tokens=23)
    try:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"r{i}", prompt, greedy()))
        tokens: dict[str, list[int]] = {"r0": [], "r1": []}
        steps_before_first = 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request.request_id] += out.new_token_ids
            steps_before_first += not tokens["r0"]
        assert steps_before_first >= 7  # the long prompt really came in chunks
        assert [tokens["r0"], tokens["r1"]] == expected_tokens(hf_model, prompts)
        check_all_given_back(llm)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_preempted_requests_recompute_their_state(
    qwen3_next: tuple[Path, torch.nn.Module], overlap: bool
) -> None:
    """Three long requests in a pool too small for all three: the preempted ones give their
    slot back and, admitted again, recompute their state from prompt and outputs from zero;
    planned ahead of the step in flight (overlap) or not."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (150, 210, 97))
    llm = make_llm(
        folder,
        num_kv_blocks=20,
        max_model_len=320,  # all 20 blocks
        max_num_batched_tokens=48,
        max_num_seqs=3,
        async_scheduling=overlap,
    )
    try:
        got = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in got] == expected_tokens(hf_model, prompts)
        assert llm.engine.scheduler.counts().preemptions > 0
        bm = llm.engine.scheduler.block_manager
        bm.check_integrity()
        assert bm.num_used_blocks == 0 and bm.num_free_state_slots == 3
    finally:
        llm.engine.shutdown()


def test_an_abort_gives_the_slot_back_and_a_new_request_starts_from_zero(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """An aborted request's slot and blocks go back at once; the next request takes that
    slot (dirty with the aborted one's state) and still gets HF's tokens."""
    folder, hf_model = qwen3_next
    prompts = random_prompts(VOCAB, (40, 61))
    llm = make_llm(folder, max_num_seqs=1, max_num_batched_tokens=64)
    try:
        engine = llm.engine
        bm = engine.scheduler.block_manager
        engine.add_request(Request("gone", prompts[0], greedy(100)))
        for _ in range(5):
            engine.step()
        assert bm.num_free_state_slots == 0 and bm.num_used_blocks > 0
        engine.abort(["gone"])
        assert bm.num_free_state_slots == 1 and bm.num_used_blocks == 0
        got = llm.generate([prompts[1]], greedy(), detokenize=False)
        assert got[0].token_ids == expected_tokens(hf_model, prompts[1:])[0]
        bm.check_integrity()
    finally:
        engine.shutdown()


VARIANTS = {
    # q/k/v/o biases, a dense MLP in layer 0, as many value heads as key heads.
    "bias+dense+no-gva": {
        "attention_bias": True, "mlp_only_layers": [0], "linear_num_value_heads": 2,
    },
    # HF's own pattern (three linear layers, then a full one), experts without renormalising,
    # no shared expert, a convolution of 2.
    "pattern-of-4": {
        "num_hidden_layers": 5, "full_attention_interval": 4, "norm_topk_prob": False,
        "shared_expert_intermediate_size": 0, "linear_conv_kernel_dim": 2,
    },
}  # fmt: skip


@pytest.mark.parametrize("overrides", list(VARIANTS.values()), ids=list(VARIANTS))
def test_config_variants_match_hf(overrides: dict[str, Any], tmp_path: Path) -> None:
    """Other values of the fields the model honours, through a batch with a chunked prompt."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config(**overrides)).eval()
    randomize(hf_model, 1)
    hf_model.save_pretrained(tmp_path)
    prompts = random_prompts(VOCAB, (90, 13))
    llm = make_llm(tmp_path, max_num_batched_tokens=40)
    try:
        got = llm.generate(prompts, greedy(), detokenize=False)
        assert [o.token_ids for o in got] == expected_tokens(hf_model, prompts)
    finally:
        llm.engine.shutdown()


def test_a_resumed_request_continues_hfs_tokens(qwen3_next: tuple[Path, torch.nn.Module]) -> None:
    """As after an engine's death: a new request of the prompt and HF's first 5 tokens, those
    counted as its output, computes its state from all of them and goes on with HF's tokens."""
    folder, hf_model = qwen3_next
    prompt = random_prompts(VOCAB, (60,))[0]
    want = expected_tokens(hf_model, [prompt])[0]
    llm = make_llm(folder)
    try:
        engine = llm.engine
        engine.add_request(Request.resumed("again", prompt + want[:5], 5, greedy()))
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        assert tokens == want[5:]
        check_all_given_back(llm)
    finally:
        engine.shutdown()


# ------------------------------------------------------------------------------ the delta rule


def delta_inputs(heads: int, length: int, dk: int, dv: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(heads, length, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(heads, length, dk, generator=gen), dim=-1)
    v = torch.randn(heads, length, dv, generator=gen)
    g = -torch.rand(heads, length, generator=gen)  # decays in (1/e, 1]
    beta = torch.rand(heads, length, generator=gen)
    state = torch.randn(heads, dk, dv, generator=gen)
    return [q, k, v, g, beta, state]


def test_a_cuda_engine_without_fla_is_told_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch form of the prompt chunks is the slow path on a GPU: the engine says so at
    start-up, naming the package; on the CPU, or with the kernels there, it says nothing."""
    from engine_core.models import delta_rule

    monkeypatch.setattr(delta_rule, "fla_kernels", lambda: None)
    assert delta_rule.missing_prompt_kernels(torch.device("cpu")) is None
    note = delta_rule.missing_prompt_kernels(torch.device("cuda"))
    assert note is not None and "`pip install fla-core`" in note
    monkeypatch.setattr(delta_rule, "fla_kernels", lambda: delta_rule.FlaKernels(chunk=print))
    assert delta_rule.missing_prompt_kernels(torch.device("cuda")) is None


def test_chunked_form_equals_the_token_by_token_recurrence() -> None:
    """150 tokens (two full blocks of 64 and a padded one) from a non-zero state: the
    chunked form's outputs and final state are the recurrence's; and split 50 + 100 with the
    state carried between, the same again."""
    q, k, v, g, beta, state = delta_inputs(3, 150, 8, 6, seed=0)
    outs, s = [], state[None]
    for t in range(150):
        out, s = recurrent_gated_delta_step(
            q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t], beta[None, :, t], s
        )
        outs.append(out[0])
    want_out, want_state = torch.stack(outs, dim=1), s[0]
    got_out, got_state = chunk_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(got_out, want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=1e-4, rtol=1e-4)
    first, mid = chunk_gated_delta_rule(
        q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50], state
    )
    second, end = chunk_gated_delta_rule(
        q[:, 50:], k[:, 50:], v[:, 50:], g[:, 50:], beta[:, 50:], mid
    )
    torch.testing.assert_close(torch.cat([first, second], dim=1), want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(end, want_state, atol=1e-4, rtol=1e-4)


def fla_contract_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-linear-attention's ``chunk_gated_delta_rule`` as its docstring states it (q, k
    [1, T, H, K] normalised inside, v [1, T, HV, V], one initial state per sequence of
    ``cu_seqlens``, value head i reading key head i // (HV / H)), in our torch code."""
    assert q.shape[0] == 1 and output_final_state and use_qk_l2norm_in_kernel
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False)):
        qn, kn, vn = contract_heads(q[0, lo:hi], k[0, lo:hi], v[0, lo:hi])
        out, final = chunk_gated_delta_rule(
            qn.transpose(0, 1), kn.transpose(0, 1), vn.transpose(0, 1), g[0, lo:hi].T,
            beta[0, lo:hi].float().T, initial_state[n].float(),
        )  # fmt: skip
        outs.append(out.transpose(0, 1))
        finals.append(final)
    return torch.cat(outs)[None].to(v.dtype), torch.stack(finals)


def contract_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_key = v.shape[1] // q.shape[1]
    q = torch.nn.functional.normalize(q.float(), dim=-1, eps=0).repeat_interleave(per_key, 1)
    k = torch.nn.functional.normalize(k.float(), dim=-1, eps=0).repeat_interleave(per_key, 1)
    return q * q.shape[-1] ** -0.5, k, v.float()


def test_the_cuda_kernels_call_matches_the_torch_path() -> None:
    """The CUDA path's plumbing for prompt chunks (which rows and slots go to the launch, the
    heads' layout, the variable-length batch, the states gathered and scattered back), run on
    the CPU with a kernel that follows flash-linear-attention's stated contract: the torch
    path's outputs and states. tests/test_qwen3_next_gpu.py holds the real kernel to the same;
    the decodes' own kernel is tests/test_graph_groups.py's."""
    config = model_config_from_hf(hf_dict())
    layer = GatedDeltaNet(config)
    la = config.linear_attention
    assert la is not None
    lengths, fresh = [1, 1, 70, 1, 130, 5], [False, False, False, True, True, False]
    starts = [0, *itertools.accumulate(lengths)]
    rows = StateRows.plan(list(range(6)), fresh, starts, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randn(starts[-1], la.conv_dim, generator=gen)
    g = -torch.rand(starts[-1], la.num_value_heads, generator=gen)
    beta = torch.rand(starts[-1], la.num_value_heads, generator=gen)
    shape = layer.state_shapes(6)[1]
    initial = torch.randn(shape, generator=gen)
    results = []
    for run in ("torch", "fla"):
        state = initial.clone()
        layer.bind_state(torch.zeros(layer.state_shapes(6)[0]), state)
        out = torch.zeros(starts[-1], la.num_value_heads, la.value_head_dim)
        layer.decode_torch(mixed, g, beta, rows, out)
        if run == "torch":
            layer.chunks_torch(mixed, g, beta, rows, starts, out)
        else:
            layer.chunks_fla(FlaKernels(fla_contract_chunk), mixed, g, beta, rows, out)
        results.append((out, state))
    (want_out, want_state), (got_out, got_state) = results
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
    assert not torch.equal(want_state, initial)  # every slot was written


# ----------------------------------------------------------------------------- config and plan


def hf_dict(**overrides: Any) -> dict[str, Any]:
    return tiny_config().to_dict() | {"architectures": ["Qwen3NextForCausalLM"]} | overrides


def test_config_fields() -> None:
    config = model_config_from_hf(hf_dict())
    assert config.architecture == "qwen3_next"
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert config.attention_layer_ids == (1, 3)
    assert config.rotary_dim == 4 and config.norm_unit_offset and config.qk_norm
    assert config.attention_output_gate
    assert config.linear_attention == LinearAttentionConfig(2, 4, 8, 8, 4)
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.shared_expert_intermediate_size == 48
    # K and V of the two attention layers only: the linear ones hold a state instead.
    assert config.kv_elements_per_token(2) == 2 * 2 * 2 * 16


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layer_types", ["linear_attention", "sliding_attention"] * 2),
        ("use_sliding_window", True),
        ("sliding_window", 128),
        ("linear_num_value_heads", 3),
        ("linear_conv_kernel_dim", 1),
        ("n_shared_experts", 2),
        ("routed_scaling_factor", 2.5),
        ("hidden_act", "gelu"),
    ],
)
def test_fields_we_do_not_implement_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(hf_dict(**{field: value}))


def test_state_slots_are_counted_in_the_memory_plan() -> None:
    """A slot of the tiny model: per linear layer the convolution's last 3 inputs of its
    2 * 2 * 8 + 4 * 8 = 64 channels and 4 value heads' 8 x 8 states, float32; the start-up
    plan adds one per --max-num-seqs and one per saved state (--state-snapshots, by default as
    many) to the least KV cache and to the one it will allocate."""
    config = model_config_from_hf(hf_dict())
    slot = 2 * (64 * 3 + 4 * 8 * 8) * 4
    assert state_slot_bytes(config, torch.float32) == slot
    assert state_slot_bytes(PRESETS["smollm2-135m"], torch.float32) == 0
    with torch.device("meta"):
        module = build_model(config)
    cpu, f32 = torch.device("cpu"), torch.float32
    blocks = 40 * kv_block_bytes(config, config.num_kv_heads, 16, f32)
    for snapshots, states in ((None, 16), (3, 11), (0, 8)):
        engine = EngineConfig(
            max_num_seqs=8, max_model_len=256, num_kv_blocks=40, block_size=16,
            state_snapshots=snapshots,
        )  # fmt: skip
        plan = plan_memory(engine, config, module, cpu, f32, f32, Budget(2**40, "test"))
        tokens = engine.token_budget
        least = min_kv_bytes(config, config.num_kv_heads, 256, 16, f32, tokens)
        assert plan.min_kv_bytes == least + states * slot
        assert plan.kv_bytes == blocks + states * slot


def test_more_slots_than_the_cache_holds_are_refused(
    qwen3_next: tuple[Path, torch.nn.Module],
) -> None:
    """Slots of 3 KiB each: 1,024 of them need more than a 2 MiB KV budget, named by flag."""
    folder, _ = qwen3_next
    with pytest.raises(ValueError, match="--max-num-seqs 1024"):
        LLM(str(folder), kv_cache_memory_gb=2 / 1024, max_num_seqs=1024, max_model_len=64)


def test_the_80b_preset_has_the_real_layer_shapes() -> None:
    """Qwen3-Next-80B-A3B's shapes on 24 of its 48 layers (the pattern of three linear
    layers and one full kept): 512 experts of 512 (top 10) and a shared one of 512."""
    config = PRESETS["qwen3-next-80b"]
    hf = hf_config("qwen3-next-80b")
    assert hf["architectures"] == ["Qwen3NextForCausalLM"]
    assert config.num_layers == 24 and config.attention_layer_ids == tuple(range(3, 24, 4))
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2048, 16, 2, 256,
    )  # fmt: skip
    assert config.linear_attention == LinearAttentionConfig(16, 32, 128, 128, 4)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        512, 10, 512,
    )  # fmt: skip
    assert config.shared_expert_intermediate_size == 512 and config.rotary_dim == 64


@pytest.mark.parametrize("quantization", ["fp8", "w8a8"])
def test_quantization_flag_is_refused(
    qwen3_next: tuple[Path, torch.nn.Module], quantization: str
) -> None:
    folder, _ = qwen3_next
    with pytest.raises(ValueError, match="not implemented for Qwen3-Next"):
        load_float32(folder, quantization=quantization)
