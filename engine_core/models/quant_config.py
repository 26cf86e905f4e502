"""Which weight format a checkpoint's config.json declares, read into one typed config per
scheme, and the ``--quantization`` flag merged in.

``quantization_config`` (also ``compression_config``, or a ``quantize_config.json`` beside
config.json, as older AutoGPTQ and AutoAWQ checkpoints keep it) is read by ``quant_method``:

- ``"fp8"``, and compressed-tensors schemes with FP8 weights: ``Fp8Config``
  (engine_core/models/fp8_config.py).
- ``"awq"`` (AutoAWQ's GEMM layout, zero points) and ``"gptq"`` (AutoGPTQ / GPTQModel: 4 bits,
  symmetric or not, act-order with its ``g_idx``, the original zero-minus-one or the v2 zero
  points), each also under vLLM's ``awq_marlin`` / ``gptq_marlin`` names: ``W4A16Config``.
- ``"auto-round"`` (Intel's AutoRound): 4-bit weights packed in GPTQ's layout (either zero-point
  convention, by ``packing_format``) or AWQ's, layers its ``extra_config`` keeps in 16 bits
  left float: ``W4A16Config``.
- ``"compressed-tensors"`` (llm-compressor's output): ``pack-quantized`` 4-bit weights without
  activation quantization (``W4A16Config``); ``int-quantized`` 8-bit weights with int8
  activations quantized per token at run time (``Int8Config``). The compressed-tensors package
  parses the config and fills its defaults, so we read what its authors meant.

A field that would change the output and that we do not implement is refused at start-up with a
ValueError naming it; never a silent float fallback. Fields that only record how the checkpoint
was made (calibration settings, the tool's version) are not read.
"""

from __future__ import annotations

import os
import re
from typing import Any

from engine_core.config import Fp8Config, Int8Config, ModelConfig, QuantConfig, W4A16Config
from engine_core.models.fp8_config import (
    ct_fp8_config,
    ct_kv_scales,
    fp8_method_config,
    ignore_pattern,
    strategy_of,
)

READABLE_METHODS = (
    "compressed-tensors", "fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "auto-round",
)  # fmt: skip
# --quantization values that name a checkpoint format -> the W4A16/INT8/FP8 source it must have.
FLAG_SOURCES = {
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "compressed-tensors": "compressed-tensors",
    "auto-round": "auto-round",
}
# The linear projections of a Llama-family decoder layer, as GPTQ's modules_in_block_to_quantize
# names them: a checkpoint that quantizes fewer of them is refused.
BLOCK_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# The ignore list's entry for a shared expert's gate, as llm-compressor's Qwen3-Next recipe has it.
SHARED_EXPERT_GATE = (ignore_pattern("re:.*mlp.shared_expert_gate$", substring=False),)


def quant_config_from_hf(hf: dict[str, Any]) -> QuantConfig | None:
    """The weight format that config.json's ``quantization_config`` declares (None: none)."""
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return compressed_tensors_config(qc)
    if method == "fp8":
        return fp8_method_config(qc)
    if method in ("awq", "awq_marlin"):
        return awq_config(qc)
    if method in ("gptq", "gptq_marlin"):
        return gptq_config(qc)
    if method == "auto-round":
        return auto_round_config(qc)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not a format Tandem reads; it reads "
        f"{', '.join(map(repr, READABLE_METHODS))}"
    )


def with_quantization_flag(config: QuantConfig | None, flag: str | None) -> QuantConfig | None:
    """Merge ``--quantization``: 'fp8' and 'w8a8' quantize a plain checkpoint as it loads (on an
    FP8 checkpoint 'fp8' changes nothing); a format's name must agree with the checkpoint's."""
    if flag is None:
        return config
    if flag in ("fp8", "w8a8") and config is None:
        if flag == "w8a8":
            return Int8Config(prequantized=False, source="--quantization w8a8")
        return Fp8Config(weight_scales="channel", dynamic_activations=True, prequantized=False)
    if (flag, type(config)) in (("fp8", Fp8Config), ("w8a8", Int8Config)):
        return config
    expected = FLAG_SOURCES.get(flag)
    if expected is not None and config is not None and config_source(config) == expected:
        return config
    if flag not in (*FLAG_SOURCES, "fp8", "w8a8"):
        raise ValueError(f"--quantization {flag!r} is not supported")
    found = "no quantization_config" if config is None else f"a {config_source(config)} one"
    raise ValueError(
        f"--quantization {flag} does not match the checkpoint, which has {found}; leave the "
        "flag out to serve the checkpoint as its config.json says"
    )


