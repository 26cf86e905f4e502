"""`tandem serve --quantization fp8` answers the official openai client with the greedy text of
HF transformers on the same weights quantized per output row (e4m3) and dequantized, each
linear's input quantized per token and back (as the FP8 kernels quantize it): the flag reaches
the engine process and the engine serves the FP8 model. The tiny random Llama borrows the
default model's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.quant_fixtures import e4m3_per_token, quantize_inputs
from tests.server_fixture import Server, start_server, stop_server
from tests.test_fp8 import LINEARS, dequantize, quantize_per_row

NEW_TOKENS = 12
PROMPTS = ["The capital of France is", "Once upon a time"]


def dequantized_reference(model_dir: Path, out: Path) -> Path:
    """A plain copy of ``model_dir`` whose projections hold their per-row FP8 values."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.save_pretrained(out)
    state = load_file(out / "model.safetensors")
    for name, tensor in state.items():
        module, _, param = name.rpartition(".")
        if param == "weight" and module.rpartition(".")[2] in LINEARS:
            state[name] = dequantize(*quantize_per_row(tensor))
    save_file(state, str(out / "model.safetensors"))
    return out


def hf_greedy(
    model_dir: Path, tokenizer_dir: Path, prompt: str, fp8_activations: bool = False
) -> tuple[str, list[float]]:
    """HF's greedy text and the logprob of each token it chose (``fp8_activations``: each
    linear's input per token through e4m3 and back)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fp8_activations:
        quantize_inputs(model, e4m3_per_token)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
    new = out.sequences[0, ids.shape[1] :]
    steps = zip(out.logits, new, strict=True)
    logprobs = [float(step[0].float().log_softmax(-1)[token]) for step, token in steps]
    return tokenizer.decode(new), logprobs


@pytest.fixture(scope="module")
def fp8_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("serve-fp8"),
        model=str(tiny_model_dir),
        args=["--max-model-len", "256", "--num-kv-blocks", "64", "--quantization", "fp8"],
    )
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def references(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[str, list[float], list[float]]]:
    """Per prompt, computed once for both routes: HF's greedy text and chosen tokens' logprobs
    on the FP8 values, and those tokens' logprobs on the unquantized weights."""
    reference = dequantized_reference(tiny_model_dir, tmp_path_factory.mktemp("fp8-reference"))
    out = {}
    for prompt in PROMPTS:
        text, logprobs = hf_greedy(reference, tiny_model_dir, prompt, fp8_activations=True)
        _, unquantized = hf_greedy(tiny_model_dir, tiny_model_dir, prompt)
        out[prompt] = (text, logprobs, unquantized)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_fp8_server_gives_hf_greedy_text(
    fp8_server: Server,
    references: dict[str, tuple[str, list[float], list[float]]],
    tiny_model_dir: Path,
    stream: bool,
) -> None:
    """The text equals HF's on the FP8 values, and so do the chosen tokens' logprobs, which the
    unquantized weights would miss (checked: the flag cannot be ignored unnoticed)."""
    client = openai.OpenAI(base_url=f"{fp8_server.base_url}/v1", api_key="unused")
    for prompt in PROMPTS:
        text, logprobs, unquantized = references[prompt]
        args = {"model": str(tiny_model_dir), "prompt": prompt, "max_tokens": NEW_TOKENS,
                "temperature": 0, "logprobs": 1,
                "extra_body": {"ignore_eos": True}}  # fmt: skip
        if stream:
            chunks = list(client.completions.create(**args, stream=True))
            got = "".join(c.choices[0].text for c in chunks)
            got_logprobs = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        else:
            choice = client.completions.create(**args).choices[0]
            got, got_logprobs = choice.text, choice.logprobs.token_logprobs
        assert got == text
        torch.testing.assert_close(
            torch.tensor(got_logprobs), torch.tensor(logprobs), atol=1e-3, rtol=0
        )
        assert max(abs(a - b) for a, b in zip(unquantized, logprobs, strict=True)) > 1e-2
