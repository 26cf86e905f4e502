"""Speculative decoding with a Qwen3-Next or Qwen3.5 checkpoint's own MTP layer
(engine_core/mtp.py over the ``mtp.*`` tensors), on the CPU: loading the published layout and
what it refuses, exactness against HF transformers through the hybrid engine (a DeltaNet state
kept after each verify position), and the layer's drafts checked against an independent
reading of it.

Each family's target is a tiny random model (tests/test_models_qwen3_next.py's Qwen3-Next with
its MoE and shared expert, tests/test_models_qwen3_5.py's dense Qwen3.5 text model), saved with
HF ``save_pretrained`` (which drops the MTP layer); the test then writes the layer's tensors
into the safetensors file under the published names: ``mtp.fc`` [H, 2H], the three (1 + w)
RMSNorms, and ``mtp.layers.0.*``, the tensors of a fully attending layer of a second random
model of the family as its ``save_pretrained`` names them; config.json gets the family's count
(``num_nextn_predict_layers``, ``mtp_num_hidden_layers``). A random layer rarely drafts a
random target's tokens, so for the exactness test the target's LM head (which the layer
shares) is zero but for two tokens, one row the other's negative: the target emits and the
layer drafts only those two, about half the drafts kept. The drafts are checked on a target
with its full random head by recomputing every proposal from the final sequences with HF's own
decoder layer and RMSNorm, over HF's final hidden states (no paging, no engine).
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from engine_core.llm import LLM
from engine_core.mtp import MtpProposer
from tests.mtp_cases import add_tensors, edit_config, two_token_head
from tests.mtp_reference import (
    causal_forward,
    chained_drafts,
    check_proposals,
    recording_proposals,
)
from tests.paged_harness import random_prompts, randomize
from tests.test_models_qwen3_5 import VISION, text_fields
from tests.test_models_qwen3_next import VOCAB, tiny_config
from tests.test_speculative_hybrid import (
    check_every_count_kept,
    greedy,
    hf_tokens,
    make_llm,
)

K = 3
HIDDEN = 64  # tiny_config's
FULL_LAYER = "model.layers.1."  # tiny_config's first fully attending layer
OWN_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
EMITTED = [7, 300]  # the two-token head's


def mtp_config(k: int = K, method: str = "mtp") -> str:
    return json.dumps({"method": method, "num_speculative_tokens": k})


class Family:
    """A target family whose checkpoints ship the layer: its HF model of the tiny shape, the
    config field that counts MTP layers, and its RMSNorm class (the reference's)."""

    def __init__(self, name: str, depth_field: str, norm: type[nn.Module]) -> None:
        self.name, self.depth_field, self.norm = name, depth_field, norm

    def random_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        if self.name == "qwen3-next":
            model = AutoModelForCausalLM.from_config(tiny_config())
        else:  # Qwen3.5's dense text model: the layer's MLP a SwiGLU
            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_fields(moe=False)))
        randomize(model.eval(), seed)
        return model


