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
    path: Path,
    *,
    vocab_size: int = 384,
    seed: int = 0,
    max_positions: int = 512,
    num_layers: int = 2,
    head_dim: int | None = None,
) -> Path:
    """A random Llama with GQA (2 layers and heads of 16 unless told), saved with
    save_pretrained (what users hand us)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        head_dim=head_dim,
    )
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-flat logits; scaling the head makes greedy choices well separated,
    # so float reordering between implementations cannot flip an argmax.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


EAGLE3_HIDDEN, EAGLE3_HEADS, EAGLE3_KV_HEADS, EAGLE3_MLP = 64, 4, 2, 128


def eagle3_head_tensors(
    vocab_size: int, d2t: torch.Tensor, target_hidden: int = 64, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 head weights under the published names and shapes (as in
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): ``fc`` from three target hidden states, one
    ``midlayer`` whose q/k/v read [embedding, feature] (2 * H inputs), its ``hidden_norm``, the
    final ``norm``, an LM head over the draft vocabulary (scaled, so its argmax is well
    separated), ``d2t`` (draft id -> target id minus the draft id) and ``t2d`` (its inverse as
    a mask over the target's ids). No ``embed_tokens``: the head shares the target's."""
    generator = torch.Generator().manual_seed(seed)
    hidden, mlp = EAGLE3_HIDDEN, EAGLE3_MLP
    head_dim = hidden // EAGLE3_HEADS

    def randn(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    draft_vocab = d2t.shape[0]
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(draft_vocab) + d2t] = True
    layer = "midlayer."
    return {
        "fc.weight": randn(hidden, 3 * target_hidden),
        f"{layer}self_attn.q_proj.weight": randn(EAGLE3_HEADS * head_dim, 2 * hidden),
        f"{layer}self_attn.k_proj.weight": randn(EAGLE3_KV_HEADS * head_dim, 2 * hidden),
        f"{layer}self_attn.v_proj.weight": randn(EAGLE3_KV_HEADS * head_dim, 2 * hidden),
        f"{layer}self_attn.o_proj.weight": randn(hidden, EAGLE3_HEADS * head_dim),
        f"{layer}mlp.gate_proj.weight": randn(mlp, hidden),
        f"{layer}mlp.up_proj.weight": randn(mlp, hidden),
        f"{layer}mlp.down_proj.weight": randn(hidden, mlp),
        f"{layer}input_layernorm.weight": 1 + randn(hidden),
        f"{layer}hidden_norm.weight": 1 + randn(hidden),
        f"{layer}post_attention_layernorm.weight": 1 + randn(hidden),
        "norm.weight": 1 + randn(hidden),
        "lm_head.weight": randn(draft_vocab, hidden, std=1.0),
        "d2t": d2t.to(torch.int64),
        "t2d": t2d,
    }


def eagle3_head_config(vocab_size: int, draft_vocab: int, target_hidden: int = 64) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": EAGLE3_HIDDEN,
        "intermediate_size": EAGLE3_MLP,
        "num_attention_heads": EAGLE3_HEADS,
        "num_key_value_heads": EAGLE3_KV_HEADS,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def write_eagle3_head(
    path: Path,
    vocab_size: int,
    d2t: torch.Tensor,
    *,
    seed: int = 0,
    config: dict[str, Any] | None = None,
    tensors: dict[str, torch.Tensor | None] | None = None,
) -> Path:
    """A random EAGLE-3 head folder in the published layout (config.json and
    model.safetensors); ``config`` and ``tensors`` override fields and tensors (None drops
    one), for the tests of what loading refuses."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf = eagle3_head_config(vocab_size, d2t.shape[0]) | (config or {})
    weights: dict[str, torch.Tensor | None] = eagle3_head_tensors(vocab_size, d2t, seed=seed)
    weights |= tensors or {}
    (path / "config.json").write_text(json.dumps(hf))
    save_file(
        {k: v.contiguous() for k, v in weights.items() if v is not None},
        str(path / "model.safetensors"),
    )
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
