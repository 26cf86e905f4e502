"""The vision benchmark (benchmarks/vision.py) on the tiny random Qwen2.5-VL and a real CPU
server, kept short: its requests each carry a fresh image and a text of the asked length, the
server counts exactly the prompt the chat template and the image make, the encoder's rows and
the TTFT table come out as the report prints them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import parse
from benchmarks.vision import chat_bodies, load_tokenizer, run
from tests import test_vision_engine

vl_dir = test_vision_engine.vl_dir  # the fixture: the tiny model's folder


def test_each_request_has_its_own_image_and_the_asked_text_length(vl_dir: Path) -> None:
    tokenizer = load_tokenizer(vl_dir)
    bodies = chat_bodies(4, 64, 16, tokenizer, seed=1)
    urls = [body["messages"][0]["content"][0]["image_url"]["url"] for body in bodies]
    assert len(set(urls)) == 4 and all(url.startswith("data:image/png;base64,") for url in urls)
    for body in bodies:
        text = body["messages"][0]["content"][1]["text"]
        assert len(tokenizer.encode(text, add_special_tokens=False).ids) == 16
    assert chat_bodies(4, 64, 16, tokenizer, seed=1) == bodies  # one seed, one workload


def test_the_benchmark_on_a_cpu_server(
    vl_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "vision.json"
    argv = [
        "vision", "--model", str(vl_dir), "--device", "cpu", "--image-size", "64",
        "--batches", "1,2", "--encoder-trials", "1", "--concurrency", "1,2", "--requests", "2",
        "--warmup", "1", "--text-tokens", "16", "--json", str(out),
    ]  # fmt: skip
    assert run(parse(argv)) == 0
    results = json.loads(out.read_text())["results"]
    # 64 pixels a side: 2 merge blocks of 28, 4x4 patches, 2x2 = 4 tokens an image.
    assert [
        (r["batch"], r["patches_per_image"], r["tokens_per_image"]) for r in results["encoder"]
    ] == [(1, 16, 4), (2, 16, 4)]
    # The server counted each kept request's prompt: the template around one image
    # placeholder, repeated for the image's 4 tokens, and the text.
    tokenizer = load_tokenizer(vl_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    bodies = chat_bodies(1 + 2 * 2, 64, 16, tokenizer, seed=0)[1:]
    expected = []
    for body in bodies:
        text = body["messages"][0]["content"][1]["text"]
        message = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}
        rendered = hf_tokenizer.apply_chat_template(
            [message], tokenize=False, add_generation_prompt=True
        )
        expected.append(len(hf_tokenizer.encode(rendered, add_special_tokens=False)) - 1 + 4)
    assert list(results["ttft"]) == ["tandem"]  # no peer asked for
    rows = results["ttft"]["tandem"]
    counted = [n for row in rows for n in row["prompt_tokens"]]
    assert [row["concurrency"] for row in rows] == [1, 2]
    assert counted == expected
    assert all(ms > 0 for row in rows for ms in row["ttft_ms"])
    printed = capsys.readouterr().out
    assert "commit:" in printed and "| images a call |" in printed
    assert "| concurrency | requests | prompt tokens | TTFT p50 ms | TTFT p99 ms |" in printed