def random_weights_config(flag: str | None, model: ModelConfig) -> QuantConfig | None:
    """The format a random preset's linears take under ``--quantization`` (there is no
    checkpoint to read one from): 'fp8' and 'w8a8' as a plain checkpoint loads under them; a
    4-bit format's name (compressed-tensors: its W4A16 scheme), that layout with 128-column
    groups, or 64 or 32 where 128 does not divide every input (smollm2's 576; an expert's width
    too), AWQ and GPTQ with zero points, as they store them. A shared expert's gate (Qwen3-Next)
    stays float, as llm-compressor's recipe lists it (models/quantize.py refuses it 4-bit)."""
    if flag is None or flag in ("fp8", "w8a8"):
        return with_quantization_flag(None, flag)
    source, origin = FLAG_SOURCES[flag], ""
    if source == "auto-round":  # its default packing is GPTQ's
        source, origin = "gptq", "auto-round"
    inputs = (model.hidden_size, model.intermediate_size, model.num_heads * model.head_dim)
    inputs += (model.moe_intermediate_size,) if model.num_experts else ()
    group = next(size for size in (128, 64, 32, 8) if not any(k % size for k in inputs))
    ignore = SHARED_EXPERT_GATE if model.shared_expert_intermediate_size else ()
    zero_points = source != "compressed-tensors"
    return W4A16Config(
        source=source, group_size=group, zero_points=zero_points, ignore=ignore, origin=origin
    )


def config_source(config: QuantConfig) -> str:
    """The checkpoint format a config was read from ("fp8", "awq", "auto-round", ...)."""
    if isinstance(config, W4A16Config) and config.origin:
        return config.origin
    return config.source


# ---- compressed-tensors -------------------------------------------------------------------------


def compressed_tensors_config(qc: dict[str, Any]) -> QuantConfig:
    """Fp8Config, W4A16Config or Int8Config, by the weights of the config's one scheme."""
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    where = "quantization_config (compressed-tensors)"
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise ValueError(f"{where}.{field} is not supported (it changes how weights are read)")
    try:
        parsed = QuantizationConfig.model_validate(qc)
    except ValidationError as exc:
        raise ValueError(f"{where} is malformed: {exc.errors()[0]['msg']}") from None
    scheme = one_scheme(parsed, where)
    weights = scheme.weights
    if weights is None:
        raise ValueError(f"{where}.weights is missing")
    if weights.type == "float":
        return ct_fp8_config(parsed, scheme, where)
    if weights.type == "int" and weights.num_bits == 4:
        return ct_w4a16_config(parsed, scheme, where)
    if weights.type == "int" and weights.num_bits == 8:
        return ct_int8_config(parsed, scheme, where)
    raise ValueError(
        f"{where}.weights: {weights.num_bits}-bit {weights.type} weights are not supported (FP8, "
        "4-bit int with 16-bit activations, 8-bit int with 8-bit activations are)"
    )


def one_scheme(parsed: Any, where: str) -> Any:
    """The config's only quantization scheme, targeting every Linear, quantizing no outputs."""
    schemes = list(parsed.config_groups.values())
    if len(schemes) != 1:
        raise ValueError(f"{where} has {len(schemes)} config_groups; Tandem reads one")
    scheme = schemes[0]
    if list(scheme.targets) != ["Linear"]:
        raise ValueError(f"{where} targets {scheme.targets}; Tandem reads ['Linear'] only")
    if scheme.output_activations is not None:
        raise ValueError(f"{where}: output_activations quantization is not supported")
    return scheme


def ct_format(parsed: Any, scheme: Any) -> str | None:
    """The compression format of the scheme (its own, or the config's)."""
    return str(getattr(scheme, "format", None) or parsed.format or "") or None


def ct_ignore(parsed: Any) -> tuple[str, ...]:
    return tuple(ignore_pattern(entry, substring=False) for entry in parsed.ignore or ())


