"""The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) against HF transformers.

Reference: ``AutoModelForCausalLM.from_pretrained`` on the same converted folder, in float32.
Greedy continuations of chat prompts must match token for token, with the logits behind each
token within atol 1e-3 (float32 through 30 layers; rtol 0). A slow test also checks the
conversion itself: HF loading the GGUF directly gives the same weights, tokenizer and logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_core.loader import LoadedModel, load_model
from engine_core.model_dir import default_gguf_path
from tests.paged_harness import PagedRunner, Sequence, generate_greedy, hf_greedy

ATOL = 1e-3
NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def ours(default_model_dir: Path) -> LoadedModel:
    loaded = load_model("default", torch.device("cpu"), torch.float32)
    assert loaded.model_dir == default_model_dir
    return loaded


@pytest.fixture(scope="module")
def hf_model(default_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chat_prompts(default_model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    return [chat_ids(tokenizer, question) for question in QUESTIONS]


def chat_ids(tokenizer: object, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"])


def test_config_is_smollm2_135m(ours: LoadedModel) -> None:
    config = ours.config
    assert (config.architecture, config.vocab_size, config.hidden_size) == ("llama", 49152, 576)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    assert (config.head_dim, config.intermediate_size) == (64, 1536)
    assert config.tie_word_embeddings
    assert (config.eos_token_ids, config.bos_token_id) == ((2,), 1)


def test_greedy_chat_matches_hf(
    ours: LoadedModel, hf_model: torch.nn.Module, chat_prompts: list[list[int]]
) -> None:
    got = generate_greedy(ours.module, chat_prompts, NEW_TOKENS, block_size=16, stagger=2)
    for i, prompt in enumerate(chat_prompts):
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert got.tokens[i] == ref.tokens[0], f"prompt {i}"
        torch.testing.assert_close(got.logits[i], ref.logits[0], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_conversion_matches_hf_reading_the_gguf(
    ours: LoadedModel,
    hf_model: torch.nn.Module,
    default_model_dir: Path,
    chat_prompts: list[list[int]],
) -> None:
    """HF's own GGUF load (about 25 s on two cores) against our cached conversion."""
    gguf = default_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    converted = hf_model.state_dict()
    for name, tensor in direct.state_dict().items():
        assert torch.equal(tensor, converted[name]), name

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert chat_ids(tokenizer, QUESTIONS[0]) == chat_prompts[0]

    prompt = chat_prompts[0]
    with torch.no_grad():
        expected = direct(torch.tensor([prompt])).logits[0, -1].float()  # [vocab]
    got = PagedRunner(ours.module, block_size=16).step([(Sequence(prompt), len(prompt))])[0]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
