"""The offline API: batch generation in this process, on the same scheduler and runner.

    llm = LLM("default")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

    embedder = LLM("path/to/Qwen3-Embedding")  # or runner="pooling" with a causal LM
    vectors = [out.embedding for out in embedder.embed(["Hello", "world"])]

Also the `tandem generate` subcommand.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import operator
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.sentence_transformers import default_prompt
from engine_core.config import EngineConfig
from engine_core.embedding import check_pooling
from engine_core.request import EngineOutput, Request
from protocol.codec import validate_pooling_params, validate_sampling_params
from protocol.messages import (
    FinishReason,
    ImageInput,
    LoraRef,
    PoolingParams,
    SamplingParams,
    TokenLogprobs,
)


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason | None
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None  # with FinishReason.ERROR: why the engine failed it
    # With prompt_logprobs: one entry per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class EmbeddingOutput:
    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float] | None = None  # None only with an error
    error: str | None = None  # why the engine failed it


# How the offline API serves a model whose tokenizer does not load (TokenizerError's hint).
OFFLINE_IDS = "token ids need none: LLM.generate(ids, detokenize=False)"

# One text or token-id sequence, or a batch of them.
Prompts = str | Sequence[int] | Sequence[str | Sequence[int]]


def prompt_batch(prompts: Prompts) -> list[str | Sequence[int]]:
    """The prompts as a batch: one text, or one sequence of ints (token ids), is a batch of
    one; a str is never taken as a sequence of one-character prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if not is_sequence_like(prompts):
        raise TypeError(
            f"prompts are a str, token ids, or a sequence of those, not {type(prompts).__name__}"
        )
    batch = list(prompts)
    if any(is_token_id(p) for p in batch):
        return [batch]  # one prompt's token ids (numpy's ints too; _encode names any others)
    return batch


def is_token_id(value: Any) -> bool:
    """An int as an index takes one (numpy's, a torch scalar's), not a bool, nor an array of
    one element (a row of a [batch, 1] array is a prompt)."""
    if isinstance(value, bool) or getattr(value, "ndim", 0) != 0:
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def is_sequence_like(value: Any) -> bool:
    """A list, tuple, numpy array...: iterable, and neither text, bytes nor a mapping."""
    return isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping)


