"""Embeddings in the engine core: the scheduler's pooling requests, the pooler's arithmetic, what
a checkpoint says about its pooling, and the offline ``LLM.embed`` against HF transformers.

The HTTP side (``/v1/embeddings`` through ``tandem serve``) is tests/test_embeddings_http.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine_core.config import EngineConfig
from engine_core.embedding import check_pooling, embedding_model
from engine_core.llm import LLM
from engine_core.loader import load_model_config
from engine_core.pooler import Pooler, finish_vector
from engine_core.request import Request, RequestStatus, ScheduledRequest, SchedulerOutput
from engine_core.scheduler import Scheduler
from protocol.messages import (
    EmbeddingModel,
    FinishReason,
    PoolingKind,
    PoolingParams,
    SamplingParams,
)
from tests.factories import write_tiny_embedding_model, write_tiny_llama

BLOCK_SIZE = 4
LAST = PoolingParams(PoolingKind.LAST)
MEAN = PoolingParams(PoolingKind.MEAN)


def pooling_request(rid: str, prompt: list[int], pooling: PoolingParams = LAST) -> Request:
    return Request(rid, list(prompt), SamplingParams(), pooling=pooling)


def make_scheduler(num_kv_blocks: int = 64, **config: object) -> Scheduler:
    engine_config = EngineConfig(block_size=BLOCK_SIZE, **config).with_max_num_seqs(large_gpu=False)
    return Scheduler(engine_config, num_kv_blocks, 64, (0,))


def run_steps(scheduler: Scheduler) -> list[tuple[SchedulerOutput, list]]:
    """Step until idle, keeping each plan and its events; a row that samples (a generation's)
    gets token 7."""
    steps = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        sampled = [7] * sum(s.samples for s in plan.scheduled)
        steps.append((plan, scheduler.update_from_output(plan, sampled)))
        assert len(steps) < 200
    return steps


# ---- the scheduler ------------------------------------------------------------------------------


def test_a_pooling_request_never_samples_and_frees_its_blocks_at_its_end() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    requests = [pooling_request("a", range(1, 20)), pooling_request("b", range(30, 35), MEAN)]
    for r in requests:
        scheduler.add_request(r)
    steps = run_steps(scheduler)
    rows = [s for plan, _ in steps for s in plan.scheduled]
    assert not any(s.samples for s in rows)
    assert all(-1 not in r.token_ids for r in requests)  # never a placeholder for a token
    assert all(plan.num_batched_tokens <= 8 for plan, _ in steps)  # chunked within the budget
    events = [e for _, evs in steps for e in evs]
    assert [(e.request.request_id, e.new_token_ids, e.finish_reason) for e in events] == [
        ("a", [], FinishReason.POOLED),
        ("b", [], FinishReason.POOLED),
    ]
    # Each ended in the step that ran its last prompt token, and nothing of it ran after that.
    for r in requests:
        ended = next(i for i, (_, evs) in enumerate(steps) if any(e.request is r for e in evs))
        last = [s for s in steps[ended][0].scheduled if s.request is r][0]
        assert last.start + last.num_new_tokens == r.num_prompt_tokens
        assert r.status == RequestStatus.FINISHED and r.num_output_tokens == 0
    bm = scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks + bm.num_cached_blocks == 64


def test_mean_pooling_takes_no_prefix_hit_and_last_token_pooling_does() -> None:
    scheduler = make_scheduler()
    prompt = list(range(1, 14))  # three full blocks and one token
    scheduler.add_request(pooling_request("first", prompt))
    run_steps(scheduler)
    last, mean = pooling_request("last", prompt), pooling_request("mean", prompt, MEAN)
    scheduler.add_request(last)
    scheduler.add_request(mean)
    plan = scheduler.schedule()
    starts = {s.request.request_id: s.start for s in plan.scheduled}
    assert starts == {"last": 12, "mean": 0}  # the last token is always computed
    scheduler.update_from_output(plan, [])
    assert last.num_cached_tokens == 12 and mean.num_cached_tokens == 0


def test_a_preempted_pooling_request_computes_its_prompt_again() -> None:
    """A decoding request (an engine never mixes the two; the scheduler does not care) grows
    into the pool while a mean-pooled prompt is mid-way: the prompt, admitted later, is
    preempted and later runs again from its first token."""
    scheduler = make_scheduler(num_kv_blocks=7, max_num_batched_tokens=8, max_num_seqs=2)
    decoding = Request("g", [1, 2, 3, 4], SamplingParams(max_tokens=40, ignore_eos=True))
    pooled = pooling_request("p", range(20, 44), MEAN)
    scheduler.add_request(decoding)
    scheduler.add_request(pooled)
    steps = run_steps(scheduler)
    assert pooled.num_preemptions > 0 and pooled.finish_reason == FinishReason.POOLED
    chunks = [s for plan, _ in steps for s in plan.scheduled if s.request is pooled]
    restart = max(i for i, s in enumerate(chunks) if s.start == 0)  # after the last preemption
    assert sum(s.num_new_tokens for s in chunks[restart:]) == 24  # the whole prompt again
    scheduler.block_manager.check_integrity()


def test_a_pooling_prompt_may_fill_the_context() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(pooling_request("fits", range(1, 65)))  # max_model_len = 64
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        scheduler.add_request(pooling_request("long", range(1, 66)))
    with pytest.raises(ValueError, match="no room to generate"):
        scheduler.add_request(Request("gen", list(range(1, 65)), SamplingParams()))


def test_aborting_a_pooling_request_frees_its_blocks() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    scheduler.add_request(pooling_request("a", range(1, 30), MEAN))
    scheduler.update_from_output(scheduler.schedule(), [])
    scheduler.abort_requests(["a"])
    bm = scheduler.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks + bm.num_cached_blocks == 64


# ---- the pooler ---------------------------------------------------------------------------------


def test_mean_pooling_sums_across_chunks_and_restarts_at_position_0() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(10, 8)
    request = pooling_request("m", range(10), MEAN)
    pooler = Pooler()

    def chunk(start: int, n: int) -> list:
        plan = SchedulerOutput([ScheduledRequest(request, n, [0, 1, 2], start, False)])
        got = pooler.pool(plan, hidden[start : start + n], [0])
        return [] if got is None else got.vectors.tolist()

    assert chunk(0, 4) == [] and chunk(4, 3) == []
    chunk(0, 5)  # a preemption: the first chunk again drops the partial sum
    (vector,) = chunk(5, 5)
    assert torch.allclose(torch.tensor(vector), hidden.mean(0), atol=1e-6)
    assert not pooler._sums


def test_the_vector_is_cut_then_normalised() -> None:
    values = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    assert finish_vector(values, PoolingParams(normalize=False)) == [3.0, 4.0, 12.0]
    assert finish_vector(values, PoolingParams(dimensions=2)) == pytest.approx([0.6, 0.8])
    assert finish_vector(values, PoolingParams()) == pytest.approx([3 / 13, 4 / 13, 12 / 13])
    assert finish_vector(np.zeros(3, np.float32), PoolingParams()) == [0.0, 0.0, 0.0]
    assert finish_vector(np.array([np.inf, 1], np.float32), PoolingParams()) is None


# ---- what the checkpoint says -------------------------------------------------------------------


def embedding_of(path: Path, runner: str = "auto") -> EmbeddingModel | None:
    return embedding_model(runner, path, load_model_config(path))


def test_sentence_transformers_files_name_the_pooling(tmp_path: Path) -> None:
    last = write_tiny_embedding_model(tmp_path / "last", matryoshka=True)
    mean = write_tiny_embedding_model(
        tmp_path / "mean", architecture="llama", pooling="mean_tokens", normalize=False
    )
    assert embedding_of(last) == EmbeddingModel(PoolingKind.LAST, True, 64, True, ())
    assert embedding_of(mean) == EmbeddingModel(PoolingKind.MEAN, False, 64, False, ())
    with pytest.raises(ValueError, match="without an LM head"):
        embedding_of(last, "generate")


def test_a_causal_lm_generates_unless_told_to_embed(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path)
    assert embedding_of(path) is None
    assert embedding_of(path, "generate") is None
    assert embedding_of(path, "pooling") == EmbeddingModel(PoolingKind.LAST, True, 64)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: add_module(p, "sentence_transformers.models.Dense"), "Dense"),
        (lambda p: pooling_modes(p, cls_token=True, lasttoken=False), "cls_token"),
        (lambda p: pooling_modes(p, mean_tokens=True), "lasttoken"),  # two modes
        (lambda p: pooling_modes(p, lasttoken=False), "none"),
        (lambda p: pooling_modes(p, lasttoken=False, mean_tokens=True, include_prompt=False),
         "without the prompt"),
        (lambda p: write(p / "sentence_bert_config.json", {"do_lower_case": True}), "lower"),
        (lambda p: config_field(p, matryoshka_dimensions=[16, 128]), r"\[1, 64\]"),
        (lambda p: write(p / "config_sentence_transformers.json",
                         {"prompts": {"query": "q: "}, "default_prompt_name": "passage"}),
         "default_prompt_name 'passage'"),
    ],
)  # fmt: skip
def test_what_the_engine_would_not_compute_is_refused(tmp_path: Path, edit, message: str) -> None:
    path = write_tiny_embedding_model(tmp_path / "m")
    edit(path)
    with pytest.raises(ValueError, match=message):
        embedding_of(path)


def write(path: Path, value: object) -> None:
    path.write_text(json.dumps(value))


def add_module(path: Path, kind: str) -> None:
    modules = json.loads((path / "modules.json").read_text())
    write(path / "modules.json", [*modules, {"idx": 9, "name": "9", "path": "x", "type": kind}])


def pooling_modes(path: Path, **modes: bool) -> None:
    config = json.loads((path / "1_Pooling" / "config.json").read_text())
    config.update(
        {k if k == "include_prompt" else f"pooling_mode_{k}": v for k, v in modes.items()}
    )
    write(path / "1_Pooling" / "config.json", config)


def config_field(path: Path, **fields: object) -> None:
    config = json.loads((path / "config.json").read_text())
    write(path / "config.json", {**config, **fields})


def test_dimensions_are_checked_against_the_model() -> None:
    plain = EmbeddingModel(PoolingKind.LAST, True, 64)
    check_pooling(PoolingParams(dimensions=64), plain)  # its own length: nothing to cut
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        check_pooling(PoolingParams(dimensions=32), plain)
    anything = EmbeddingModel(PoolingKind.LAST, True, 64, True)
    check_pooling(PoolingParams(dimensions=1), anything)
    with pytest.raises(ValueError, match="1 to 64"):
        check_pooling(PoolingParams(dimensions=65), anything)
    listed = EmbeddingModel(PoolingKind.LAST, True, 64, True, (16, 32))
    check_pooling(PoolingParams(dimensions=16), listed)
    with pytest.raises(ValueError, match="16, 32"):
        check_pooling(PoolingParams(dimensions=8), listed)


# ---- the offline API against HF transformers ----------------------------------------------------

PROMPTS = [list(range(5, 5 + n)) for n in (1, 3, 17, 40)]


def hf_pooled(model: torch.nn.Module, prompt: list[int], kind: PoolingKind) -> torch.Tensor:
    """HF's final hidden states of one unpadded prompt, pooled and normalised."""
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]  # [n, hidden]
    return F.normalize(hidden[-1] if kind == PoolingKind.LAST else hidden.mean(0), dim=0)


