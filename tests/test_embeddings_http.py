"""/v1/embeddings through real `tandem serve` processes, with the official `openai` client.

Two small random embedding models that the tests write as sentence-transformers lays them out (a
bare HF body saved with ``save_pretrained``, modules.json, a Pooling config, a Normalize module),
borrowing the default model's tokenizer: a Qwen3Model with last-token pooling, marked Matryoshka,
and a LlamaModel with mean pooling. The independent expectation is HF transformers on the same
weights: the final hidden states of each unpadded input, pooled and L2-normalised. The servers
run with a step budget of 32 tokens, so a longer input is prefilled in chunks. After each
module's tests the engines hold no request and every KV block is free (the integrity check).
"""

# Fixtures arrive as parameters named like the imported fixture: F811 is expected here.
# ruff: noqa: F811

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.factories import copy_tokenizer, write_tiny_embedding_model
from tests.server_fixture import (  # noqa: F401
    Server,
    start_server,
    stop_server,
    tiny_server,
    wait_engine_idle,
)

pytestmark = pytest.mark.slow

BUDGET = 32  # --max-num-batched-tokens: a longer input takes several prefill steps
SERVE_ARGS = ["--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", "8",
              "--num-kv-blocks", "128", "--max-model-len", "512"]  # fmt: skip
TEXTS = [
    "The capital of France is Paris.",
    "Embeddings map text to vectors",
    "a",
    "A longer input, long enough that its prompt runs in several chunks of the step budget: "
    "the engine adds each chunk's hidden states where it pools the mean, and keeps the last "
    "token's where it pools that, and either way the vector must be the one computed at once.",
]


@dataclass
class EmbeddingServer:
    server: Server
    model: str  # the served model's name: its folder
    client: openai.OpenAI
    hf: Any  # HF transformers' model on the same weights
    tokenizer: Any
    mean: bool  # mean pooling, else last-token
    prompt: str = ""  # the checkpoint's sentence-transformers default prompt

    def reference(self, ids: list[int]) -> np.ndarray:
        """HF's pooled, normalised final hidden states of one unpadded input."""
        import torch

        with torch.no_grad():
            hidden = self.hf(torch.tensor([ids])).last_hidden_state[0]  # [n, hidden]
        vector = (hidden.mean(0) if self.mean else hidden[-1]).numpy().astype(np.float64)
        return vector / np.linalg.norm(vector)


