"""Speculative decoding with an EAGLE-3 head (engine_core/eagle3.py): loading the published
layout and what it refuses, exactness through the engine, and the head's drafts checked against
an independent reading of the head.

The head is random, written in the published layout (config.json and safetensors with the
checkpoint's names and shapes, a draft vocabulary of a few ids mapped to target ids by d2t)
beside a 4-layer random Llama target (EAGLE-3 reads the hidden states entering three of its
layers). Random drafts are rarely the target's tokens, so exactness is shown with drafts
mostly rejected; the d2t mapping sends the draft ids to the tokens the target emits most, so
some are kept. That the head drafts what it should is shown by recomputing every step's drafts
from the final sequences with a plain-torch head over HF's hidden states (no paging, no
engine): the engine's counts of drafted and kept tokens must be exactly what those drafts give.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine_core.eagle3 import Eagle3Proposer
from engine_core.llm import LLM
from engine_core.request import Request
from protocol.messages import Constraint, ConstraintKind, SamplingParams
from tests.factories import (
    EAGLE3_HEADS,
    EAGLE3_KV_HEADS,
    copy_tokenizer,
    write_eagle3_head,
    write_tiny_llama,
)
from tests.mtp_reference import recording_proposals
from tests.test_speculative import abort_two_of_three_with_drafts_in_flight
from tests.test_speculative_draft import (
    assert_mixed_requests_give_plain_tokens,
    assert_prefix_hits_give_plain_tokens,
)

K = 3
VOCAB = 49152
DRAFT_VOCAB = 2
OPTIONS = {"device": "cpu", "max_model_len": 512, "num_kv_blocks": 256, "block_size": 4}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [100, 200, 300], list(range(10, 50))]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
JSON = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))


def eagle3_config(head: Path, k: int = K) -> str:
    return json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    path = write_tiny_llama(tmp_path_factory.mktemp("target"), vocab_size=VOCAB, num_layers=4)
    return copy_tokenizer(default_model_dir, path)


@pytest.fixture(scope="module")
def plain(target_dir: Path) -> LLM:
    return LLM(str(target_dir), **OPTIONS)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory, plain: LLM) -> Path:
    """The head's two draft ids map to the two tokens the target emits most on PROMPTS."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outputs = plain.generate(PROMPTS, params, detokenize=False)
    common = Counter(t for o in outputs for t in o.token_ids).most_common(DRAFT_VOCAB)
    d2t = torch.tensor([token for token, _ in common]) - torch.arange(DRAFT_VOCAB)
    return write_eagle3_head(tmp_path_factory.mktemp("head"), VOCAB, d2t)


@pytest.fixture(scope="module")
def spec(target_dir: Path, head_dir: Path) -> LLM:
    return LLM(str(target_dir), speculative_config=eagle3_config(head_dir), **OPTIONS)


def counts(llm: LLM) -> tuple[int, int, int]:
    c = llm.engine.scheduler.counts()
    return c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens


def since(llm: LLM, before: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(a - b for a, b in zip(counts(llm), before, strict=True))  # type: ignore[return-value]


# ---- loading: what the head's folder must hold ---------------------------------------------------


def test_a_head_in_the_published_layout_loads(spec: LLM) -> None:
    drafter = spec.engine.runner.drafter
    assert isinstance(drafter, Eagle3Proposer)
    assert drafter.aux.layer_ids == (2, 2, 1)  # vLLM's (2, L // 2, L - 3) for L = 4
    assert drafter.head.d2t.shape == (DRAFT_VOCAB,)
    assert drafter.embed is spec.engine.runner.model.model.embed_tokens  # shared


def test_the_forward_writes_hf_hidden_states_entering_the_chosen_layers(
    tmp_path: Path, target_dir: Path, plain: LLM
) -> None:
    """The target's own forward writes the residual stream entering the head's layers (here
    0, the embedding; 3; and 1) into the runner's buffer, column block by column block, equal
    to HF's output_hidden_states there; no hook is left on any layer, and an engine without
    a head has no taps."""
    from transformers import LlamaForCausalLM

    layer_ids = [0, 3, 1]
    head = write_eagle3_head(
        tmp_path / "head",
        VOCAB,
        torch.tensor([3, 3]),
        config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
    )
    llm = LLM(str(target_dir), speculative_config=eagle3_config(head), **OPTIONS)
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt], params, detokenize=False)  # one forward: the prompt's
    got = llm.engine.runner.drafter.aux.take(len(prompt)).float()
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in layer_ids], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    body = llm.engine.runner.model.model
    assert body.aux_hidden_states is llm.engine.runner.drafter.aux
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in body.layers)
    assert plain.engine.runner.model.model.aux_hidden_states is None