FAMILIES = {
    "qwen3-next": Family("qwen3-next", "num_nextn_predict_layers", Qwen3NextRMSNorm),
    "qwen3.5": Family("qwen3.5", "mtp_num_hidden_layers", Qwen3_5RMSNorm),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def source(family: Family) -> nn.Module:
    """The random model whose layer 1 (fully attending) is the MTP layer's decoder layer."""
    return family.random_model(1)


@pytest.fixture(scope="module")
def mtp_tensors(tmp_path_factory: pytest.TempPathFactory, source: nn.Module) -> dict:
    """The MTP layer under its published names: its own tensors random, its decoder layer
    ``source``'s layer 1 as save_pretrained writes it (per-expert names)."""
    folder = tmp_path_factory.mktemp("source")
    source.save_pretrained(folder)
    saved = load_file(str(folder / "model.safetensors"))
    block = {
        f"mtp.layers.0.{name.removeprefix(FULL_LAYER)}": tensor
        for name, tensor in saved.items()
        if name.startswith(FULL_LAYER)
    }
    gen = torch.Generator().manual_seed(2)
    own = {f"mtp.{name}.weight": torch.randn(HIDDEN, generator=gen) * 0.1 for name in OWN_NORMS}
    own["mtp.fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.1
    return own | block


def write_with_mtp(folder: Path, model: nn.Module, tensors: dict, family: Family) -> Path:
    """``model`` saved by HF, then the MTP layer's tensors and config field added."""
    model.save_pretrained(folder)
    add_tensors(folder, tensors)
    edit_config(folder, **{family.depth_field: 1})
    return folder


@pytest.fixture(scope="module")
def two_token(
    tmp_path_factory: pytest.TempPathFactory, mtp_tensors: dict, family: Family
) -> tuple[Path, nn.Module]:
    """A target whose LM head emits only EMITTED, with the MTP layer: about half the layer's
    drafts are the target's next tokens."""
    model = family.random_model(0)
    with torch.no_grad():
        model.lm_head.weight.copy_(two_token_head(VOCAB, HIDDEN, EMITTED))
    folder = tmp_path_factory.mktemp("two-token")
    return write_with_mtp(folder, model, mtp_tensors, family), model


@pytest.fixture(scope="module")
def full_vocab(
    tmp_path_factory: pytest.TempPathFactory, mtp_tensors: dict, family: Family
) -> tuple[Path, nn.Module]:
    model = family.random_model(0)
    folder = tmp_path_factory.mktemp("full-vocab")
    return write_with_mtp(folder, model, mtp_tensors, family), model


def counts(llm: LLM) -> tuple[int, int, int]:
    c = llm.engine.scheduler.counts()
    return c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens


# ---- loading: what the checkpoint must hold ------------------------------------------------------


def test_the_checkpoints_mtp_layer_loads_beside_the_targets_head(
    two_token: tuple[Path, nn.Module], mtp_tensors: dict
) -> None:
    folder, _ = two_token
    llm = make_llm(folder, speculative_config=mtp_config())
    try:
        drafter = llm.engine.runner.drafter
        assert isinstance(drafter, MtpProposer)
        target = llm.engine.runner.model
        assert drafter.embed is target.model.embed_tokens
        assert drafter.chain.head is target.lm_head.weight  # no head of its own
        assert torch.equal(drafter.layer.fc.weight, mtp_tensors["mtp.fc.weight"])
        norm = drafter.layer.pre_fc_norm_hidden.weight
        assert torch.equal(norm, mtp_tensors["mtp.pre_fc_norm_hidden.weight"])
        k_norm = drafter.layer.block.self_attn.k_norm.weight
        assert torch.equal(k_norm, mtp_tensors["mtp.layers.0.self_attn.k_norm.weight"])
        # A plain K/V cache (2 KV heads of 16), indexed by the target's block ids.
        blocks = llm.engine.runner.num_kv_blocks
        assert sum(c.numel() for c in drafter.cache) == 2 * blocks * 16 * 2 * 16
    finally:
        llm.engine.shutdown()


def test_the_alias_qwen3_next_mtp_loads_the_same(two_token: tuple[Path, nn.Module]) -> None:
    folder, _ = two_token
    llm = make_llm(folder, speculative_config=mtp_config(2, "qwen3_next_mtp"))
    try:
        assert isinstance(llm.engine.runner.drafter, MtpProposer)
        assert llm.engine.runner.drafter.max_drafts == 2
    finally:
        llm.engine.shutdown()


def changed_copy(tmp_path: Path, folder: Path, drop: str) -> Path:
    """A copy of ``folder`` without the tensors whose names start with ``drop``."""
    path = tmp_path / "model"
    shutil.copytree(folder, path)
    file = path / "model.safetensors"
    weights = {k: v for k, v in load_file(str(file)).items() if not k.startswith(drop)}
    save_file(weights, str(file), {"format": "pt"})
    return path


def stacked_experts(tensors: dict) -> dict:
    """``tensors`` with the per-expert MLP tensors of ``mtp.layers.0`` stacked as the published
    Qwen3.5 MoE checkpoints (and HF's memory) hold them: ``experts.gate_up_proj`` [E, 2I, H]
    (each expert's gate rows, then its up rows) and ``experts.down_proj`` [E, H, I]."""
    prefix = "mtp.layers.0.mlp.experts."
    experts = sorted({int(k.removeprefix(prefix).split(".")[0]) for k in tensors if prefix in k})

    def stack(proj: str) -> torch.Tensor:
        return torch.stack([tensors[f"{prefix}{e}.{proj}.weight"] for e in experts])

    kept = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
    kept[f"{prefix}gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
    kept[f"{prefix}down_proj"] = stack("down_proj")
    return kept


def test_stacked_experts_load_as_per_expert_ones(
    tmp_path: Path, two_token: tuple[Path, nn.Module], mtp_tensors: dict
) -> None:
    if not any(".experts." in name for name in mtp_tensors):
        pytest.skip("the family's MTP layer has a dense MLP here")
    folder, _ = two_token
    path = changed_copy(tmp_path, folder, "mtp.")
    add_tensors(path, stacked_experts(mtp_tensors))
    layers = []
    for model in (folder, path):
        llm = make_llm(model, speculative_config=mtp_config())
        layers.append(llm.engine.runner.drafter.layer.state_dict())
        llm.engine.shutdown()
    per_expert, stacked = layers
    assert per_expert.keys() == stacked.keys()
    for name, tensor in per_expert.items():
        assert torch.equal(tensor, stacked[name]), name


def test_a_checkpoint_without_mtp_weights_is_refused(
    tmp_path: Path, two_token: tuple[Path, nn.Module]
) -> None:
    """HF save_pretrained drops the ``mtp.*`` tensors."""
    path = changed_copy(tmp_path, two_token[0], "mtp.")
    with pytest.raises(ValueError, match=r"has no MTP weights \(no 'mtp.fc.weight'"):
        make_llm(path, speculative_config=mtp_config())


@pytest.mark.parametrize(
    ("dropped", "named"),
    [
        ("mtp.pre_fc_norm_hidden.", "pre_fc_norm_hidden.weight"),
        ("mtp.layers.0.self_attn.k_norm.", "block.self_attn.k_norm.weight"),
    ],
)
def test_a_missing_mtp_tensor_is_named(
    tmp_path: Path, two_token: tuple[Path, nn.Module], dropped: str, named: str
) -> None:
    path = changed_copy(tmp_path, two_token[0], dropped)
    with pytest.raises(ValueError, match=rf"MTP layer \(mtp\): checkpoint lacks .*{named}"):
        make_llm(path, speculative_config=mtp_config())


def test_a_config_without_an_mtp_layer_is_refused(
    tmp_path: Path, two_token: tuple[Path, nn.Module], family: Family
) -> None:
    path = tmp_path / "model"
    shutil.copytree(two_token[0], path)
    edit_config(path, **{family.depth_field: 0})
    with pytest.raises(ValueError, match=f"config.json {family.depth_field} is 0"):
        make_llm(path, speculative_config=mtp_config())


def test_a_vision_language_qwen3_5_target_is_refused_by_name(tmp_path: Path) -> None:
    """Its image rows take M-RoPE positions, which the layer's entries do not carry (refused
    before any MTP tensor is read)."""
    torch.manual_seed(0)
    config = Qwen3_5Config(text_config=text_fields(moe=False), vision_config=VISION)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="a Qwen3.5 vision-language target's MTP layer"):
        make_llm(tmp_path, speculative_config=mtp_config())


# ---- exactness through the engine ----------------------------------------------------------------


def test_outputs_with_mtp_drafts_are_hfs_tokens(two_token: tuple[Path, nn.Module]) -> None:
    """Four prompts batched, one chunked: the layer's drafts kept in every count from none to
    all (the state after a kept draft copied into the slot) give HF's greedy tokens."""
    folder, hf_model = two_token
    prompts = random_prompts(VOCAB, (20, 45, 150, 31))
    want = hf_tokens(hf_model, prompts, 40)
    llm = make_llm(folder, speculative_config=mtp_config(), max_num_batched_tokens=64)
    check_every_count_kept(llm, prompts, want)


# ---- the drafts: an independent reading of the layer ---------------------------------------------


class ReferenceMtp:
    """The MTP layer of the published layout, as vLLM's qwen3_next_mtp.py computes it, over
    HF's decoder layer and RMSNorm (dense causal attention over its entries). Entry q reads the
    embedding of the token after q and a hidden state (the target's final one at q, or the
    previous entry's normed output)."""

    def __init__(self, tensors: dict, source: nn.Module, target: nn.Module, norm: type) -> None:
        self.block = source.model.layers[1]
        self.rotary = source.model.rotary_emb
        self.fc = tensors["mtp.fc.weight"]
        eps = source.config.rms_norm_eps
        self.norms = {name: norm(HIDDEN, eps=eps) for name in OWN_NORMS}
        with torch.no_grad():
            for name, module in self.norms.items():
                module.weight.copy_(tensors[f"mtp.{name}.weight"])
        self.embedding = target.model.embed_tokens.weight.detach()
        self.head = target.lm_head.weight.detach()

    @torch.no_grad()
    def run(self, tokens: list[int], feature: torch.Tensor) -> torch.Tensor:
        """The normed outputs [n, H]: fc([pre_fc_norm_embedding(e) | pre_fc_norm_hidden(h)]),
        the decoder layer, norm."""
        embeds = self.norms["pre_fc_norm_embedding"](self.embedding[tokens])
        x = torch.cat([embeds, self.norms["pre_fc_norm_hidden"](feature)], dim=-1) @ self.fc.T
        return self.norms["norm"](causal_forward(self.block, self.rotary, x))

    def propose(self, sequence: list[int], hidden: torch.Tensor, p: int, count: int) -> list[int]:
        return chained_drafts(self.run, self.head, sequence, hidden, p, count)


def target_hidden(hf_model: nn.Module, sequence: list[int]) -> torch.Tensor:
    """HF's final hidden states of the target (after its final norm) [n, H]."""
    with torch.no_grad():
        return hf_model.model(torch.tensor([sequence])).last_hidden_state[0]


def test_the_engines_drafts_are_the_layers_own(
    full_vocab: tuple[Path, nn.Module], mtp_tensors: dict, source: nn.Module, family: Family
) -> None:
    """Every proposal the engine made for three batched requests (one prompt chunked) is the
    one the reference computes over HF's hidden states of the final sequence at that
    position, the first after each prompt included; the engine's counts of drafted
    and kept tokens are what those drafts give, and the tokens are HF's."""
    folder, hf_model = full_vocab
    prompts = random_prompts(VOCAB, (12, 70, 33))
    want = hf_tokens(hf_model, prompts, 12)
    llm = make_llm(folder, speculative_config=mtp_config(), max_num_batched_tokens=48)
    made = recording_proposals(llm)
    try:
        got = llm.generate(prompts, greedy(12), detokenize=False)
        assert [o.token_ids for o in got] == want
        spec_counts = counts(llm)
    finally:
        llm.engine.shutdown()
    reference = ReferenceMtp(mtp_tensors, source, hf_model, family.norm)
    hidden_of = partial(target_hidden, hf_model)
    assert spec_counts == check_proposals(made, prompts, got, hidden_of, reference.propose)
    # Each request's first proposal is from its prompt's last token (the last chunk verified
    # with drafts) or the token sampled after it.
    for prompt, output in zip(prompts, got, strict=True):
        assert made[output.request_id][0][0] <= len(prompt)
