"""A PEFT LoRA folder read, checked against the base model, and laid out for our layers.

peft writes an adapter as ``adapter_config.json`` (its ``LoraConfig``) and
``adapter_model.safetensors`` with one ``lora_A`` [r, in] and one ``lora_B`` [out, r] per
target module, named from the base model's modules (``base_model.model.model.layers.0.
self_attn.q_proj.lora_A.weight``). The delta a target adds to its output is
``x @ A.T @ B.T * scale``, with scale ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), r and
alpha per module where ``rank_pattern`` / ``alpha_pattern`` say so, as peft computes them.

Everything else a config can say either changes nothing at inference (dropout, how the weights
were initialised, training-only settings) or changes the output in a way not implemented here
(DoRA, biases, modules_to_save, ...): those are refused by name, never ignored. The check is by
exclusion: a field peft adds in a later version is refused while it differs from its default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_core.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# HF projection name -> (our module in a decoder layer, its shard; None: the whole output).
# Phi-3 checkpoints fuse q/k/v and gate/up in HF too, so their adapters target the fused names.
TARGETS: dict[str, tuple[str, int | None]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "qkv_proj": ("self_attn.qkv_proj", None),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "gate_up_proj": ("mlp.gate_up_proj", None),
    "down_proj": ("mlp.down_proj", 0),
}

# Config fields read here, or that change nothing once the adapter is trained and saved; every
# other LoraConfig field must hold its default.
_READ_OR_INERT = frozenset(
    {
        "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
        "revision", "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha",
        "lora_dropout", "use_rslora", "layers_to_transform", "layers_pattern", "rank_pattern",
        "alpha_pattern", "init_lora_weights", "megatron_config", "megatron_core",
        "loftq_config", "eva_config", "corda_config", "lora_ga_config", "runtime_config",
        "ensure_weight_tying", "qalora_group_size", "target_parameters",
    }
)  # fmt: skip
# init_lora_weights values that only chose the starting A/B. The others (PiSSA, OLoRA, CorDA,
# LoftQ, LoRA-GA) also rewrote the base weights, which an adapter saved without converting
# them expects: it would run here on the original weights and give other output.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")

# The experts of an MoE layer, targeted as parameters (peft's target_parameters on transformers'
# stacked experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]): peft nests one
# wrapper per parameter, so the keys name the module (".experts", ".experts.base_layer"), not
# the parameter; the shapes tell the two apart.
_EXPERTS_KEY = re.compile(
    r"^base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.mlp\.experts"
    r"(?:\.base_layer)*)\.lora_(?P<which>[AB])\.weight$"
)
EXPERTS = "mlp.experts"  # our module for a layer's expert LoRA (engine_core/lora/layers.py)
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")  # shard 0, 1

_KEY = re.compile(
    r"^base_model\.model\.(?P<module>model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
    r"(?P<proj>\w+))\.lora_(?P<which>[AB])\.weight$"
)


class LoraError(ValueError):
    """An adapter that cannot be served, with a message that names what is wrong."""


@dataclass(frozen=True)
class TargetShape:
    """One projection of a decoder layer that LoRA can target: its input width and its
    shards' output widths (q, k, v or gate, up; one shard for o_proj and down_proj). For an MoE
    layer's experts (``num_experts`` > 0): shard 0 is every expert's gate_up [2I, H], shard 1
    its down [H, I]; ``in_features`` is H."""

    in_features: int
    output_sizes: tuple[int, ...]
    num_experts: int = 0
    row_parallel: bool = False  # tensor parallelism cuts its input (o_proj, down_proj)


@dataclass(frozen=True)
class LoraWeights:
    """One target's matrices: ``a`` [r, in] and ``b`` [out, r] with the scale folded in, for
    shard ``shard`` of our module (None: its whole output); for experts, one pair per expert:
    ``a`` [E, r, in], ``b`` [E, out, r]."""

    a: torch.Tensor
    b: torch.Tensor
    shard: int | None

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


@dataclass
class LoraAdapter:
    """An adapter in host memory, laid out for our layers: (layer, our module) -> its parts."""

    path: str
    weights: dict[tuple[int, str], list[LoraWeights]]

    @property
    def num_bytes(self) -> int:
        parts = [w for ws in self.weights.values() for w in ws]
        return sum(t.numel() * t.element_size() for w in parts for t in (w.a, w.b))


def target_shapes(config: ModelConfig) -> dict[tuple[int, str], TargetShape]:
    """Every (layer, module) of the model that LoRA can target, with its shapes: attention, and
    a dense MLP's projections or an MoE layer's experts."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {}
    for layer in range(config.num_layers):
        shapes[layer, "self_attn.qkv_proj"] = TargetShape(hidden, (q, kv, kv))
        shapes[layer, "self_attn.o_proj"] = TargetShape(q, (hidden,), row_parallel=True)
        if not config.is_moe_layer(layer):
            shapes[layer, "mlp.gate_up_proj"] = TargetShape(hidden, (inter, inter))
            shapes[layer, "mlp.down_proj"] = TargetShape(inter, (hidden,), row_parallel=True)
        elif config.moe_router == "softmax":  # Mixtral's and Qwen3-MoE's stacked SwiGLU experts
            width = config.moe_intermediate_size
            shapes[layer, EXPERTS] = TargetShape(hidden, (2 * width, hidden), config.num_experts)
    return shapes