def ct_w4a16_config(parsed: Any, scheme: Any, where: str) -> W4A16Config:
    """pack-quantized 4-bit int weights (symmetric, or with packed zero points), per group or per
    channel, activations left in 16 bits."""
    fmt = ct_format(parsed, scheme)
    if fmt != "pack-quantized":
        raise ValueError(f"{where}.format {fmt!r}: 4-bit weights are read as 'pack-quantized'")
    if scheme.input_activations is not None:
        raise ValueError(
            f"{where}.input_activations: 4-bit weights with quantized activations are not "
            "supported (W4A16 only)"
        )
    weights = scheme.weights
    if weights.dynamic:
        raise ValueError(f"{where}.weights.dynamic: dynamic weight scales are not supported")
    strategy = strategy_of(weights)
    if strategy == "group":
        group_size = int(weights.group_size)
    elif strategy == "channel":
        group_size = -1
    else:
        raise ValueError(f"{where}.weights.strategy {strategy!r} is not 'group' or 'channel'")
    actorder = str(getattr(weights.actorder, "value", weights.actorder) or "")
    return W4A16Config(
        source="compressed-tensors",
        group_size=group_size,
        zero_points=not weights.symmetric,
        # "weight" (alias "static") orders only the calibration, not the stored layout; "group"
        # (alias "dynamic") stores weight_g_idx, which maps columns to groups.
        act_order=actorder in ("group", "dynamic"),
        ignore=ct_ignore(parsed),
        kv_scales=ct_kv_scales(parsed.kv_cache_scheme, where),
    )


def ct_int8_config(parsed: Any, scheme: Any, where: str) -> Int8Config:
    """int-quantized 8-bit symmetric weights, per channel or per tensor; int8 activations,
    symmetric and dynamic per token."""
    fmt = ct_format(parsed, scheme)
    if fmt not in ("int-quantized", "naive-quantized"):
        raise ValueError(f"{where}.format {fmt!r}: 8-bit int weights are read as 'int-quantized'")
    weights = scheme.weights
    if not weights.symmetric:
        raise ValueError(f"{where}.weights.symmetric: asymmetric int8 weights are not supported")
    if weights.dynamic or strategy_of(weights) not in ("channel", "tensor"):
        raise ValueError(
            f"{where}.weights.strategy {strategy_of(weights)!r} (dynamic={weights.dynamic}): "
            "int8 weights are read with static per-channel or per-tensor scales"
        )
    acts = scheme.input_activations
    if acts is None:
        raise ValueError(f"{where}.input_activations: weight-only int8 (W8A16) is not supported")
    if acts.type != "int" or acts.num_bits != 8:
        raise ValueError(f"{where}.input_activations: {acts.num_bits}-bit {acts.type} with int8 "
                         "weights is not supported (int8 activations are)")  # fmt: skip
    if not acts.symmetric:
        raise ValueError(f"{where}.input_activations.symmetric: asymmetric int8 activations "
                         "are not supported")  # fmt: skip
    if not acts.dynamic or strategy_of(acts) != "token":
        raise ValueError(
            f"{where}.input_activations.strategy {strategy_of(acts)!r} (dynamic={acts.dynamic}): "
            "int8 activations are read as dynamic per token"
        )
    return Int8Config(
        source="compressed-tensors",
        ignore=ct_ignore(parsed),
        kv_scales=ct_kv_scales(parsed.kv_cache_scheme, where),
    )


# ---- AWQ and GPTQ -------------------------------------------------------------------------------


def four_bits(qc: dict[str, Any], where: str) -> None:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}.bits {bits!r} is not supported; Tandem reads 4-bit weights")


def group_size_of(qc: dict[str, Any], where: str) -> int:
    """``group_size`` (``q_group_size`` in older AutoAWQ files): -1 or a positive size."""
    size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(size, int) or isinstance(size, bool) or (size != -1 and size < 8):
        raise ValueError(f"{where}.group_size {size!r} is not -1 or a size of 8 or more")
    return size