class LLM:
    def __init__(
        self, model: str = "default", *, without_tokenizer: str = OFFLINE_IDS, **engine_kwargs: Any
    ) -> None:
        """``without_tokenizer``: how to serve the model where its tokenizer does not load (the
        hint of that TokenizerError)."""
        from engine_core.core import EngineCore

        config = EngineConfig(model=model, **engine_kwargs)
        if config.profile_dir is not None:  # before the model loads, as the other refusals
            raise ValueError(
                "profile_dir: the offline API has no profiler to start; profile a server "
                "(`tandem serve --profile-dir DIR`, then POST /start_profile and /stop_profile)"
            )
        self.engine = EngineCore(config)
        self.broken: str | None = None  # why no call can run, once a step of its ranks was cut
        self.without_tokenizer = without_tokenizer
        self._tokenizer: Any = None
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            from common.hf_tokenizer import load_explained
            from engine_core.model_dir import tokenizer_dir_of

            model_dir = tokenizer_dir_of(self.engine.config.model, self.engine.runner.model_dir)
            self._tokenizer = load_explained(
                lambda folder: AutoTokenizer.from_pretrained(str(folder)),
                model_dir,
                self.without_tokenizer,
            )
        return self._tokenizer

    @functools.cached_property
    def _embedding_prompt(self) -> str:
        """The checkpoint's default prompt, put before each text ``embed`` takes (read once)."""
        return default_prompt(self.engine.runner.model_dir)

    def generate(
        self,
        prompts: Prompts,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        detokenize: bool = True,
        lora: LoraRef | Sequence[LoraRef | None] | None = None,
        images: Sequence[Sequence[ImageInput]] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt (text or token ids) to completion; outputs in prompt order.
        ``lora``: the LoRA adapter of every prompt, or one per prompt (None: the base model;
        the engine needs ``enable_lora=True``). ``images``: each prompt's processed images (a
        vision-language model; the prompt's token ids then hold their placeholder runs, as
        frontend/vision.py places them).

        One text or one sequence of token ids is a batch of one (vLLM's LLM takes them so).
        All or nothing: a prompt or parameters the engine refuses raise ValueError (TypeError
        for what is not a prompt or SamplingParams) before any prompt runs, and leave the
        engine as it was."""
        self._check_usable()
        prompts = prompt_batch(prompts)
        params_list = self._params_per_prompt(params, len(prompts))
        per_prompt = [()] * len(prompts) if images is None else [tuple(i) for i in images]
        if len(per_prompt) != len(prompts):
            raise ValueError(f"images for {len(per_prompt)} prompts, not {len(prompts)}")
        for p in params_list:
            validate_sampling_params(p)
            if p.constraint is not None:
                self.engine.grammar_compiler().check(p.constraint)
        loras = list(lora) if isinstance(lora, Sequence) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA adapters for {len(prompts)} prompts")
        requests = [
            Request(
                f"offline-{next(self._ids)}", self._encode(prompt), p, lora=adapter, images=imgs
            )
            for prompt, p, adapter, imgs in zip(
                prompts, params_list, loras, per_prompt, strict=True
            )
        ]
        self._add_all(requests)
        if detokenize:  # the engine took them all: a missing tokenizer fails before they run
            try:
                self.tokenizer  # noqa: B018
            except BaseException:
                self.engine.abort([r.request_id for r in requests])
                raise
        outputs = {
            r.request_id: CompletionOutput(r.request_id, r.prompt_token_ids, [], None)
            for r in requests
        }
        self._run_until_done(outputs, functools.partial(self._take_completion, outputs))
        results = list(outputs.values())
        if detokenize:
            for r in results:
                r.text = self.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        return results

    def embed(self, prompts: Prompts, *, dimensions: int | None = None) -> list[EmbeddingOutput]:
        """Each prompt's vector (text or token ids), pooled and normalised as the model says,
        cut to ``dimensions`` first where given (a Matryoshka model); outputs in prompt order;
        one text or one sequence of token ids is a batch of one. ValueError, before any prompt
        runs, where the model does not embed or a prompt or ``dimensions`` cannot be served."""
        self._check_usable()
        model = self.engine.embedding
        if model is None:
            raise ValueError(
                "this model generates: it does not embed (give an embedding model, or "
                "runner='pooling')"
            )
        pooling = PoolingParams(model.pooling, model.normalize, dimensions)
        validate_pooling_params(pooling)
        check_pooling(pooling, model)
        before = self._embedding_prompt
        requests = [
            Request(
                f"offline-{next(self._ids)}",
                self._encode(p, before),
                SamplingParams(),
                pooling=pooling,
            )
            for p in prompt_batch(prompts)
        ]
        self._add_all(requests)
        outputs = {
            r.request_id: EmbeddingOutput(r.request_id, r.prompt_token_ids) for r in requests
        }
        self._run_until_done(outputs, functools.partial(self._take_embedding, outputs))
        return list(outputs.values())

    def _add_all(self, requests: list[Request]) -> None:
        """Add every request, or none: one the engine refuses takes those added before it out."""
        added: list[str] = []
        try:
            for request in requests:
                self.engine.add_request(request)
                added.append(request.request_id)
        except BaseException:
            self.engine.abort(added)
            raise

    def _run_until_done(
        self, request_ids: Iterable[str], take: Callable[[EngineOutput], None]
    ) -> None:
        """Step the engine until nothing is live, giving ``take`` each output of this call's
        ``request_ids``. Whatever ends the loop early (Ctrl-C, an engine error) aborts them,
        so the engine holds no blocks for them; an output of such an earlier call's request
        (its last step was in flight) is dropped here."""
        ours = set(request_ids)
        stepping = False
        try:
            while self.engine.has_unfinished():
                stepping = True
                outputs = self.engine.step()
                stepping = False
                for out in outputs:
                    if out.request.request_id in ours:
                        take(out)
        except BaseException as exc:
            self.engine.abort(list(ours))
            if stepping and not self.engine.runner.can_step_after_a_cut():
                self.broken = f"a step of its parallel ranks was cut ({type(exc).__name__})"
            raise

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(f"this LLM cannot run another step: {self.broken}; make a new one")

    @staticmethod
    def _take_embedding(outputs: dict[str, EmbeddingOutput], out: EngineOutput) -> None:
        record = outputs[out.request.request_id]
        record.embedding, record.error = out.embedding, out.error

    @staticmethod
    def _take_completion(outputs: dict[str, CompletionOutput], out: EngineOutput) -> None:
        record = outputs[out.request.request_id]
        record.token_ids.extend(out.new_token_ids)
        record.logprobs.extend(out.logprobs or [])
        if out.prompt_logprobs is not None:
            record.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is not None:
            record.finish_reason = out.finish_reason
            record.error = out.error

    def _encode(self, prompt: str | Sequence[int], text_before: str = "") -> list[int]:
        """A prompt's token ids; a text's after ``text_before`` (an embedding model's default
        prompt, as sentence-transformers puts it before each input)."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(text_before + prompt))
        if not is_sequence_like(prompt):
            raise TypeError(
                f"a prompt is a str or a sequence of token ids, not {type(prompt).__name__}"
            )
        ids = list(prompt)
        wrong = sorted({type(t).__name__ for t in ids if not is_token_id(t)})
        if wrong:  # 1.5, "7" and True are not ids; numpy's ints are
            raise TypeError(f"token ids are ints, not {', '.join(wrong)}")
        return [operator.index(t) for t in ids]

    @staticmethod
    def _params_per_prompt(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, Sequence):
            raise TypeError(
                f"params are one SamplingParams or a sequence of them, not {type(params).__name__}"
            )
        wrong = sorted({type(p).__name__ for p in params if not isinstance(p, SamplingParams)})
        if wrong:
            raise TypeError(f"a sequence of params holds SamplingParams, not {', '.join(wrong)}")
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return list(params)


# ---- `tandem generate` ------------------------------------------------------------------------


def utf8_text(value: str) -> str:
    """A command-line text that is valid UTF-8 (argv bytes that are not UTF-8 decode to lone
    surrogates, which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return value


def add_args(parser: argparse.ArgumentParser) -> None:
    from engine_core.args import add_engine_args

    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        type=utf8_text,
        help="prompt text (repeat the flag for a batch)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="tokens to generate at most (default: 64)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)"
    )
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k (default: 0)")
    add_engine_args(parser, command="generate")


def run(args: argparse.Namespace) -> int:
    # Ctrl-C ends the command at once, whatever it is in: a KeyboardInterrupt raised inside
    # an import's or torch's C++ code aborted the process (pybind11), or was swallowed by a
    # finalizer, or left it exiting by SIGINT. Nothing here outlives the process but what
    # dies with it (tensor-parallel workers), and nothing is printed before the end.
    signal.signal(signal.SIGINT, _exit_interrupted)
    from common.hf_tokenizer import RAW_ENGINE_HINT
    from engine_core.args import engine_config_from_args
    from engine_core.memory_plan import ModelTooLargeError

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    try:
        validate_sampling_params(params)
        config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 2
    try:
        llm = LLM(**vars(config), without_tokenizer=RAW_ENGINE_HINT)
    except (ModelTooLargeError, ValueError, FileNotFoundError) as exc:
        # Refused at start-up: the sizes (memory_plan.py, warm_up.py), or a model or flags
        # it cannot serve, named.
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 2
    from jinja2 import TemplateError

    from common.chat_template import template_error_text

    try:
        prompts: list = [chat_ids(llm, p) if args.chat else p for p in args.prompt]
        outputs = llm.generate(prompts, params)
    except ValueError as exc:  # a prompt the engine refuses (too long), a tokenizer that won't load
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 2
    except TemplateError as exc:  # --chat with a template that does not parse, or refuses
        print(f"tandem generate: the model's chat template {template_error_text(exc)}",
              file=sys.stderr)  # fmt: skip
        return 2
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(f"--- {prompt!r}\n{out.text}\n[finish: {out.finish_reason.openai_name}]")
    return 0


def _exit_interrupted(_signum: int, _frame: object) -> None:
    print("\ntandem generate: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def chat_ids(llm: LLM, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already holds the special tokens; adding BOS again would change the prompt.
    return llm.tokenizer.encode(text, add_special_tokens=False)