def rank_shape(shape: TargetShape, tp_size: int) -> TargetShape:
    """One of ``tp_size`` ranks' part of a projection: 1/size of its input (row-parallel) or of
    each shard's output rows (column-parallel), as models/layers.py cuts the base weight."""
    if tp_size == 1:
        return shape
    if shape.row_parallel:
        return dataclasses.replace(shape, in_features=shape.in_features // tp_size)
    return dataclasses.replace(
        shape, output_sizes=tuple(size // tp_size for size in shape.output_sizes)
    )


def slot_bytes(
    shapes: dict[tuple[int, str], TargetShape],
    num_slots: int,
    max_rank: int,
    dtype: torch.dtype,
    tp_size: int = 1,
) -> int:
    """The bytes ``install_lora`` allocates on one of ``tp_size`` ranks (LoraLinear's A and B,
    LoraExperts' four matrices): the memory plan counts them before any exists."""
    per_slot = 0
    for shape in shapes.values():
        if shape.num_experts:
            hidden, gate_up = shape.in_features, shape.output_sizes[0] // tp_size
            per_slot += shape.num_experts * max_rank * (2 * hidden + gate_up + gate_up // 2)
        else:
            local = rank_shape(shape, tp_size)
            width = len(shape.output_sizes) * max_rank
            per_slot += width * (local.in_features + sum(local.output_sizes))
    return num_slots * per_slot * dtype.itemsize


def check_lora_model(config: ModelConfig) -> None:
    """ValueError where the model's family has no LoRA targets here."""
    if config.architecture != "llama":
        raise ValueError(
            f"--enable-lora: LoRA is implemented for the Llama family (Llama, Mistral, Qwen2/3, "
            f"Qwen3-MoE attention, Phi-3), not for {config.architecture} models"
        )


def load_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT folder ``path`` against the model; LoraError naming the problem
    (a missing file, a refused config field, a rank over ``max_rank``, a target the model
    lacks, a tensor of the wrong shape)."""
    folder = Path(path)
    lora_config = read_config(folder)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoraError(_missing_weights(folder))
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as exc:
        raise LoraError(f"{weights_file}: not a readable safetensors file ({exc})") from None
    weights = lay_out(tensors, lora_config, config, max_rank, folder)
    return LoraAdapter(str(folder), weights)


def _missing_weights(folder: Path) -> str:
    if (folder / "adapter_model.bin").is_file():
        return (
            f"{folder}: only adapter_model.bin (a pickle) is there; adapters are read from "
            f"{WEIGHTS_FILE} only (peft's save_pretrained writes it by default)"
        )
    return f"{folder}: no {WEIGHTS_FILE}"


def read_config(folder: Path) -> Any:
    """The folder's LoraConfig as peft reads it, after refusing every field whose value would
    change the output in a way not implemented here."""
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraError(f"{folder}: no such adapter folder")
    if not file.is_file():
        raise LoraError(f"{folder}: no {CONFIG_FILE}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise LoraError(f"{file}: not a JSON object")
    if raw.get("peft_type") != "LORA":
        raise LoraError(f"{file}: peft_type {raw.get('peft_type')!r}; only LORA adapters serve")
    from peft import LoraConfig

    check_fields(raw, LoraConfig, file)
    try:
        return LoraConfig.from_pretrained(str(folder))
    except (TypeError, ValueError) as exc:
        raise LoraError(f"{file}: peft refuses it: {exc}") from None


def check_fields(raw: dict[str, Any], config_class: type, file: Path) -> None:
    """LoraError for a field peft does not know, or one that would change the output."""
    defaults = {f.name: _default(f) for f in dataclasses.fields(config_class)}
    for name, value in raw.items():
        if name not in defaults and (value is None or value is False):
            continue  # an older peft's field, off (enable_lora: null, merge_weights: false)
        if name not in defaults:
            raise LoraError(f"{file}: field {name!r} is unknown to the installed peft")
        if name == "init_lora_weights" and value not in _PLAIN_INITS:
            raise LoraError(
                f"{file}: init_lora_weights {value!r} rewrote the base model's weights, which "
                "this adapter expects; convert it to a plain LoRA adapter first (peft's "
                "path_initial_model_for_weight_conversion)"
            )
        if name not in _READ_OR_INERT and not _same(value, defaults[name]):
            raise LoraError(f"{file}: {name} = {value!r} is not supported ({_WHY.get(name, '')})")


_WHY = {
    "use_dora": "DoRA's magnitude vectors are not implemented",
    "bias": "LoRA biases are not implemented: only 'none'",
    "lora_bias": "a bias on lora_B is not implemented",
    "modules_to_save": "whole modules saved beside the adapter are not served",
    "fan_in_fan_out": "transposed (Conv1D) targets are not implemented",
    "trainable_token_indices": "trained embedding rows are not served",
    "layer_replication": "replicated layers change the base model",
    "alora_invocation_tokens": "activated LoRA is not implemented",
    "use_qalora": "QA-LoRA is not implemented",
}


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _same(value: Any, default: Any) -> bool:
    """A value that says what the default says (an empty list or dict where it is None)."""
    return value == default or (not value and not default and value is not False)


def lay_out(
    tensors: dict[str, torch.Tensor],
    lora_config: Any,
    config: ModelConfig,
    max_rank: int,
    folder: Path,
) -> dict[tuple[int, str], list[LoraWeights]]:
    """The adapter's A/B pairs by (layer, our module), checked and scaled."""
    check_target_names(lora_config.target_modules, folder)
    check_target_parameters(lora_config.target_parameters, folder)
    experts = {k: t for k, t in tensors.items() if _EXPERTS_KEY.match(k)}
    pairs = pair_tensors({k: t for k, t in tensors.items() if k not in experts}, folder)
    shapes = target_shapes(config)
    weights = lay_out_experts(experts, lora_config, shapes, max_rank, folder)
    for module_name, (a, b) in sorted(pairs.items()):
        match = _KEY.match(f"base_model.model.{module_name}.lora_A.weight")
        assert match is not None
        layer, proj = int(match["layer"]), match["proj"]
        ours, shard = TARGETS[proj]
        shape = shapes.get((layer, ours))
        if shape is None:
            raise LoraError(f"{folder}: targets {module_name}, which the model does not have")
        rows = sum(shape.output_sizes) if shard is None else shape.output_sizes[shard]
        check_pair(module_name, a, b, shape.in_features, rows, max_rank, folder)
        scale = lora_scale(lora_config, module_name, a.shape[0], folder)
        scaled = LoraWeights(a.float(), b.float() * scale, shard)
        weights.setdefault((layer, ours), []).append(scaled)
    if not weights:
        raise LoraError(f"{folder}: {WEIGHTS_FILE} holds no LoRA weights")
    return weights


def check_target_parameters(targets: Any, folder: Path) -> None:
    """target_parameters may name only the MoE experts' stacked gate_up and down projections."""
    for name in sorted(targets or []):
        if not name.endswith(EXPERT_PARAMETERS):
            raise LoraError(
                f"{folder}: target parameter {name!r} is not one LoRA can target in this model "
                f"(it targets the experts' {' and '.join(EXPERT_PARAMETERS)})"
            )


def lay_out_experts(
    tensors: dict[str, torch.Tensor],
    lora_config: Any,
    shapes: dict[tuple[int, str], TargetShape],
    max_rank: int,
    folder: Path,
) -> dict[tuple[int, str], list[LoraWeights]]:
    """The experts' LoRA pairs by layer: peft's A [r*E, in] and B [out, r*E] as per-expert
    A [E, r, in] and B [E, out, r] (expert e's rank rows of A, its columns of B, interleaved as
    peft's ParamWrapper reshapes them), scaled, shard 0 for gate_up and 1 for down."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _EXPERTS_KEY.match(key)
        assert match is not None
        modules.setdefault(match["module"], {})[match["which"]] = tensor
    weights: dict[tuple[int, str], list[LoraWeights]] = {}
    for module, half in sorted(modules.items()):
        layer = int(module.split(".")[2])
        shape = shapes.get((layer, EXPERTS))
        if shape is None:
            raise LoraError(f"{folder}: targets {module}, which the model does not have")
        if set(half) != {"A", "B"}:
            raise LoraError(f"{folder}: {module} has only lora_{''.join(half)}")
        part = expert_pair(module, half["A"], half["B"], shape, max_rank, folder)
        shards = [p.shard for p in weights.get((layer, EXPERTS), [])]
        if part.shard in shards:
            raise LoraError(f"{folder}: {module}: two LoRA pairs for one expert projection")
        scale = lora_scale(lora_config, module, part.rank, folder)
        scaled = LoraWeights(part.a.float(), part.b.float() * scale, part.shard)
        weights.setdefault((layer, EXPERTS), []).append(scaled)
    return weights


def expert_pair(
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    shape: TargetShape,
    max_rank: int,
    folder: Path,
) -> LoraWeights:
    """One stacked expert projection's pair, unscaled: which of gate_up [2I, H] and down
    [H, I] it fits is read from the shapes (A's input width and B's output width differ
    between the two for every model)."""
    experts, hidden = shape.num_experts, shape.in_features
    gate_up, down = (shape.output_sizes[0], hidden), (hidden, shape.output_sizes[0] // 2)
    fits = [
        shard
        for shard, (out, inp) in enumerate((gate_up, down))
        if a.dim() == b.dim() == 2 and a.shape[1] == inp and b.shape[0] == out
    ]
    total = a.shape[0] if a.dim() == 2 else -1
    if len(fits) != 1 or total % experts or b.shape[1] != total:
        raise LoraError(
            f"{folder}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit neither "
            f"the experts' gate_up {gate_up} nor their down {down} ({experts} experts, A "
            "[r * experts, in], B [out, r * experts])"
        )
    rank = total // experts
    if rank > max_rank:
        raise LoraError(f"{folder}: {module} has rank {rank}, over --max-lora-rank {max_rank}")
    per_a = a.reshape(experts, rank, a.shape[1])  # [E, r, in]
    per_b = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1)  # [E, out, r]
    return LoraWeights(per_a, per_b.contiguous(), fits[0])


def check_target_names(targets: Any, folder: Path) -> None:
    """A target_modules list may name only projections we can target (by their last part)."""
    if targets is None or isinstance(targets, str):
        return  # a regular expression or "all-linear": the tensors say what it matched
    for name in sorted(targets):
        if name.rsplit(".", 1)[-1] not in TARGETS:
            raise LoraError(
                f"{folder}: target module {name!r} is not one LoRA can target in this model "
                f"(it targets {', '.join(TARGETS)})"
            )


def pair_tensors(
    tensors: dict[str, torch.Tensor], folder: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each target module's (A, B), by its HF module name; LoraError for a tensor that is not
    a LoRA matrix of a projection we can target, or a module with only one of the two."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match["proj"] not in TARGETS:
            raise LoraError(
                f"{folder}: {key} is not a LoRA matrix of a projection this model's LoRA can "
                f"target ({', '.join(TARGETS)} in a decoder layer)"
            )
        halves.setdefault(match["module"], {})[match["which"]] = tensor
    pairs = {}
    for module, half in halves.items():
        if set(half) != {"A", "B"}:
            missing = "lora_B" if "A" in half else "lora_A"
            raise LoraError(f"{folder}: {module} has no {missing}")
        pairs[module] = (half["A"], half["B"])
    return pairs


def check_pair(
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    in_features: int,
    rows: int,
    max_rank: int,
    folder: Path,
) -> None:
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (rows, rank):
        raise LoraError(
            f"{folder}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
            f"the model's projection ({in_features} in, {rows} out: A [r, {in_features}], "
            f"B [{rows}, r])"
        )
    if rank > max_rank:
        raise LoraError(f"{folder}: {module} has rank {rank}, over --max-lora-rank {max_rank}")
    if not a.is_floating_point() or not b.is_floating_point():
        raise LoraError(f"{folder}: {module}: LoRA matrices must be floating point")


def lora_scale(lora_config: Any, module: str, rank: int, folder: Path) -> float:
    """peft's scale for ``module``: alpha / r, or alpha / sqrt(r) with rsLoRA, where r and alpha
    come from rank_pattern / alpha_pattern when a key matches, as peft's LoraModel reads them."""
    from peft.utils.other import get_pattern_key

    rank_key = get_pattern_key(lora_config.rank_pattern.keys(), module)
    alpha_key = get_pattern_key(lora_config.alpha_pattern.keys(), module)
    r = lora_config.rank_pattern.get(rank_key, lora_config.r)
    alpha = lora_config.alpha_pattern.get(alpha_key, lora_config.lora_alpha)
    if r != rank:
        raise LoraError(f"{folder}: {module} has rank {rank} but its config says r = {r}")
    return alpha / math.sqrt(r) if lora_config.use_rslora else alpha / r
