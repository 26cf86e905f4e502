"""Our models against HF transformers on the same random weights, through our loader.

For each architecture a tiny random HF model is saved with ``save_pretrained`` and loaded by
``engine_core.loader.load_model``. Greedy generation over the paged KV cache (block size 4, so
every sequence spans many blocks) must give HF ``generate(do_sample=False)``'s tokens exactly,
and the logits behind every generated token must agree within atol 1e-4 (float32, rtol 0).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from engine_core.loader import iter_checkpoint, load_model, load_model_config
from engine_core.models import build_model
from tests.factories import tiny_hf_sizes
from tests.paged_harness import (
    HFCase,
    assert_matches,
    generate_greedy,
    hf_greedy,
    random_prompts,
    randomize,
    save_hf_case,
)

ATOL = 1e-4
NEW_TOKENS = 32
VOCAB = 320
SIZES = tiny_hf_sizes(VOCAB)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the scaled band covers frequencies that matter at these lengths.
    "original_max_position_embeddings": 16,
}
CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**SIZES, tie_word_embeddings=False),
    "llama3_rope_tied": lambda: LlamaConfig(
        **SIZES, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE
    ),
    "qwen2_bias": lambda: Qwen2Config(**SIZES, tie_word_embeddings=False),
    "qwen3_qk_norm": lambda: Qwen3Config(**SIZES, head_dim=32, tie_word_embeddings=True),
    "mistral_window": lambda: MistralConfig(**SIZES, sliding_window=8),
    "gpt2": lambda: GPT2Config(
        vocab_size=VOCAB,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
    ),
}
# Lengths 5, 11 and 23: partial, multiple and many blocks of 4.
PROMPTS = random_prompts(VOCAB, (5, 11, 23))


def make_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    randomize(model, seed)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HFCase:
    folder = tmp_path_factory.mktemp(request.param)
    return save_hf_case(request.param, make_hf_model(request.param), PROMPTS, folder, NEW_TOKENS)


def test_greedy_matches_hf(case: HFCase) -> None:
    """All prompts prefilled in one flattened batch, then decoded together."""
    ours = load_model(str(case.folder), torch.device("cpu"), torch.float32)
    got = generate_greedy(ours.module, PROMPTS, NEW_TOKENS, block_size=4)
    assert_matches(got, case.reference, ATOL)


def test_mixed_batches_match_hf(case: HFCase) -> None:
    """Staggered starts and 5-token prefill chunks: one forward mixes a prompt chunk with other
    sequences' decodes; blocks come from a shuffled free list, so tables are not contiguous."""
    ours = load_model(str(case.folder), torch.device("cpu"), torch.float32)
    got = generate_greedy(
        ours.module,
        PROMPTS,
        NEW_TOKENS,
        block_size=4,
        prefill_chunk=5,
        stagger=3,
        shuffle_blocks=True,
    )
    assert_matches(got, case.reference, ATOL)


def test_sliding_window_is_exercised(tmp_path: Path) -> None:
    """The Mistral case only proves the window if ignoring it would fail: it must change logits."""
    hf_model = make_hf_model("mistral_window")
    hf_model.save_pretrained(tmp_path)
    config = load_model_config(tmp_path)
    assert config.sliding_window == 8
    full = build_model(dataclasses.replace(config, sliding_window=None)).eval()
    full.load_weights(iter_checkpoint(tmp_path))
    got = generate_greedy(full, PROMPTS[-1:], 8)
    ref = hf_greedy(hf_model, PROMPTS[-1], 8)
    assert (got.logits[0] - ref.logits[0]).abs().max() > 100 * ATOL


def test_cpu_forward_runs_without_triton(tmp_path: Path) -> None:
    """The fused Triton layers serve CUDA tensors only: a CPU forward of each family (RMSNorm
    with q/k norms, LayerNorm and gelu_new) must run where triton cannot be imported, as on a
    CPU install. In a fresh interpreter whose ``import triton`` fails; the kernels' module
    failing to import there shows the block holds."""
    for name in ("qwen3_qk_norm", "gpt2"):
        make_hf_model(name).save_pretrained(tmp_path / name)
    script = (
        "import sys\n"
        "sys.modules['triton'] = None  # any `import triton` now raises ImportError\n"
        "import torch\n"
        "from engine_core.loader import load_model\n"
        "from tests.paged_harness import generate_greedy\n"
        "for name in ('qwen3_qk_norm', 'gpt2'):\n"
        f"    path = {str(tmp_path)!r} + '/' + name\n"
        "    model = load_model(path, torch.device('cpu'), torch.float32).module\n"
        "    print(name, generate_greedy(model, [[1, 2, 3]], 3).tokens[0])\n"
        "try:\n"
        "    import engine_core.attention.triton_kernels\n"
        "except ImportError:\n"
        "    print('blocked')\n"
    )
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["qwen3_qk_norm", "gpt2", "blocked"], lines


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    hf_model = make_hf_model("llama")
    hf_model.save_pretrained(tmp_path / "whole")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    whole = load_model(str(tmp_path / "whole"), torch.device("cpu"), torch.float32).module
    sharded = load_model(str(tmp_path / "sharded"), torch.device("cpu"), torch.float32).module
    for (name, a), (_, b) in zip(
        whole.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    got = generate_greedy(sharded, PROMPTS[:1], NEW_TOKENS)
    assert got.tokens[0] == hf_greedy(hf_model, PROMPTS[0], NEW_TOKENS).tokens[0]
