"""Qwen3.5 (text) on the CPU against HF transformers: tiny random models written with
``save_pretrained``, dense in the ``Qwen3_5ForCausalLM`` layout and MoE in the
``Qwen3_5MoeForConditionalGeneration`` one (a vision tower beside the language model), give
HF's greedy tokens and logprobs through the real engine, several prompts in one batch with a
prompt split into chunks. The other layouts (a ConditionalGeneration checkpoint of the dense
model, experts stacked as the published MoE checkpoints hold them) load the same weights; the
fields we do not implement are refused by name. Images: tests/test_vision_qwen3_5.py.
Qwen3-Next's own tests (tests/test_models_qwen3_next.py) cover what the two share: preemption,
aborts, resume, slots.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5TextConfig,
)

from engine_core.llm import LLM
from engine_core.models import build_model, model_config_from_hf
from engine_core.presets import PRESETS
from protocol.messages import SamplingParams
from tests.paged_harness import GreedyResult, hf_greedy, load_float32, random_prompts, randomize

VOCAB = 320
NEW_TOKENS = 12
LENGTHS = (5, 33, 90)  # with a 40-token budget the last comes in three chunks
# The vision tower of the ConditionalGeneration checkpoints: as small as HF builds it.
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
          "out_hidden_size": 64}  # fmt: skip


def text_fields(moe: bool, vocab: int = VOCAB) -> dict[str, Any]:
    """Four layers, every second fully attending (a quarter of each 16-dim head rotating, the
    published M-RoPE sections beside it); key heads serve two value heads each; dense MLPs,
    or four experts (top 2) and a shared one."""
    fields: dict[str, Any] = {
        "vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "max_position_embeddings": 512,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                            "mrope_interleaved": True},
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }  # fmt: skip
    if moe:
        return fields | {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                         "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
    return fields | {"intermediate_size": 96}


class Case:
    """A tiny HF model saved in ``folder``, and HF's greedy reference for the prompts."""

    def __init__(self, hf_model: torch.nn.Module, folder: Path) -> None:
        self.hf_model, self.folder = hf_model, folder
        hf_model.save_pretrained(folder)
        self.prompts = random_prompts(VOCAB, LENGTHS)
        self.reference = [hf_greedy(hf_model, p, NEW_TOKENS) for p in self.prompts]


def saved_case(hf_model: torch.nn.Module, folder: Path) -> Case:
    randomize(hf_model.eval(), 0)
    return Case(hf_model, folder)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Case:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_fields(moe=False)))
    return saved_case(model, tmp_path_factory.mktemp("qwen3.5-dense"))


@pytest.fixture(scope="module")
def moe_vl(tmp_path_factory: pytest.TempPathFactory) -> Case:
    torch.manual_seed(0)
    config = Qwen3_5MoeConfig(text_config=text_fields(moe=True), vision_config=VISION)
    model = Qwen3_5MoeForConditionalGeneration(config)
    return saved_case(model, tmp_path_factory.mktemp("qwen3.5-moe-vl"))


@pytest.mark.parametrize("name", ["dense", "moe_vl"])
def test_a_chunked_batch_matches_hfs_tokens_and_logprobs(
    request: pytest.FixtureRequest, name: str
) -> None:
    """Three prompts admitted together under a 40-token budget (the 90-token one split mid
    convolution window, mid attention block and mid delta-rule block), then decoded together:
    HF's greedy tokens, and each token's logprob HF's log-softmax at it."""
    case: Case = request.getfixturevalue(name)
    llm = LLM(str(case.folder), block_size=16, num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=40, max_num_seqs=4)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        outs = llm.generate(case.prompts, params, detokenize=False)
        bm = llm.engine.scheduler.block_manager
        bm.check_integrity()
        assert bm.num_used_blocks == 0 and bm.num_free_state_slots == 4
    finally:
        llm.engine.shutdown()
    for out, ref in zip(outs, case.reference, strict=True):
        assert out.token_ids == ref.tokens[0]
        got = torch.tensor([entry.logprob for entry in out.logprobs])
        torch.testing.assert_close(got, hf_logprobs(ref), atol=1e-3, rtol=0)


def test_a_placeholder_outside_the_vocabulary_means_no_images(moe_vl: Case) -> None:
    """This file's VL checkpoint keeps HF's default image_token_id beside a 320-token
    vocabulary: no prompt can hold the placeholder (HF could not embed it), so the engine takes
    no images, and its start-up warm-up (run on CUDA; here called on the CPU) plans no image
    step, whose placeholder rows had indexed past the embedding table on the GPU."""
    config = json.loads((moe_vl.folder / "config.json").read_text())
    assert config["image_token_id"] >= VOCAB
    llm = LLM(str(moe_vl.folder), block_size=16, num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=40, max_num_seqs=4)  # fmt: skip
    try:
        runner = llm.engine.runner
        assert runner.multimodal is None
        assert not any(s.request.images for p in runner.warm_up_plans() for s in p.scheduled)
        runner.warm_up()
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        out = llm.generate(moe_vl.prompts[:1], params, detokenize=False)[0]
    finally:
        llm.engine.shutdown()
    assert out.token_ids == moe_vl.reference[0].tokens[0]


def hf_logprobs(ref: GreedyResult) -> torch.Tensor:
    """The logprob of each token HF chose, from its logits."""
    chosen = torch.tensor(ref.tokens[0])[:, None]
    return ref.logits[0].log_softmax(-1).gather(1, chosen)[:, 0]


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    want, got = dict(a.named_parameters()), dict(b.named_parameters())
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name