def bad_head(tmp_path: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    d2t = torch.tensor([3, 3, 3, 3])
    return write_eagle3_head(tmp_path / "head", VOCAB, d2t, config=config, tensors=tensors)


@pytest.mark.parametrize(
    ("config", "tensors", "match"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, None, "architectures"),
        ({"vocab_size": 1000}, None, "vocab_size 1000 differs"),
        ({"target_hidden_size": 96}, None, "target_hidden_size 96 differs"),
        ({"num_hidden_layers": 2}, None, "num_hidden_layers is 2"),
        ({"draft_vocab_size": 0}, None, "draft_vocab_size 0"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}, None,
         "eagle_aux_hidden_state_layer_ids"),
        (None, {"midlayer.hidden_norm.weight": None}, "midlayer.hidden_norm.weight"),
        (None, {"fc.weight": torch.zeros(64, 128)}, "fc.weight"),
        (None, {"d2t": torch.tensor([0, 0, 0, VOCAB])}, "'d2t' maps draft ids outside"),
        (None, {"d2t": torch.zeros(5, dtype=torch.int64)}, "'d2t' is torch.int64 \\[5\\]"),
        (None, {"d2t": None}, "no 'd2t' tensor"),
    ],
)  # fmt: skip
def test_a_bad_head_is_refused_naming_the_field_or_tensor(
    tmp_path: Path, target_dir: Path, config: dict | None, tensors: dict | None, match: str
) -> None:
    head = bad_head(tmp_path, config, tensors)
    with pytest.raises(ValueError, match=match):
        LLM(str(target_dir), speculative_config=eagle3_config(head), **OPTIONS)


def test_a_target_of_two_layers_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    head = bad_head(tmp_path)
    with pytest.raises(ValueError, match="the target has 2 layers"):
        LLM(str(tiny_model_dir), speculative_config=eagle3_config(head), **OPTIONS)


def test_a_head_without_a_model_is_refused() -> None:
    from engine_core.config import EngineConfig

    with pytest.raises(ValueError, match="method 'eagle3' needs a \"model\""):
        EngineConfig(speculative_config='{"method": "eagle3", "num_speculative_tokens": 2}')


# ---- exactness through the engine ----------------------------------------------------------------


def test_outputs_are_the_plain_engines_token_for_token(plain: LLM, spec: LLM) -> None:
    assert_mixed_requests_give_plain_tokens(plain, spec, PROMPTS[2])


def test_prefix_cache_hits_give_the_same_tokens(plain: LLM, spec: LLM) -> None:
    """Prompts that extend earlier ones by their outputs start from prefix-cache hits: the
    head reads the cached blocks' entries, the output is still the plain engine's."""
    assert_prefix_hits_give_plain_tokens(plain, spec, PROMPTS)


def test_aborting_requests_with_drafts_in_flight_frees_every_block(spec: LLM) -> None:
    requests = [Request(f"abort-{i}", PROMPTS[i], SamplingParams(max_tokens=200)) for i in range(3)]
    abort_two_of_three_with_drafts_in_flight(spec.engine, requests, min_drafts=6)
    assert spec.engine.runner.drafter.features.keys() <= {"abort-1"}  # the others' let go


