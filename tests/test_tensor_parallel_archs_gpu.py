"""DeepSeek, gpt-oss (bf16 and MXFP4 experts) and Qwen3-Next at TP=2 on two CUDA GPUs (NCCL or
the peer all-reduce; the Triton MLA, MXFP4 and delta-rule kernels on each rank's heads and
expert shares; decode graphs), in float32, against HF transformers on the CPU: the tiny models
of tests/test_tensor_parallel_*.py, the same greedy tokens and logprobs within 1e-3."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from tests.paged_harness import random_prompts, randomize
from tests.test_models_deepseek import make_hf_model as deepseek_model
from tests.test_models_gpt_oss import make_hf_model as gpt_oss_model
from tests.test_models_gpt_oss import write_mxfp4_checkpoint
from tests.test_models_qwen3_next import VOCAB, tiny_config
from tests.tp_cases import engine_greedy, hf_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
NEW_TOKENS = 12
PROMPTS = random_prompts(VOCAB, (5, 11, 23, 40))


def qwen3_next_model() -> nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(num_hidden_layers=2)).eval()
    randomize(model, 0)
    return model


def saved(make: Callable[[], nn.Module], folder: Path) -> nn.Module:
    """``make``'s model saved to ``folder``; the model HF runs as the reference."""
    model = make()
    model.save_pretrained(folder)
    return model


WRITERS: dict[str, Callable[[Path], nn.Module]] = {
    "deepseek_v3": lambda folder: saved(lambda: deepseek_model("v3"), folder),
    "gpt_oss": lambda folder: saved(gpt_oss_model, folder),
    "gpt_oss_mxfp4": lambda folder: write_mxfp4_checkpoint(gpt_oss_model(), folder),
    "qwen3_next": lambda folder: saved(qwen3_next_model, folder),
}


@pytest.mark.parametrize("name", list(WRITERS))
def test_tp2_on_two_gpus_matches_hf(name: str, tmp_path: Path) -> None:
    reference = hf_reference(WRITERS[name](tmp_path), PROMPTS, NEW_TOKENS)
    tokens, logprobs = engine_greedy(
        tmp_path, PROMPTS, NEW_TOKENS, tp=2, device="cuda", dtype="float32", block_size=16
    )
    assert tokens == reference[0]
    torch.testing.assert_close(logprobs, reference[1], atol=1e-3, rtol=0)
