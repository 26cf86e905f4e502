"""Speculative decoding with a DeepSeek-V3 checkpoint's own MTP layer (engine_core/mtp.py):
loading the published layout and what it refuses, exactness through the engine, and the
layer's drafts checked against an independent reading of it.

The target is a tiny random DeepSeek-V3 (MLA with a low-rank q and YaRN, grouped sigmoid
routing, shared experts, a first dense layer) saved as DeepSeek publishes V3: decoder layer
``num_hidden_layers`` of the checkpoint is the MTP layer's block (written by HF
``save_pretrained`` from a model one layer deeper, then config.json told the shallower depth
and ``num_nextn_predict_layers``), and beside it the layer's own ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and its copy of ``embed_tokens``. A random
MTP layer rarely drafts a random target's tokens, so the target emits a few tokens only (its LM
head's other rows are zero) and the layer's head's rows are zero but for the two the target
emits most (one row the other's negative: every draft is one of them); some drafts are kept.
The drafts are checked by recomputing every proposal from the final sequences with HF's decoder
layer for the block, the wrapper written from the published layout in plain torch, over HF's
final hidden states (no paging, no engine).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from engine_core.llm import LLM
from engine_core.mtp import MtpProposer
from engine_core.request import Request
from protocol.messages import SamplingParams
from tests.factories import copy_tokenizer
from tests.mtp_cases import (
    LAYERS,
    VOCAB,
    add_mtp_tensors,
    deeper_model,
    edit_config,
    two_token_head,
    v3_config,
    write_target,
)
from tests.mtp_reference import (
    causal_forward,
    chained_drafts,
    check_proposals,
    recording_proposals,
)
from tests.test_speculative import (
    abort_two_of_three_with_drafts_in_flight,
    chi_square_p_value,
    counters_once_drafts_counted,
    target_marginals,
)
from tests.test_speculative_draft import (
    assert_mixed_requests_give_plain_tokens,
    assert_prefix_hits_give_plain_tokens,
)

K = 3
SAMPLED_VOCAB = 16  # test_speculative.VOCAB: target_marginals reads that many ids
OPTIONS = {"device": "cpu", "max_model_len": 256, "num_kv_blocks": 256, "block_size": 4}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [100, 200, 300], list(range(10, 50))]
# The target's weights: a seed whose greedy run on PROMPTS[2] has a new token 10th (the shared
# exactness routine stops a request there) and emits its two commonest tokens a third of the time.
SEED = 2


def mtp_config(k: int = K, method: str = "mtp") -> str:
    return json.dumps({"method": method, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def deeper() -> DeepseekV3ForCausalLM:
    return deeper_model(SEED)


@pytest.fixture(scope="module")
def target_dir(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path, deeper: torch.nn.Module
) -> Path:
    path = write_target(tmp_path_factory.mktemp("target"), deeper)
    return copy_tokenizer(default_model_dir, path)


@pytest.fixture(scope="module")
def plain(target_dir: Path) -> LLM:
    return LLM(str(target_dir), **OPTIONS)


@pytest.fixture(scope="module")
def common_tokens(plain: LLM) -> list[int]:
    """The two tokens the target emits most after PROMPTS[2], the exactness test's prompt."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    (output,) = plain.generate([PROMPTS[2]], params, detokenize=False)
    return [t for t, _ in Counter(output.token_ids).most_common(2)]


@pytest.fixture(scope="module")
def mtp_dir(
    tmp_path_factory: pytest.TempPathFactory,
    target_dir: Path,
    deeper: DeepseekV3ForCausalLM,
    common_tokens: list[int],
) -> Path:
    """The target's folder with the MTP layer's own tensors added; its head drafts the two
    tokens the target emits most."""
    path = tmp_path_factory.mktemp("with-mtp") / "model"
    shutil.copytree(target_dir, path)
    hidden = deeper.config.hidden_size
    return add_mtp_tensors(path, deeper, two_token_head(VOCAB, hidden, common_tokens))


@pytest.fixture(scope="module")
def spec(mtp_dir: Path) -> LLM:
    return LLM(str(mtp_dir), speculative_config=mtp_config(), **OPTIONS)


def counts(llm: LLM) -> tuple[int, int, int]:
    c = llm.engine.scheduler.counts()
    return c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens


# ---- loading: what the checkpoint must hold ------------------------------------------------------