# ---- the drafts: an independent reading of the head ----------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Llama's rotary embedding of x [n, heads, d] at positions 0..n-1 (halves rotated)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    angles = torch.arange(x.shape[0]).float()[:, None] * inv  # [n, d/2]
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None, :] for f in (torch.cos, torch.sin))
    half = d // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class ReferenceHead:
    """The head of the published layout in plain torch, with dense causal attention over its
    entries: entry q reads the embedding of the token after q and a feature (the target's
    fc-projected hidden states, or the previous entry's residual stream)."""

    def __init__(self, tensors: dict[str, torch.Tensor], embedding: torch.Tensor) -> None:
        self.w = {k: v.float() for k, v in tensors.items()}
        self.embedding = embedding

    def run(self, tokens: list[int], feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual streams [n, H], the drafts as target ids [n])."""
        w, n = self.w, len(tokens)
        layer = "midlayer."
        x = torch.cat(
            [
                rms(self.embedding[tokens], w[f"{layer}input_layernorm.weight"]),
                rms(feature, w[f"{layer}hidden_norm.weight"]),
            ],
            dim=-1,
        )
        q = (x @ w[f"{layer}self_attn.q_proj.weight"].T).view(n, EAGLE3_HEADS, -1)
        k = (x @ w[f"{layer}self_attn.k_proj.weight"].T).view(n, EAGLE3_KV_HEADS, -1)
        v = (x @ w[f"{layer}self_attn.v_proj.weight"].T).view(n, EAGLE3_KV_HEADS, -1)
        group = EAGLE3_HEADS // EAGLE3_KV_HEADS
        q, k = rotate(q), rotate(k).repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        heads = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        stream = heads @ w[f"{layer}self_attn.o_proj.weight"].T + feature
        m = rms(stream, w[f"{layer}post_attention_layernorm.weight"])
        gate, up = m @ w[f"{layer}mlp.gate_proj.weight"].T, m @ w[f"{layer}mlp.up_proj.weight"].T
        mlp = (torch.nn.functional.silu(gate) * up) @ w[f"{layer}mlp.down_proj.weight"].T
        stream = mlp + stream
        draft = (rms(stream, w["norm.weight"]) @ w["lm_head.weight"].T).argmax(-1)
        return stream, draft + w["d2t"].long()[draft]

    def propose(self, sequence: list[int], features: torch.Tensor, p: int, count: int) -> list[int]:
        """The drafts after the known tokens sequence[: p + 1]: entries 0..p-1 from the true
        tokens and the target's features, then one entry per draft."""
        tokens, feature = sequence[1 : p + 1], features[:p]
        drafts: list[int] = []
        for _ in range(count):
            stream, ids = self.run(tokens, feature)
            drafts.append(int(ids[-1]))
            tokens, feature = [*tokens, drafts[-1]], torch.cat([feature, stream[-1:]])
        return drafts


def target_features(target: Path, sequence: list[int], fc: torch.Tensor) -> torch.Tensor:
    """HF's hidden states entering layers 2, L // 2 and L - 3, concatenated, through fc."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        states = model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    aux = torch.cat([states[i][0] for i in (2, layers // 2, layers - 3)], dim=-1)
    return aux @ fc.float().T


def test_the_engines_drafts_are_the_heads_own(target_dir: Path, head_dir: Path, plain: LLM) -> None:
    """Every proposal the engine made is the one the plain-torch head computes over HF's
    hidden states of the final sequence at that position, and the engine's counts of drafted
    and kept tokens are what those drafts give against the sequence. A pool too small for the
    three requests at once: the last admitted are preempted and recompute (the head's entries
    with the target's). No prefix cache here: a hit's last cached entry may hold what another
    request wrote there, which costs drafts, not exactness."""
    from safetensors.torch import load_file

    spec = LLM(
        str(target_dir),
        speculative_config=eagle3_config(head_dir),
        **{**OPTIONS, "enable_prefix_caching": False, "num_kv_blocks": 40, "max_model_len": 160},
    )
    made = recording_proposals(spec)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    got = spec.generate(PROMPTS, params, detokenize=False)
    want = plain.generate(PROMPTS, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.counts().preemptions > 0
    tensors = load_file(str(head_dir / "model.safetensors"))
    embedding = spec.engine.runner.model.model.embed_tokens.weight.detach().float()
    head = ReferenceHead(tensors, embedding)
    steps = drafted = kept = 0
    for prompt, output in zip(PROMPTS, got, strict=True):
        sequence = [*prompt, *output.token_ids]
        features = target_features(target_dir, sequence, tensors["fc.weight"])
        for position, drafts in made[output.request_id]:
            assert drafts == head.propose(sequence, features, position, len(drafts)), position
            following = sequence[position + 1 : position + 1 + len(drafts)]
            pairs = enumerate(zip(drafts, following, strict=True))
            steps, drafted = steps + 1, drafted + len(drafts)
            kept += next((i for i, (d, t) in pairs if d != t), len(drafts))
    assert counts(spec) == (steps, drafted, kept)
    assert kept > 0  # some drafts kept: the comparison reaches past a first draft
