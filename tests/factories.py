"""Factories for tests: tiny random Hugging Face checkpoints written to disk."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(source: Path, path: Path) -> Path:
    """The tokenizer files of the model folder ``source`` (the default model's, say) copied
    into the model folder ``path``, which then tokenizes as ``source`` does."""
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def write_tiny_llama(
    path: Path, *, vocab_size: int = 384, seed: int = 0, max_positions: int = 512
) -> Path:
    """A 2-layer random Llama with GQA, saved with save_pretrained (what users hand us)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-flat logits; scaling the head makes greedy choices well separated,
    # so float reordering between implementations cannot flip an argmax.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def write_near_copy(path: Path, of: Path, noise: float = 0.1) -> Path:
    """``of``'s weights, each tensor plus Gaussian noise of ``noise`` times its own spread: a
    draft that agrees with its target often, not always."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(of)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * noise * weight.std())
    model.save_pretrained(path)
    return path


def write_tiny_qwen3_moe(path: Path, *, vocab_size: int = 384, head_dim: int = 16) -> Path:
    """A 2-layer random Qwen3-MoE with GQA: 8 experts, 2 a token, top-k weights renormalised,
    its head scaled as write_tiny_llama's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def tiny_hf_sizes(vocab_size: int) -> dict[str, Any]:
    """Config fields of a 2-layer GQA model small enough to compare with HF in a second; no
    special token ids, so neither side stops early."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


# A chat template that thinks as Qwen3's thinking templates do (ChatML; written from Qwen3's
# published template, shortened): the assistant's turn opens a <think> block in the prompt, or,
# with enable_thinking false, closes an empty one; earlier turns render their reasoning_content;
# a reasoning_effort (gpt-oss's templates read one) goes into a system line.
THINKING_TEMPLATE = """\
{%- if reasoning_effort is defined %}
{{- '<|im_start|>system\nReasoning effort: ' + reasoning_effort + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['role'] == 'assistant' and message.get('reasoning_content') %}
{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message['content'] }}
{%- if not (loop.last and continue_final_message) %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}
{{- '<think>\\n' }}
{%- endif %}
{%- endif %}
"""


def write_thinking_model(path: Path, tokenizer_source: Path) -> Path:
    """A 2-layer random Qwen3 whose tokenizer (the default model's, with <think> and </think>
    added as single tokens, as Qwen3's has them) and chat template think."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


HARMONY_TOKENS = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
)  # fmt: skip
# A chat template in gpt-oss's harmony format (written from OpenAI's harmony guide, shortened):
# every message framed by <|start|>ROLE ... <|message|> ... <|end|>, tools in a developer message,
# the assistant's turn opened for the model to pick its channel (<|channel|>analysis or final).
HARMONY_TEMPLATE = """\
{#- the assistant writes <|channel|>analysis or <|channel|>final, then <|message|> -#}
{%- if tools %}<|start|>developer<|message|># Tools
{{ tools | tojson }}<|end|>{%- endif %}
{%- for message in messages %}<|start|>{{ message['role'] }}<|message|>
{{- message['content'] }}<|end|>
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"""


def write_harmony_model(path: Path, tokenizer_source: Path) -> Path:
    """A 2-layer random Llama whose tokenizer has gpt-oss's harmony markers as special tokens
    (<|return|> its end of turn) and whose template speaks harmony."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    tokenizer.add_special_tokens({"additional_special_tokens": list(HARMONY_TOKENS)})
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.eos_token = "<|return|>"
    tokenizer.save_pretrained(path)
    torch.manual_seed(1)
    end = tokenizer.convert_tokens_to_ids("<|return|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=end, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def write_tiny_embedding_model(
    path: Path,
    *,
    architecture: str = "qwen3",
    pooling: str = "lasttoken",
    normalize: bool = True,
    matryoshka: bool = False,
    vocab_size: int = 384,
    seed: int = 0,
) -> Path:
    """A 2-layer random decoder embedding model as sentence-transformers lays one out: a bare
    body (HF's ``Qwen3Model`` or ``LlamaModel``, no LM head) saved with save_pretrained, then
    modules.json, its Pooling config (``pooling_mode_<pooling>``) and a Normalize module where
    ``normalize``; ``matryoshka`` marks its config ``is_matryoshka`` (vLLM's name)."""
    import json

    from transformers import LlamaConfig, LlamaModel, Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    sizes = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    if architecture == "qwen3":
        model = Qwen3Model(Qwen3Config(**sizes, head_dim=16)).eval()
    else:
        model = LlamaModel(LlamaConfig(**sizes)).eval()
    if matryoshka:
        model.config.is_matryoshka = True
    model.save_pretrained(path)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")]
    kinds += [("2_Normalize", "Normalize")] if normalize else []
    modules = [
        {"idx": i, "name": str(i), "path": folder, "type": f"sentence_transformers.models.{kind}"}
        for i, (folder, kind) in enumerate(kinds)
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    modes = ("cls_token", "mean_tokens", "max_tokens", "lasttoken")
    config = {f"pooling_mode_{m}": m == pooling for m in modes}
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **config})
    )
    return path