def test_a_conditional_generation_checkpoint_loads_the_causal_lms_weights(
    dense: Case, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The dense model's language model inside a Qwen3_5ForConditionalGeneration (names under
    ``model.language_model.``, a vision tower beside it): every language-model parameter we
    load is the CausalLM's, and the tower's are HF's. Without a ``vision_config`` the same
    checkpoint loads as text only, the tower's tensors skipped with a log line."""
    config = Qwen3_5Config(text_config=text_fields(moe=False), vision_config=VISION)
    torch.manual_seed(0)
    vl = Qwen3_5ForConditionalGeneration(config).eval()
    vl.model.language_model.load_state_dict(dense.hf_model.model.state_dict())
    vl.lm_head.load_state_dict(dense.hf_model.lm_head.state_dict())
    vl.save_pretrained(tmp_path)
    got = load_float32(tmp_path)
    assert_same_parameters(got.visual, vl.model.visual)
    del got.visual
    assert_same_parameters(load_float32(dense.folder), got)
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with caplog.at_level(logging.INFO, logger="engine_core.models.qwen3_next"):
        text_only = load_float32(tmp_path)
    assert "skipped the vision tower" in caplog.text
    assert_same_parameters(load_float32(dense.folder), text_only)


def test_stacked_experts_load_as_the_per_expert_ones(moe_vl: Case, tmp_path: Path) -> None:
    """HF's in-memory names, which the published MoE checkpoints use: each layer's experts as
    two stacked tensors (``experts.gate_up_proj``, ``experts.down_proj``) rather than one set
    per expert as ``save_pretrained`` writes them."""
    tensors = {k: v.contiguous() for k, v in moe_vl.hf_model.state_dict().items()}
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((moe_vl.folder / "config.json").read_text())
    assert_same_parameters(load_float32(moe_vl.folder), load_float32(tmp_path))


# ----------------------------------------------------------------------------- config and plan


def vl_dict(moe: bool, **top: Any) -> dict[str, Any]:
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text_fields(moe), vision_config=VISION
    )
    return config.to_dict() | {"architectures": [arch]} | top


def test_config_fields() -> None:
    """The text config under ``text_config``, the tie of the top level (HF ties by it), the
    four projections' layout; a model_type alone names the architecture; absent, a quarter of
    each head rotates, as HF's default."""
    config = model_config_from_hf(vl_dict(moe=True, tie_word_embeddings=True))
    assert config.architecture == "qwen3_5_vl" and config.tie_word_embeddings
    assert config.vision is not None and config.vision.mrope_section == (1, 1, 0)
    assert config.vision.mrope_interleaved and config.vision.deepstack_layers == 0
    assert config.attention_layer_ids == (1, 3) and config.rotary_dim == 4
    assert config.linear_attention is not None and config.linear_attention.separate_projections
    assert (config.num_experts, config.shared_expert_intermediate_size) == (4, 48)
    assert config.norm_topk_prob and config.dense_layers == ()
    text = text_fields(moe=False) | {"model_type": "qwen3_5_text", "rope_parameters": None}
    dense = model_config_from_hf(text)
    assert dense.num_experts == 0 and dense.intermediate_size == 96 and dense.rotary_dim == 4


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("norm_topk_prob", False),
        ("mlp_only_layers", [0]),
        ("sliding_window", 128),
        ("n_shared_experts", 2),
    ],
)
def test_fields_we_do_not_implement_are_refused_by_name(field: str, value: object) -> None:
    hf = vl_dict(moe=True)
    hf["text_config"][field] = value
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(hf)


def test_an_untested_quantized_format_is_refused_by_name() -> None:
    """The ConditionalGeneration layout keeps quantization_config at its top level: it is read
    (block FP8 loads, tests/test_vision_quantized.py), and a format no test holds Qwen3.5 to is
    refused as the model is built, naming both."""
    quant = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    config = model_config_from_hf(vl_dict(moe=False, quantization_config=quant))
    assert config.quantization is not None
    with torch.device("meta"), pytest.raises(ValueError, match="W4A16.*not implemented for Qwen3"):
        build_model(config)


def test_the_presets_have_the_published_shapes() -> None:
    """Qwen3.5-9B and Qwen3.5-35B-A3B whole (engine_core/presets.py says where from)."""
    dense, moe = PRESETS["qwen3.5-9b"], PRESETS["qwen3.5-35b-a3b"]
    assert (dense.num_layers, dense.hidden_size, dense.intermediate_size) == (32, 4096, 12288)
    assert (dense.num_heads, dense.num_kv_heads, dense.head_dim, dense.rotary_dim) == (
        16, 4, 256, 64,
    )  # fmt: skip
    assert dense.attention_layer_ids == tuple(range(3, 32, 4)) and dense.num_experts == 0
    assert (moe.num_layers, moe.hidden_size, moe.num_kv_heads) == (40, 2048, 2)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (256, 8, 512)
    assert moe.shared_expert_intermediate_size == 512 and not moe.has_dense_mlp
    for config in (dense, moe):
        la = config.linear_attention
        assert la is not None and (la.num_key_heads, la.num_value_heads) == (16, 32)
        assert la.separate_projections and config.rope_theta == 10_000_000.0