def test_the_checkpoints_mtp_layer_loads(spec: LLM, mtp_dir: Path) -> None:
    drafter = spec.engine.runner.drafter
    assert isinstance(drafter, MtpProposer)
    target = spec.engine.runner.model
    assert drafter.embed is target.model.embed_tokens  # its copy is equal: shared
    tensors = load_file(str(mtp_dir / "model.safetensors"))
    want = tensors[f"model.layers.{LAYERS}.eh_proj.weight"]
    assert torch.equal(drafter.layer.eh_proj.weight, want)
    block = drafter.layer.block.self_attn.kv_b_proj.weight
    assert torch.equal(block, tensors[f"model.layers.{LAYERS}.self_attn.kv_b_proj.weight"])
    # Its latent cache: one [blocks, block_size, R + P] tensor beside the target's.
    assert [tuple(c.shape) for c in drafter.cache] == [(256, 4, 32 + 8)]


def test_the_alias_deepseek_mtp_loads_the_same(mtp_dir: Path) -> None:
    llm = LLM(str(mtp_dir), speculative_config=mtp_config(2, "deepseek_mtp"), **OPTIONS)
    assert isinstance(llm.engine.runner.drafter, MtpProposer)
    assert llm.engine.runner.drafter.max_drafts == 2


def test_a_checkpoint_without_mtp_weights_is_refused(target_dir: Path) -> None:
    """HF save_pretrained drops the MTP layer's own tensors while config.json still says
    num_nextn_predict_layers 1 (DeepseekV3Config's default)."""
    with pytest.raises(ValueError, match="has no MTP weights"):
        LLM(str(target_dir), speculative_config=mtp_config(), **OPTIONS)


def changed_copy(tmp_path: Path, mtp_dir: Path, tensors: dict[str, torch.Tensor | None]) -> Path:
    """A copy of ``mtp_dir`` with the MTP layer's ``tensors`` replaced (None: dropped)."""
    path = tmp_path / "model"
    shutil.copytree(mtp_dir, path)
    file = path / "model.safetensors"
    weights = load_file(str(file))
    for name, tensor in tensors.items():
        weights.pop(f"model.layers.{LAYERS}.{name}")
        if tensor is not None:
            weights[f"model.layers.{LAYERS}.{name}"] = tensor
    save_file(weights, str(file), {"format": "pt"})
    return path


def test_a_missing_mtp_tensor_is_named(tmp_path: Path, mtp_dir: Path) -> None:
    path = changed_copy(tmp_path, mtp_dir, {"hnorm.weight": None})
    with pytest.raises(ValueError, match=r"MTP layer \(model.layers.2\).*hnorm.weight"):
        LLM(str(path), speculative_config=mtp_config(), **OPTIONS)