def start_embedding_server(
    tmp_path_factory: pytest.TempPathFactory,
    default_model_dir: Path,
    prompt: str = "",
    **model: Any,
) -> Iterator[EmbeddingServer]:
    """``prompt``: the checkpoint's default prompt (config_sentence_transformers.json), which
    sentence-transformers puts before every input."""
    from transformers import AutoModel, AutoTokenizer

    folder = tmp_path_factory.mktemp("embedding-model")
    write_tiny_embedding_model(folder, vocab_size=49152, **model)
    copy_tokenizer(default_model_dir, folder)
    if prompt:
        settings = {"prompts": {"query": prompt, "document": ""}, "default_prompt_name": "query"}
        (folder / "config_sentence_transformers.json").write_text(json.dumps(settings))
    srv = start_server(tmp_path_factory.mktemp("serve-embed"), model=str(folder), args=SERVE_ARGS)
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", max_retries=0)
    hf = AutoModel.from_pretrained(folder).eval()
    mean = model.get("pooling") == "mean_tokens"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        yield EmbeddingServer(srv, str(folder), client, hf, tokenizer, mean, prompt)
        wait_engine_idle(srv)  # nothing left running, every block free, integrity holds
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def last_token(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[EmbeddingServer]:
    yield from start_embedding_server(tmp_path_factory, default_model_dir, matryoshka=True)


@pytest.fixture(scope="module")
def mean(
    tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path
) -> Iterator[EmbeddingServer]:
    yield from start_embedding_server(
        tmp_path_factory, default_model_dir, prompt="query: ", architecture="llama",
        pooling="mean_tokens",
    )  # fmt: skip


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_matches_hf(srv: EmbeddingServer, inputs: list[str], vectors: list[Any]) -> None:
    assert len(vectors) == len(inputs)
    for text, vector in zip(inputs, vectors, strict=True):
        ids = srv.tokenizer.encode(srv.prompt + text)  # as sentence-transformers encodes it
        assert cosine(vector, srv.reference(ids)) >= 0.9999, text
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


POOLINGS = ["last_token", "mean"]


@pytest.mark.parametrize("pooling", POOLINGS)
def test_one_input_matches_hf(pooling: str, request: pytest.FixtureRequest) -> None:
    srv: EmbeddingServer = request.getfixturevalue(pooling)
    resp = srv.client.embeddings.create(input=TEXTS[0], model=srv.model, encoding_format="float")
    assert resp.object == "list" and resp.model == srv.model
    assert [(d.index, d.object) for d in resp.data] == [(0, "embedding")]
    assert_matches_hf(srv, TEXTS[:1], [resp.data[0].embedding])
    tokens = len(srv.tokenizer.encode(srv.prompt + TEXTS[0]))
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (tokens, tokens)


@pytest.mark.parametrize("pooling", POOLINGS)
def test_a_batch_matches_hf_in_input_order(pooling: str, request: pytest.FixtureRequest) -> None:
    """The inputs go to the engine together; the longest is prefilled in several chunks."""
    srv: EmbeddingServer = request.getfixturevalue(pooling)
    assert len(srv.tokenizer.encode(TEXTS[-1])) > BUDGET
    resp = srv.client.embeddings.create(input=TEXTS, model=srv.model, encoding_format="float")
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    assert_matches_hf(srv, TEXTS, [d.embedding for d in resp.data])
    tokens = sum(len(srv.tokenizer.encode(srv.prompt + t)) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens


def test_more_inputs_than_the_admission_bound_are_embedded_in_turns(
    last_token: EmbeddingServer,
) -> None:
    """--max-num-seqs 8 admits 32 sequences (8 running, 24 waiting): 40 inputs, fewer than
    OpenAI's 2,048 a request, go to the engine 32 then 8, each still HF's vector, in order."""
    srv = last_token
    inputs = [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(40)]
    resp = srv.client.embeddings.create(input=inputs, model=srv.model, encoding_format="float")
    assert [d.index for d in resp.data] == list(range(40))
    assert_matches_hf(srv, inputs, [d.embedding for d in resp.data])


def test_token_ids_embed_as_their_text_does(last_token: EmbeddingServer) -> None:
    srv = last_token
    ids = [srv.tokenizer.encode(t) for t in TEXTS[:2]]
    one = srv.client.embeddings.create(input=ids[0], model=srv.model, encoding_format="float")
    both = srv.client.embeddings.create(input=ids, model=srv.model, encoding_format="float")
    text = srv.client.embeddings.create(input=TEXTS[:2], model=srv.model, encoding_format="float")
    assert one.data[0].embedding == both.data[0].embedding == text.data[0].embedding
    assert both.data[1].embedding == text.data[1].embedding


@pytest.mark.parametrize("pooling", POOLINGS)
def test_base64_round_trips_to_the_same_floats(
    pooling: str, request: pytest.FixtureRequest
) -> None:
    """The openai client asks for base64 by default and decodes it itself. One input at a time
    on an idle engine, so that each is computed in the same steps both times (in a batch, how
    its chunks fall among the others' moves the float sums by a rounding)."""
    srv: EmbeddingServer = request.getfixturevalue(pooling)
    for text in TEXTS:
        floats = srv.client.embeddings.create(input=text, model=srv.model, encoding_format="float")
        decoded = srv.client.embeddings.create(input=text, model=srv.model)  # base64 on the wire
        want = np.asarray(floats.data[0].embedding, np.float32)
        assert np.array_equal(want, np.asarray(decoded.data[0].embedding, np.float32))
        raw = httpx.post(
            f"{srv.server.base_url}/v1/embeddings",
            json={"input": text, "model": srv.model, "encoding_format": "base64"},
            timeout=60,
        ).json()["data"][0]["embedding"]
        assert np.array_equal(np.frombuffer(base64.b64decode(raw), "<f4"), want)


def test_dimensions_cut_the_vector_then_normalise_it(last_token: EmbeddingServer) -> None:
    srv = last_token
    full = srv.client.embeddings.create(input=TEXTS, model=srv.model, encoding_format="float")
    cut = srv.client.embeddings.create(
        input=TEXTS, model=srv.model, encoding_format="float", dimensions=16
    )
    for whole, short in zip(full.data, cut.data, strict=True):
        head = np.asarray(whole.embedding[:16], dtype=np.float64)
        assert len(short.embedding) == 16
        assert np.linalg.norm(short.embedding) == pytest.approx(1.0, abs=1e-5)
        assert np.allclose(short.embedding, head / np.linalg.norm(head), atol=1e-6)


def assert_openai_400(err: openai.BadRequestError, param: str | None, *words: str) -> dict:
    """A 400 in OpenAI's error shape whose message says ``words``."""
    assert err.status_code == 400
    body = err.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    for word in words:
        assert word in body["error"]["message"]
    return body["error"]


def test_dimensions_the_model_cannot_give_are_refused(
    last_token: EmbeddingServer, mean: EmbeddingServer
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        mean.client.embeddings.create(input="x", model=mean.model, dimensions=16)
    assert_openai_400(info.value, "dimensions", "does not support Matryoshka")
    for dims in (65, 0):
        with pytest.raises(openai.BadRequestError) as info:
            last_token.client.embeddings.create(input="x", model=last_token.model, dimensions=dims)
        assert_openai_400(info.value, "dimensions")


def test_a_generative_server_refuses_embeddings(tiny_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="none", max_retries=0)
    served = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(input="hello", model=served)
    error = assert_openai_400(info.value, None, "not an embedding model", "--runner pooling")
    assert error["code"] == "model_does_not_embed"
    # A name the server does not serve is a 404 first, as on completions and chat (and vLLM).
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(input="hello", model="anything")
    assert missing.value.response.json()["error"]["param"] == "model"


def test_an_embedding_server_refuses_chat_and_completions(last_token: EmbeddingServer) -> None:
    srv = last_token
    messages = [{"role": "user", "content": "hi"}]
    calls = [
        lambda: srv.client.chat.completions.create(model=srv.model, messages=messages),
        lambda: srv.client.chat.completions.create(model=srv.model, messages=messages, stream=True),
        lambda: srv.client.completions.create(model=srv.model, prompt="hi"),
        lambda: srv.client.completions.create(model=srv.model, prompt="hi", stream=True),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        error = assert_openai_400(info.value, None, "embedding model", "/v1/embeddings")
        assert error["code"] == "model_does_not_generate"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [1, 49152]}, "input"),  # beyond the vocabulary
        ({"input": [7] * 513}, "input"),  # beyond --max-model-len 512
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"input": "x", "model": "another"}, "model"),
        # JSON of the wrong type is refused, not read as pydantic's lax mode would (1, 0).
        ({"input": [True, False]}, "input"),
        ({"input": "x", "dimensions": True}, "dimensions"),
        ({"input": "x", "dimensions": "16"}, "dimensions"),
    ],
)
def test_bad_requests_are_refused_by_name(
    last_token: EmbeddingServer, body: dict[str, Any], param: str
) -> None:
    resp = httpx.post(f"{last_token.server.base_url}/v1/embeddings", json=body, timeout=60)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param