def awq_config(qc: dict[str, Any]) -> W4A16Config:
    """AutoAWQ's GEMM layout: qweight [K, N/8] and qzeros [G, N/8] int32 in AWQ's interleaved
    nibble order, scales [G, N] fp16; a weight is (q - zero) * scale."""
    where = f"quantization_config ({qc.get('quant_method')})"
    four_bits(qc, where)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"{where}.version {qc.get('version')!r} is not supported; Tandem reads AWQ's 'gemm' "
            "layout"
        )
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{where}.zero_point {qc['zero_point']!r}: AWQ without zero points is "
                         "not supported")  # fmt: skip
    ignore = qc.get("modules_to_not_convert") or ()
    return W4A16Config(
        source="awq",
        group_size=group_size_of(qc, where),
        zero_points=True,
        # transformers skips every module whose name contains an entry.
        ignore=tuple(ignore_pattern(entry, substring=True) for entry in ignore),
    )


def gptq_config(qc: dict[str, Any]) -> W4A16Config:
    """AutoGPTQ / GPTQModel: qweight [K/8, N] and qzeros [G, N/8] int32, nibbles in order,
    scales [G, N] fp16, g_idx [K] (the group of each input column); a weight is
    (q - zero) * scale, where the original format ("gptq") stores zero - 1 and "gptq_v2" the
    zero itself."""
    where = f"quantization_config ({qc.get('quant_method')})"
    four_bits(qc, where)
    refuse_gptq_extras(qc, where)
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"{where}.checkpoint_format {fmt!r} is not supported; Tandem reads 'gptq' and 'gptq_v2'"
        )
    desc_act = qc.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise ValueError(f"{where}.desc_act {desc_act!r} is not true or false")
    return W4A16Config(
        source="gptq",
        group_size=group_size_of(qc, where),
        zero_points=True,  # stored for symmetric checkpoints too (all 8); read as stored
        act_order=desc_act,
        zero_offset=1 if fmt == "gptq" else 0,
    )


def refuse_gptq_extras(qc: dict[str, Any], where: str) -> None:
    """GPTQ fields that would change the output, unless they have the value that does not."""
    if qc.get("is_marlin_format"):
        raise ValueError(f"{where}.is_marlin_format: Marlin-serialized GPTQ is not supported")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ValueError(f"{where}.pack_dtype {qc['pack_dtype']!r} is not supported (int32 is)")
    if qc.get("lm_head"):
        raise ValueError(f"{where}.lm_head: a quantized LM head is not supported")
    for field in ("dynamic", "adapter", "rotation"):
        if qc.get(field):
            raise ValueError(f"{where}.{field} is not supported (it changes the weights' meaning)")
    blocks = qc.get("modules_in_block_to_quantize")
    if blocks:
        names = {name.rpartition(".")[2] for group in blocks for name in group}
        if not names >= BLOCK_LINEARS:
            raise ValueError(
                f"{where}.modules_in_block_to_quantize leaves "
                f"{sorted(BLOCK_LINEARS - names)} unquantized; Tandem quantizes all or none"
            )


# ---- AutoRound ----------------------------------------------------------------------------------

# AutoRound's packing_format -> (the layout it writes, what to add to a stored zero point), as
# its own reader sorts them (auto_round/inference/backend.py: GPTQ_FORMAT "zp+-1",
# GPTQ_FORMAT_NO_ZP, AWQ_FORMAT) and its packers write them (auto_round_extension/torch/
# qlinear_torch_zp.py stores zero - 1, qlinear_torch.py the zero; export_to_awq's WQLinear_GEMM).
AUTO_ROUND_PACKINGS = {
    "auto_round:auto_gptq": ("gptq", 1),  # the default where packing_format is absent
    "auto_round": ("gptq", 0),  # its native format (what asymmetric exports get)
    "auto_round:gptqmodel": ("gptq", 0),  # also writes a g_idx, one group after another
    "auto_round:auto_awq": ("awq", 0),
}
# The marks by which AutoRound tells an extra_config key that is a pattern from a layer's name
# (auto_round/utils/common.py ``to_standard_regex``).
REGEX_MARKS = (".*", "^", "$", "|", "(", ")", "[", "]", "?", "+")