def small_llm(path: Path, **config: object) -> LLM:
    """Chunks of 16 tokens over blocks of 4: the 40-token prompt takes three steps."""
    return LLM(str(path), device="cpu", num_kv_blocks=64, max_num_batched_tokens=16,
               max_num_seqs=4, block_size=BLOCK_SIZE, **config)  # fmt: skip


@pytest.mark.parametrize(
    ("architecture", "pooling"), [("qwen3", "lasttoken"), ("llama", "mean_tokens")]
)
def test_embed_matches_hf(tmp_path: Path, architecture: str, pooling: str) -> None:
    from transformers import AutoModel

    path = write_tiny_embedding_model(tmp_path, architecture=architecture, pooling=pooling)
    llm = small_llm(path)
    kind = llm.engine.embedding.pooling
    hf = AutoModel.from_pretrained(path).eval()
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS), strict=True):
        got = torch.tensor(out.embedding)
        assert F.cosine_similarity(got, hf_pooled(hf, prompt, kind), dim=0) > 0.9999
        assert got.norm().item() == pytest.approx(1.0, abs=1e-5)
    llm.engine.scheduler.block_manager.check_integrity()


def test_a_causal_lm_embeds_with_runner_pooling(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_tiny_llama(tmp_path)
    llm = small_llm(path, runner="pooling")
    assert llm.engine.runner.model.lm_head is None  # its head is not even loaded
    body = AutoModelForCausalLM.from_pretrained(path).eval().model
    for prompt, out in zip(PROMPTS, llm.embed(PROMPTS), strict=True):
        want = hf_pooled(body, prompt, PoolingKind.LAST)
        assert F.cosine_similarity(torch.tensor(out.embedding), want, dim=0) > 0.9999


def test_an_engine_serves_one_kind_of_request(tmp_path: Path) -> None:
    embedder = small_llm(write_tiny_embedding_model(tmp_path / "e", matryoshka=True))
    with pytest.raises(ValueError, match="it does not generate"):
        embedder.generate([[1, 2]], detokenize=False)
    (short,) = embedder.embed([[1, 2, 3]], dimensions=8)
    assert len(short.embedding) == 8 and np.linalg.norm(short.embedding) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="1 to 64"):
        embedder.embed([[1, 2]], dimensions=65)
    generator = small_llm(write_tiny_llama(tmp_path / "g"))
    with pytest.raises(ValueError, match="it does not embed"):
        generator.embed([[1, 2]])
    with pytest.raises(ValueError, match="it does not embed"):
        generator.engine.add_request(pooling_request("p", [1, 2]))


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'},
         "--speculative-config: an embedding model decodes no tokens to draft"),
        ({"enable_lora": True}, "--enable-lora: an embedding model serves no LoRA adapters"),
    ],
)  # fmt: skip
def test_an_embedding_engine_refuses_what_only_generation_uses(
    tmp_path: Path, config: dict[str, object], words: str
) -> None:
    """Accepted, these would change nothing an embedding does (speculation was)."""
    with pytest.raises(ValueError, match=re.escape(words)):
        small_llm(write_tiny_llama(tmp_path), runner="pooling", **config)