def test_an_embedding_copy_that_differs_is_the_layers_own(
    tmp_path: Path, mtp_dir: Path, plain: LLM
) -> None:
    embedding = load_file(str(mtp_dir / "model.safetensors"))["model.embed_tokens.weight"]
    own = embedding + 0.01
    path = changed_copy(tmp_path, mtp_dir, {"embed_tokens.weight": own})
    llm = LLM(str(path), speculative_config=mtp_config(), **OPTIONS)
    drafter = llm.engine.runner.drafter
    assert drafter.embed is not llm.engine.runner.model.model.embed_tokens
    assert torch.equal(drafter.embed.weight, own)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = llm.generate(PROMPTS, params, detokenize=False)
    want = plain.generate(PROMPTS, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_a_config_without_an_mtp_layer_is_refused(tmp_path: Path, mtp_dir: Path) -> None:
    path = tmp_path / "model"
    shutil.copytree(mtp_dir, path)
    edit_config(path, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        LLM(str(path), speculative_config=mtp_config(), **OPTIONS)


def test_a_target_of_another_architecture_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="must be a DeepSeek-V3-architecture model"):
        LLM(str(tiny_model_dir), speculative_config=mtp_config(), **OPTIONS)


def test_a_model_path_is_refused() -> None:
    from engine_core.config import EngineConfig

    text = json.dumps({"method": "mtp", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="method 'mtp' takes no \"model\""):
        EngineConfig(speculative_config=text)


# ---- exactness through the engine ----------------------------------------------------------------


def test_outputs_are_the_plain_engines_token_for_token(plain: LLM, spec: LLM) -> None:
    assert_mixed_requests_give_plain_tokens(plain, spec, PROMPTS[2])


def test_prefix_cache_hits_give_the_same_tokens(plain: LLM, spec: LLM) -> None:
    assert_prefix_hits_give_plain_tokens(plain, spec, PROMPTS)


def test_aborting_requests_with_drafts_in_flight_frees_every_block(spec: LLM) -> None:
    requests = [Request(f"abort-{i}", PROMPTS[i], SamplingParams(max_tokens=200)) for i in range(3)]
    abort_two_of_three_with_drafts_in_flight(spec.engine, requests, min_drafts=6)
    assert spec.engine.runner.drafter.features.keys() <= {"abort-1"}  # the others' let go


# ---- the drafts: an independent reading of the layer ---------------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceMtp:
    """The MTP layer of the published layout: plain torch around HF's decoder layer (dense
    causal attention over its entries). Entry q reads the embedding of the token after q and a
    hidden state (the target's final one at q, or the previous entry's normed output)."""

    def __init__(self, own: dict[str, torch.Tensor], deeper: DeepseekV3ForCausalLM) -> None:
        self.w = {k: v.float() for k, v in own.items()}
        self.block = deeper.model.layers[LAYERS]
        self.rotary = deeper.model.rotary_emb

    def run(self, tokens: list[int], feature: torch.Tensor) -> torch.Tensor:
        """The normed outputs [n, H]."""
        w = self.w
        embeds = rms(w["embed_tokens.weight"][tokens], w["enorm.weight"])
        x = torch.cat([embeds, rms(feature, w["hnorm.weight"])], dim=-1) @ w["eh_proj.weight"].T
        return rms(causal_forward(self.block, self.rotary, x), w["shared_head.norm.weight"])

    def propose(self, sequence: list[int], hidden: torch.Tensor, p: int, count: int) -> list[int]:
        head = self.w["shared_head.head.weight"]
        return chained_drafts(self.run, head, sequence, hidden, p, count)


def target_hidden(deeper: DeepseekV3ForCausalLM, sequence: list[int]) -> torch.Tensor:
    """HF's final hidden states (after the final norm) of the target: the deeper model's first
    LAYERS layers."""
    target = DeepseekV3ForCausalLM(v3_config(LAYERS)).eval()
    state = {
        k: v for k, v in deeper.state_dict().items() if not k.startswith(f"model.layers.{LAYERS}.")
    }
    target.load_state_dict(state)
    with torch.no_grad():
        return target.model(torch.tensor([sequence])).last_hidden_state[0]


def test_the_engines_drafts_are_the_layers_own(
    mtp_dir: Path, plain: LLM, deeper: DeepseekV3ForCausalLM
) -> None:
    """Every proposal the engine made is the one the reference computes over HF's hidden
    states of the final sequence at that position, and the engine's counts of drafted and
    kept tokens are what those drafts give. A pool too small for the three requests at once:
    the last admitted are preempted and recompute (the layer's entries with the target's)."""
    spec = LLM(
        str(mtp_dir),
        speculative_config=mtp_config(),
        **{**OPTIONS, "enable_prefix_caching": False, "num_kv_blocks": 40, "max_model_len": 160},
    )
    made = recording_proposals(spec)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    got = spec.generate(PROMPTS, params, detokenize=False)
    want = plain.generate(PROMPTS, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.scheduler.counts().preemptions > 0
    prefix = f"model.layers.{LAYERS}."
    tensors = load_file(str(mtp_dir / "model.safetensors"))
    own = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
    reference = ReferenceMtp(own, deeper)
    hidden_of = partial(target_hidden, deeper)
    steps, drafted, kept = check_proposals(made, PROMPTS, got, hidden_of, reference.propose)
    assert counts(spec) == (steps, drafted, kept)
    assert kept > 0  # some drafts kept: the comparison reaches past a first draft


# ---- through a server, and sampled requests ------------------------------------------------------


@pytest.mark.slow
def test_a_speculating_server_streams_the_same_text_and_counts_its_drafts(
    tmp_path_factory: pytest.TempPathFactory, mtp_dir: Path, plain: LLM
) -> None:
    """Whole, streamed and cut by a stop string inside a drafted run, with the official
    client: the plain engine's text; /metrics counts drafts and kept ones."""
    import openai

    from tests.server_fixture import start_server, stop_server, wait_engine_idle

    args = ["--max-model-len", "256", "--num-kv-blocks", "256", "--block-size", "4"]
    srv = start_server(
        tmp_path_factory.mktemp("serve-mtp"), model=str(mtp_dir),
        args=[*args, "--served-model-name", "default", "--speculative-config", mtp_config()],
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        want = plain.generate([PROMPTS[2]], params)[0].text
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)
        body = {"model": "default", "prompt": PROMPTS[2], "max_tokens": 48, "temperature": 0}
        extra = {"ignore_eos": True}
        assert client.completions.create(**body, extra_body=extra).choices[0].text == want
        chunks = client.completions.create(**body, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in chunks) == want
        stop = want[len(want) // 2 : len(want) // 2 + 3]
        cut = client.completions.create(**body, stop=[stop], extra_body=extra)
        assert cut.choices[0].text == want[: want.index(stop)]
        wait_engine_idle(srv)  # every KV block free, the integrity check passing

        values = counters_once_drafts_counted(srv.base_url)
        drafted = values["tandem_spec_decode_num_draft_tokens_total"]
        assert 0 < values["tandem_spec_decode_num_accepted_tokens_total"] < drafted
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_sampled_tokens_follow_the_targets_distribution(tmp_path: Path) -> None:
    """A 16-token V3 with a random MTP layer drafting at every step: the second and third
    output tokens of 3,000 unseeded requests match HF's distribution (chi-square), and drafts
    were checked and some kept on the way."""
    vocab = SAMPLED_VOCAB
    deeper = deeper_model(seed=0, vocab=vocab, emitted=None)
    head = torch.randn(vocab, deeper.config.hidden_size, generator=torch.Generator().manual_seed(4))
    target = add_mtp_tensors(write_target(tmp_path / "target", deeper), deeper, head)
    prompt = [*range(vocab), *range(vocab - 1, -1, -1), 5]
    llm = LLM(
        str(target), device="cpu", max_model_len=64, num_kv_blocks=4096, block_size=4,
        max_num_seqs=256, speculative_config=mtp_config(),
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
        outputs = llm.generate([prompt] * 3000, params, detokenize=False)
        counts = llm.engine.scheduler.counts()
    finally:
        llm.engine.shutdown()
    second, third = target_marginals(target, prompt)
    for position, probs in ((1, second), (2, third)):
        drawn = torch.tensor([o.token_ids[position] for o in outputs])
        observed = torch.bincount(drawn, minlength=vocab).double()
        assert chi_square_p_value(observed, probs) > 1e-3, position
    assert counts.spec_draft_tokens > 3000 and counts.spec_accepted_tokens > 300


def test_a_block_fp8_checkpoints_mtp_layer_loads_in_fp8_and_keeps_the_tokens(
    tmp_path: Path, deeper: DeepseekV3ForCausalLM, common_tokens: list[int]
) -> None:
    """DeepSeek-V3 publishes block FP8: the MTP layer's decoder layer is in e4m3 as the
    target's are (its own eh_proj and head plain, as published); the speculating engine gives
    the plain FP8 engine's tokens and drafts on the way."""
    from tests.test_fp8 import E4M3, FORMATS, LINEARS, write_quantized
    from tests.test_fp8_moe import MLA_LINEARS

    folder = tmp_path / "fp8"
    write_quantized(deeper, FORMATS["fp8-block"], folder, tmp_path / "ref", LINEARS + MLA_LINEARS)
    edit_config(folder, num_hidden_layers=LAYERS)
    hidden = deeper.config.hidden_size
    add_mtp_tensors(folder, deeper, two_token_head(VOCAB, hidden, common_tokens))
    plain_fp8 = LLM(str(folder), **OPTIONS)
    spec_fp8 = LLM(str(folder), speculative_config=mtp_config(), **OPTIONS)
    layer = spec_fp8.engine.runner.drafter.layer
    assert layer.block.self_attn.q_a_proj.weight.dtype == E4M3
    assert layer.block.mlp.w13.dtype == E4M3
    assert layer.eh_proj.weight.dtype == torch.float32
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = plain_fp8.generate(PROMPTS, params, detokenize=False)
    got = spec_fp8.generate(PROMPTS, params, detokenize=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert counts(spec_fp8)[1] > 0