def auto_round_config(qc: dict[str, Any]) -> W4A16Config:
    """Intel AutoRound: 4-bit integer weights in GPTQ's or AWQ's layout (``packing_format``),
    the same for every decoder layer, activations in 16 bits; ``extra_config`` may keep layers
    in 16 bits (they stay float) and nothing else."""
    where = "quantization_config (auto-round)"
    four_bits(qc, where)
    refuse_auto_round_extras(qc, where)
    packing = qc.get("packing_format") or "auto_round:auto_gptq"
    if packing not in AUTO_ROUND_PACKINGS:
        raise ValueError(
            f"{where}.packing_format {packing!r} is not supported; Tandem reads "
            f"{', '.join(map(repr, AUTO_ROUND_PACKINGS))}"
        )
    layout, zero_offset = AUTO_ROUND_PACKINGS[packing]
    return W4A16Config(
        source=layout,
        group_size=group_size_of(qc, where),
        zero_points=True,  # every packing stores them, symmetric ones too (8, or 7 for zero - 1)
        zero_offset=zero_offset,
        ignore=auto_round_ignore(qc, where),
        origin="auto-round",
    )


def refuse_auto_round_extras(qc: dict[str, Any], where: str) -> None:
    """AutoRound fields that would change the output, unless they have the value that does not."""
    data_type = qc.get("data_type", "int")
    if data_type != "int":
        raise ValueError(f"{where}.data_type {data_type!r} is not supported (integer weights are)")
    act_bits = qc.get("act_bits", 16)
    if not isinstance(act_bits, int) or act_bits < 16:
        raise ValueError(
            f"{where}.act_bits {act_bits!r}: quantized activations are not supported (W4A16 only)"
        )
    for field in qc:
        if field.endswith("_config") and field != "extra_config" and qc[field]:
            raise ValueError(f"{where}.{field} is not supported (a rotation or transform of the "
                             "weights changes their meaning)")  # fmt: skip
    for block in block_names(qc.get("block_name_to_quantize", qc.get("to_quant_block_names"))):
        if block.rpartition(".")[2] != "layers":
            raise ValueError(
                f"{where}.block_name_to_quantize names {block!r}; Tandem quantizes the decoder "
                "layers only (a '...layers' list)"
            )


def block_names(blocks: str | list | None) -> list[str]:
    """``block_name_to_quantize`` as a list: comma-separated, a list, or per-block lists (which
    AutoRound writes as their common prefix)."""
    if not blocks:
        return []
    if isinstance(blocks, str):
        return [name.strip() for name in blocks.split(",")]
    return [os.path.commonprefix(b).rstrip(".") if isinstance(b, list) else b for b in blocks]


def auto_round_ignore(qc: dict[str, Any], where: str) -> tuple[str, ...]:
    """The layers ``extra_config`` keeps in 16 bits, as ignore patterns. Any other per-layer
    entry (another bit width, group size, symmetry; a quantized layer outside the decoder
    layers, such as the LM head) is refused naming the layer and the fields."""
    patterns = []
    for name, override in (qc.get("extra_config") or {}).items():
        if not isinstance(override, dict):
            raise ValueError(f"{where}.extra_config[{name!r}] {override!r} is not a mapping")
        bits = override.get("bits", qc.get("bits"))
        if isinstance(bits, int) and bits >= 16:
            patterns.append(extra_config_pattern(name, where))
            continue
        fields = [key for key, value in override.items() if value != qc.get(key)] or list(override)
        settings = ", ".join(f"{key}={override[key]!r}" for key in fields)
        raise ValueError(
            f"{where}.extra_config[{name!r}]: {settings} is not supported; Tandem reads entries "
            "that keep a layer in 16 bits (bits 16) and quantizes every other decoder linear alike"
        )
    return tuple(patterns)


def extra_config_pattern(name: str, where: str) -> str:
    """An extra_config key as a pattern over full module names: a layer's name matches itself;
    a key with a regular expression's marks is one, which AutoRound's reader searches for
    anywhere in a name (``re.search``)."""
    if not any(mark in name for mark in REGEX_MARKS):
        return re.escape(name)
    try:
        re.compile(name)
    except re.error as exc:
        raise ValueError(f"{where}.extra_config key {name!r} is not a pattern: {exc}") from None
    return f".*(?:{name}).*"