def test_the_warm_up_pools_the_largest_steps_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """An embedding engine's warm-up (on CUDA before the first request; run here on the CPU):
    a budget-filling step of mean-pooled prompts and a step of the most one-token rows, nothing
    sampled; afterwards the engine embeds as before."""
    path = write_tiny_embedding_model(tmp_path, architecture="llama", pooling="mean_tokens")
    llm = small_llm(path)
    runner = llm.engine.runner
    plans = runner.warm_up_plans()
    assert [p.num_batched_tokens for p in plans] == [16, 4]  # the budget; --max-num-seqs rows
    assert all(not s.samples and s.request.pooling is not None for p in plans for s in p.scheduled)
    before = llm.embed(PROMPTS)
    runner.warm_up()
    assert not runner.pooler._sums
    after = llm.embed(PROMPTS)
    assert [o.embedding for o in after] == [o.embedding for o in before]


def test_sentence_transformers_max_seq_length_caps_the_context(tmp_path: Path) -> None:
    """sentence-transformers cuts inputs at its max_seq_length; the engine takes none longer
    (vLLM caps max_model_len there too), where it would embed them whole into another vector."""
    path = write_tiny_embedding_model(tmp_path)
    modules = json.loads((path / "modules.json").read_text())
    folder = path / next(m for m in modules if m["type"].endswith("Transformer")).get("path", "")
    write(folder / "sentence_bert_config.json", {"max_seq_length": 16})
    llm = small_llm(path)
    assert llm.engine.max_model_len == 16
    assert len(llm.embed([list(range(5, 21))])[0].embedding) == 64  # 16 tokens: taken
    with pytest.raises(ValueError, match="16"):
        llm.embed([list(range(5, 22))])  # 17: refused, not embedded whole


def test_the_offline_api_puts_the_default_prompt_before_texts(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """As sentence-transformers' encode (and /v1/embeddings) does; token ids are taken as
    they are."""
    from transformers import AutoModel, AutoTokenizer

    from tests.factories import copy_tokenizer

    path = write_tiny_embedding_model(tmp_path, vocab_size=49152)
    copy_tokenizer(default_model_dir, path)
    write(path / "config_sentence_transformers.json",
          {"prompts": {"query": "query: "}, "default_prompt_name": "query"})  # fmt: skip
    llm = small_llm(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModel.from_pretrained(path).eval()
    prompted = tokenizer.encode("query: hello there")
    (text,) = llm.embed(["hello there"])
    assert text.prompt_token_ids == prompted
    want = hf_pooled(hf, prompted, llm.engine.embedding.pooling)
    assert F.cosine_similarity(torch.tensor(text.embedding), want, dim=0) > 0.9999
    (ids,) = llm.embed([tokenizer.encode("hello there")])
    assert ids.prompt_token_ids == tokenizer.encode("hello there")
