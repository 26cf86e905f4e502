"""Text to token ids and back, for the frontend: the HF tokenizer behind one worker thread.

Encoding and chat templates run on that thread, never on the event loop; decoding (the Rust
backend, cheap) runs inline, for the incremental detokenizer and for logprob token texts.
Prompt texts (``encode``) are coalesced: while one encode call runs on the thread, the texts
of the requests that arrive queue, and the next call takes them all at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import decoders

from common.chat_template import parse_chat_template, syntax_error_text, template_error_text
from common.hf_tokenizer import load_explained, load_pretrained_tokenizer
from frontend.errors import OpenAIError, bad_request

logger = logging.getLogger("tandem.frontend")


def load_hf_tokenizer(model_dir: Path, chat_template: str | Path | None = None) -> Any:
    """The model's HF tokenizer; ``chat_template``: a Jinja file that replaces its template.
    TokenizerError, in one line, where the folder's tokenizer does not load."""
    tokenizer = load_explained(load_pretrained_tokenizer, model_dir)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    elif isinstance(tokenizer.chat_template, str):
        warn_if_template_breaks(tokenizer.chat_template, model_dir)
    return tokenizer


def warn_if_template_breaks(source: str, model_dir: Path) -> None:
    """The model's own template, said at start when it does not parse: every chat request will
    then be a 500 (completions still serve), until --chat-template gives one that does."""
    from jinja2 import TemplateSyntaxError

    try:
        template_variables(source)
    except TemplateSyntaxError as exc:
        logger.warning(
            "the chat template of %s does not parse (%s): chat requests will fail; "
            "--chat-template FILE replaces it",
            model_dir,
            syntax_error_text(exc),
        )


class Tokenizer:
    """The HF tokenizer behind one worker thread (encode), plus fast decode for the loop."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer  # Rust tokenizers: decode is cheap
        # Its decode is the UTF-8 of the tokens' bytes, piece by piece (IncrementalDetokenizer).
        self.byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
        # One call through HF first: it sets the Rust tokenizer up as every HF call would (no
        # truncation or padding, its split_special_tokens), which encode_all then relies on.
        hf_tokenizer.encode("", add_special_tokens=False)
        # One thread: the HF wrapper is not safe to call from several threads at once.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)
        # What decode(..., skip_special_tokens=True) leaves out of the text.
        self.special_ids = frozenset(
            token_id
            for token_id, added in self._backend.get_added_tokens_decoder().items()
            if added.special
        )
        # encode's queue: each waiting request's texts and the future its ids go to.
        self._queued: list[tuple[list[str], asyncio.Future[list[list[int]]]]] = []
        self._encoder: asyncio.Task[None] | None = None  # drains the queue while it is not empty

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_keeping_special_tokens(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=False)

    def _token_text(self, token_id: int) -> str:
        return self._backend.decode([token_id], skip_special_tokens=False)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a tokenizer call on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """``encode_all(texts)`` on the worker thread, in one call with the texts of the other
        requests waiting for it. One call per request left a burst of requests queued on the
        single thread one after another; one ``encode_batch`` call spreads its texts over the
        cores (on the 2-core CPU machine, 256 prompts of 128 tokens arriving at once: 118-130 ms
        one call each, 45-49 ms coalesced; docs/design/frontend-host-costs.md, "What moved it",
        item 5). A lone request still goes at once."""
        future: asyncio.Future[list[list[int]]] = asyncio.get_running_loop().create_future()
        self._queued.append((texts, future))
        if self._encoder is None:
            self._encoder = asyncio.ensure_future(self._drain_encodes())
        return await future

    async def _drain_encodes(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                await self._encode_batch(batch)
        finally:
            self._encoder = None

    async def _encode_batch(
        self, batch: list[tuple[list[str], asyncio.Future[list[list[int]]]]]
    ) -> None:
        """Encode every request's texts in one call and hand each its ids; if the call fails,
        each request is encoded on its own, so only the one whose text fails sees the error."""
        try:
            ids = await self.run(self.encode_all, [t for texts, _ in batch for t in texts])
        except Exception as exc:
            if len(batch) > 1:
                for one in batch:
                    await self._encode_batch([one])
            elif not batch[0][1].done():
                batch[0][1].set_exception(exc)
            return
        start = 0
        for texts, future in batch:
            if not future.done():  # done: cancelled, its client left while it waited
                future.set_result(ids[start : start + len(texts)])
            start += len(texts)

    def encode_all(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """The ids HF's ``encode`` gives, from the Rust tokenizer directly: HF's Python checks
        before the same ``encode_batch`` call held the GIL that the event loop needs, 7% of the
        API process at 256 streams; the Rust call releases it while it works. The ``_fast``
        call skips the character offsets nobody reads here: one call on 256 prompts took 50-82 ms
        with them and 38-45 ms without on the 2-core CPU machine (bench_prompt_encode.py)."""
        encodings = self._backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def render_chat(self, chat: ChatRender) -> RenderedChat:
        """Apply the chat template (``chat.template``, else the model's); the text already holds
        special tokens, so none are added."""
        text = self.render_chat_text(chat)
        return RenderedChat(text, self.hf.encode(text, add_special_tokens=False))

    def render_chat_text(self, chat: ChatRender) -> str:
        """The chat template's text, images expanded, not tokenized."""
        try:
            text = self.hf.apply_chat_template(
                chat.messages,
                tools=chat.tools,
                chat_template=chat.template,
                tokenize=False,
                add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message,
                **chat.template_kwargs,
            )
        except Exception as exc:  # jinja or a missing template: the client's messages or model
            raise bad_request(f"could not apply the chat template: {exc}", "messages") from None
        if chat.image_text is not None:
            text = expand_images(text, *chat.image_text)
        return text

    def template_variables(self, template: str | None = None) -> frozenset[str]:
        """The variables a chat template reads (``template``, else the model's): a
        ``chat_template_kwargs`` key it never reads could not change the prompt."""
        from jinja2 import TemplateSyntaxError

        source = template or self.hf.chat_template
        if not isinstance(source, str):
            return frozenset()
        try:
            return template_variables(source)
        except TemplateSyntaxError as exc:  # the model's own: the server's fault, not the client's
            raise OpenAIError(
                500, f"the model's chat template {template_error_text(exc)}", "internal_error"
            ) from None


@dataclass(frozen=True)
class ChatRender:
    """What a chat prompt is rendered from."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    template: str | None = None  # a template in place of the model's (tools, say)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # (marker, one text per image): each image marker the template wrote becomes the text the
    # model's HF processor puts in its place, before tokenizing (Gemma 3, Llama 4;
    # frontend/vision.py).
    image_text: tuple[str, tuple[str, ...]] | None = None


@dataclass(frozen=True)
class RenderedChat:
    text: str
    token_ids: list[int]


def expand_images(text: str, marker: str, expansions: tuple[str, ...]) -> str:
    """``text`` with its i-th ``marker`` replaced by ``expansions[i]``; a 400 where the chat
    template wrote another number of markers than there are images."""
    pieces = text.split(marker)
    if len(pieces) != len(expansions) + 1:
        raise bad_request(
            f"the chat template wrote {len(pieces) - 1} image markers for {len(expansions)} images",
            "messages",
        )
    out = [pieces[0]]
    for expansion, piece in zip(expansions, pieces[1:], strict=True):
        out += [expansion, piece]
    return "".join(out)


@lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The undeclared variables of a Jinja template: those its caller can set."""
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(parse_chat_template(source)))
