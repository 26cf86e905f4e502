"""The FP8 formats a checkpoint's config.json declares (engine_core/models/quant_config.py reads
``quantization_config`` and hands the FP8 ones here).

Two checkpoint formats are FP8:

- ``"quant_method": "compressed-tensors"`` (llm-compressor's output): FP8 weights with per-tensor
  or per-channel scales (``weight_scale``) and static (``input_scale``) or dynamic per-token
  activations, or 128 x 128 weight blocks with per-token-group activations; optionally FP8 KV
  scales (``kv_cache_scheme``; ``self_attn.k_scale`` / ``v_scale``). The compressed-tensors
  package validates the config and fills its defaults, so we read what its authors meant.
- ``"quant_method": "fp8"`` (transformers' FP8 format; DeepSeek-V3, Qwen3-FP8): block-wise
  weights (``weight_block_size``, scales in ``weight_scale_inv``) with dynamic per-token-group
  activations; or, without a block size, per-tensor weight scales.

A field we do not read the way its authors meant is refused, naming it: a format read wrongly
would serve garbage that looks like an answer.
"""

from __future__ import annotations

import re
from typing import Any

from engine_core.config import Fp8Config


def ct_fp8_config(parsed: Any, scheme: Any, where: str) -> Fp8Config:
    """The FP8 layout of a compressed-tensors config (``parsed``, compressed-tensors'
    QuantizationConfig) whose one scheme has FP8 weights."""
    if parsed.format not in ("float-quantized", "naive-quantized", None):
        raise ValueError(f"{where}.format {parsed.format!r} does not hold FP8 weights")
    weights = fp8_args(scheme.weights, f"{where}.weights")
    block = ct_weight_block(weights, where)
    dynamic = ct_activations_dynamic(scheme.input_activations, block, where)
    return Fp8Config(
        weight_scales="channel" if block is None else "block",
        dynamic_activations=dynamic,
        prequantized=True,
        block=block,
        source="compressed-tensors",
        ignore=tuple(ignore_pattern(entry, substring=False) for entry in parsed.ignore or ()),
        kv_scales=ct_kv_scales(parsed.kv_cache_scheme, where),
    )


def fp8_args(args: Any, where: str) -> Any:
    """``args`` (compressed-tensors QuantizationArgs) if it describes symmetric 8-bit floats."""
    if args is None:
        raise ValueError(f"{where} is missing")
    if args.type != "float" or args.num_bits != 8:
        raise ValueError(f"{where}: {args.num_bits}-bit {args.type} is not FP8; Tandem reads FP8")
    if not args.symmetric:
        raise ValueError(f"{where}: asymmetric (zero-point) FP8 is not supported")
    return args


def strategy_of(args: Any) -> str:
    """A QuantizationArgs' strategy as a string ("tensor" where it names none)."""
    return str(getattr(args.strategy, "value", args.strategy) or "tensor")


def ct_weight_block(weights: Any, where: str) -> tuple[int, int] | None:
    """None for per-tensor or per-channel weight scales, the block shape for block scales."""
    strategy = strategy_of(weights)
    if weights.dynamic:
        raise ValueError(f"{where}.weights: dynamic weight scales are not supported")
    if strategy in ("tensor", "channel"):
        return None
    if strategy == "block" and weights.block_structure and len(weights.block_structure) == 2:
        return int(weights.block_structure[0]), int(weights.block_structure[1])
    raise ValueError(f"{where}.weights.strategy {strategy!r} is not supported")


def ct_activations_dynamic(args: Any, block: tuple[int, int] | None, where: str) -> bool:
    """Whether activations are quantized at run time (True) or with the static input_scale."""
    if args is None:
        raise ValueError(
            f"{where}: weight-only FP8 (no input_activations) is not supported; "
            "Tandem runs FP8 weights with FP8 activations"
        )
    args = fp8_args(args, f"{where}.input_activations")
    strategy = strategy_of(args)
    if block is not None:
        if strategy == "group" and args.dynamic and args.group_size == block[1]:
            return True
        raise ValueError(
            f"{where}: block weights need dynamic per-group activations with group_size "
            f"{block[1]}, not {strategy!r} (dynamic={args.dynamic}, group_size={args.group_size})"
        )
    if strategy == "token" and args.dynamic:
        return True
    if strategy == "tensor" and not args.dynamic:
        return False
    raise ValueError(
        f"{where}.input_activations: strategy {strategy!r} with dynamic={args.dynamic} is not "
        "supported (dynamic per token, or a static per-tensor scale)"
    )


def ct_kv_scales(args: Any, where: str) -> bool:
    """Whether the checkpoint carries FP8 K/V scales (``kv_cache_scheme``)."""
    if args is None:
        return False
    args = fp8_args(args, f"{where}.kv_cache_scheme")
    strategy = strategy_of(args)
    if strategy != "tensor" or args.dynamic:
        raise ValueError(f"{where}.kv_cache_scheme: only static per-tensor K/V scales are read")
    return True


# ---- transformers' "fp8" ------------------------------------------------------------------------


def fp8_method_config(qc: dict[str, Any]) -> Fp8Config:
    """transformers' "fp8" format: block-wise (or per-tensor) e4m3 weights."""
    where = "quantization_config (fp8)"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}.fmt {qc['fmt']!r} is not supported; Tandem reads e4m3")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}.activation_scheme {scheme!r} is not 'dynamic' or 'static'")
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or scheme != "dynamic"):
        raise ValueError(
            f"{where}: weight_block_size {block} needs two sizes and dynamic activations"
        )
    ignore = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Config(
        weight_scales="channel" if block is None else "block",
        dynamic_activations=scheme == "dynamic",
        prequantized=True,
        block=None if block is None else (int(block[0]), int(block[1])),
        source="fp8",
        # transformers skips every module whose name contains an entry.
        ignore=tuple(ignore_pattern(entry, substring=True) for entry in ignore),
    )


def ignore_pattern(entry: str, substring: bool) -> str:
    """An ignore-list entry as a regular expression over full module names: compressed-tensors
    entries are names (a module or its last parts) or ``re:``-prefixed patterns; transformers'
    are substrings."""
    if entry.startswith("re:"):  # compressed-tensors matches these with re.match: a prefix
        return f"(?:{entry.removeprefix('re:')}).*"
    if substring:
        return f".*{re.escape(entry)}.*"
    return f"(.*\\.)?{re.escape(entry)}"


# The blocks the GPU's block-scaled FP8 GEMM (fp8_kernels.fp8_block_gemm) takes: a scale block's
# rows a multiple of 64 (an N tile sits inside one block), its columns one K step of 64 or 128.
# Here, importing nothing of the model code, so that fp8.py (at load) and the kernel share it.
BLOCK_GEMM_ROW_MULTIPLE = 64
BLOCK_GEMM_COLUMNS = (64, 128)


def block_gemm_takes(block: tuple[int, int]) -> bool:
    """Whether the GPU's block GEMM runs weights of ``block`` = (rows, columns) scale blocks."""
    rows, cols = block
    return rows % BLOCK_GEMM_ROW_MULTIPLE == 0 and cols in BLOCK_GEMM_COLUMNS
