"""Quantized checkpoints of tiny random Llamas, written in the layouts their tools publish, and the
references they are checked against (tests/test_w4a16.py, test_int8.py, test_fp8.py).

- compressed-tensors (W4A16, W4A16_ASYM, W8A8, FP8_DYNAMIC, ...): written by the
  compressed-tensors package itself: its preset scheme applied to the model, each weight's
  scales from its min and max (compressed-tensors' ``calculate_qparams``, what llm-compressor's
  data-free "memoryless_minmax" observer does), then its ``ModelCompressor`` packs the module
  tensors. Checked once against llm-compressor 0.14's ``oneshot`` on the same model (it pins
  its own torch and transformers, too heavy for CI): the tensors are identical.
- AWQ (AutoAWQ's GEMM layout) and GPTQ (AutoGPTQ / GPTQModel, both zero-point conventions,
  act-order): packed here, from a min-max quantizer, exactly as those tools lay them out:
  the names, dtypes, shapes and nibble orders of their ``pack`` functions, written independently
  of engine_core's code.

The references: HF transformers on the same checkpoint where it runs the format itself (the
compressed-tensors ones: it applies their activation quantization); else HF on a plain
checkpoint of the dequantized weights (``write_dequantized``), with the scheme's activation
quantization added by forward pre-hooks where the format has one (``quantize_inputs``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.paged_harness import GreedyResult, generate_greedy, hf_greedy, randomize

VOCAB = 256
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 128,  # compressed-tensors' W4A16 presets group 128 columns
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column 8j + AWQ_ORDER[i]
E4M3 = torch.float8_e4m3fn


def make_hf_model(seed: int = 0, **overrides: object) -> nn.Module:
    """A random float32 Llama of SIZES (and ``overrides``), its LM head scaled so greedy
    choices are well apart."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES | overrides)).eval()
    randomize(model, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def is_linear_weight(name: str) -> bool:
    module, _, param = name.rpartition(".")
    return param == "weight" and module.rpartition(".")[2] in LINEARS


def reference_run(folder: Path, prompts: list[list[int]], new_tokens: int) -> list[GreedyResult]:
    """HF transformers' greedy run of the checkpoint in ``folder`` (float32)."""
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(hf_model, prompt, new_tokens) for prompt in prompts]


def write_folder(folder: Path, like: Path, tensors: dict[str, torch.Tensor], qc: dict) -> Path:
    """A checkpoint folder: ``like``'s config.json with ``qc`` as its quantization_config."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((like / "config.json").read_text())
    config["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_dequantized(plain: Path, folder: Path, dequantized: dict[str, torch.Tensor]) -> Path:
    """A plain float32 checkpoint of ``plain`` with the given linears' weights replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    state = load_file(plain / "model.safetensors")
    state.update(dequantized)
    (folder / "config.json").write_text((plain / "config.json").read_text())
    save_file(state, str(folder / "model.safetensors"))
    return folder


# ---- activation quantization for the references ------------------------------------------------


def e4m3_per_token(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """x's per-token (per ``group`` columns, where given) e4m3 round trip, compressed-tensors'
    math: scale = absmax / 448, x / scale clamped and rounded to e4m3, times the scale."""
    parts = x.unflatten(-1, (-1, group)) if group else x
    scale = parts.abs().amax(-1, keepdim=True) / 448.0
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    out = torch.clamp(parts / scale, -448.0, 448.0).to(E4M3).to(x.dtype) * scale
    return out.flatten(-2) if group else out


def e4m3_static(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return torch.clamp(x / scale, -448.0, 448.0).to(E4M3).to(x.dtype) * scale

    return round_trip


def sliced(fn: Callable[[torch.Tensor], torch.Tensor], parts: int) -> Callable:
    """``fn`` applied to each of ``parts`` equal column slices of its input apart: what each
    tensor-parallel rank of a row-parallel layer does with its share of the input."""

    def each(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([fn(part) for part in x.chunk(parts, dim=-1)], dim=-1)

    return each


def quantize_inputs(
    hf_model: nn.Module,
    fn: Callable[[torch.Tensor], torch.Tensor],
    row_parallel: Callable[[torch.Tensor], torch.Tensor] | None = None,
    leaves: tuple[str, ...] = LINEARS,
) -> nn.Module:
    """Hooks that pass every decoder linear's input (those named ``leaves``) through ``fn``
    (o_proj's and down_proj's through ``row_parallel`` where given) before the linear sees it."""
    for name, module in hf_model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and leaf in leaves:
            hook = row_parallel if row_parallel and leaf in ("o_proj", "down_proj") else fn
            module.register_forward_pre_hook(lambda _m, args, f=hook: (f(args[0]),))
    return hf_model


def quantize_expert_inputs(hf_model: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace the forward of every stacked-experts module (transformers 5's ``*Experts``: 3-D
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]) with HF's own expert loop written
    out, each expert's gate/up input and down input passed through ``fn`` first: what the
    forward pre-hooks of ``quantize_inputs`` do for plain linears, where no hook can reach."""
    for module in hf_model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = partial(_experts_with_quantized_inputs, module, fn)


def _experts_with_quantized_inputs(
    experts: nn.Module,
    fn: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    out = torch.zeros_like(hidden_states)
    for expert in top_k_index.unique().tolist():
        token, slot = torch.where(top_k_index == expert)
        gate, up = F.linear(fn(hidden_states[token]), experts.gate_up_proj[expert]).chunk(2, -1)
        down = F.linear(fn(experts.act_fn(gate) * up), experts.down_proj[expert])
        out.index_add_(0, token, down * top_k_weights[token, slot, None])
    return out


def assert_matches_quantized(
    got: GreedyResult, reference: list[GreedyResult], atol: float = 1e-4, bound: float = 0.5
) -> None:
    """For activations quantized at run time: the same tokens; the logits of most steps within
    ``atol`` (the same computation), and of every step within ``bound``. Two implementations'
    float32 rounding differs in the last bits, and now and then that puts an activation on the
    other side of a rounding boundary: one quantization step apart there, and from then on a
    little apart in the KV cache. A systematic difference (another scale, another rounding)
    would move every step."""
    steps = []
    for i, ref in enumerate(reference):
        assert got.tokens[i] == ref.tokens[0], f"prompt {i}"
        steps.append((got.logits[i].cpu() - ref.logits[0]).abs().amax(-1))
    diffs = torch.cat(steps)
    assert float((diffs <= atol).float().mean()) >= 0.5, f"step differences {diffs.tolist()}"
    assert float(diffs.max()) <= bound, f"step differences {diffs.tolist()}"


def assert_expert_scales_and_activations_count(
    ours: nn.Module, without_expert_round_trip: nn.Module, prompt: list[int]
) -> None:
    """What a comparison of a quantized MoE with HF would see: HF without the experts'
    activation round trip (``without_expert_round_trip``) gives other logits than ``ours``, and
    so does ``ours`` with its experts' gate/up scales doubled (left doubled)."""
    before = generate_greedy(ours, [prompt], 4).logits[0]
    weights_only = hf_greedy(without_expert_round_trip, prompt, 4).logits[0]
    assert (before - weights_only).abs().max() > 1e-2
    for layer in ours.model.layers:
        layer.mlp.w13_scale.data *= 2
    after = generate_greedy(ours, [prompt], 4).logits[0]
    assert (before - after).abs().max() > 1e-2


# ---- compressed-tensors, by the package itself ---------------------------------------------------


def ct_observed(weight: torch.Tensor, args: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The min and max a data-free min-max observer sees for each scale of ``weight``."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "group":
        parts = weight.unflatten(-1, (-1, args.group_size))
    elif strategy == "channel":
        parts = weight.unsqueeze(-2)
    else:
        parts = weight.reshape(1, 1, -1)
    return parts.amin(-1), parts.amax(-1)


def write_compressed_tensors(plain: Path, folder: Path, preset: str, group_size: int = 0) -> Path:
    """``plain`` quantized with compressed-tensors' ``preset`` scheme ("W4A16", "W4A16_ASYM",
    "W8A8", "FP8_DYNAMIC"; ``group_size`` overrides a grouped preset's), as llm-compressor's
    data-free oneshot writes it. Returns the folder."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size:
        scheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        scale, zero = calculate_qparams(*ct_observed(module.weight.data, args), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    qc = compressor.quantization_config.model_dump(mode="json")
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    return write_folder(folder, plain, state, qc)


def ct_dequantized(plain: Path, preset: str, group_size: int = 0) -> dict[str, torch.Tensor]:
    """The values a compressed-tensors ``preset`` checkpoint of ``plain`` stands for: each
    linear's weight fake-quantized by compressed-tensors with the scales its writer computed."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme(preset, ["Linear"]).weights
    if group_size:
        args.group_size = group_size
    out = {}
    for name, weight in load_file(plain / "model.safetensors").items():
        if is_linear_weight(name):
            scale, zero = calculate_qparams(*ct_observed(weight, args), args)
            out[name] = fake_quantize(weight, scale, zero, args)
    return out


# ---- AWQ and GPTQ, packed as their tools pack them -----------------------------------------------


def minmax_quantize(
    weight: torch.Tensor, g_idx: torch.Tensor, groups: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] 0..15, scale [N, G] fp16, zero [N, G] int): each row's
    columns of group g (g_idx == g) share a scale and zero; asymmetric over min..max, or
    symmetric (zero 8, scale 2 * absmax / 15, GPTQ's sym)."""
    rows, cols = weight.shape
    q = torch.empty(rows, cols, dtype=torch.int64)
    scale = torch.empty(rows, groups, dtype=torch.float16)
    zero = torch.empty(rows, groups, dtype=torch.int64)
    for g in range(groups):
        cols_g = (g_idx == g).nonzero().flatten()
        w = weight[:, cols_g]
        lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        if symmetric:
            hi = torch.maximum(hi, -lo)
            lo = -hi
        s = ((hi - lo) / 15).clamp(min=1e-5).half()
        z = torch.full_like(lo, 8) if symmetric else torch.round(-lo / s.float()).clamp(0, 15)
        q[:, cols_g] = torch.clamp(torch.round(w / s.float()[:, None]) + z[:, None], 0, 15).long()
        scale[:, g], zero[:, g] = s, z.long()
    return q, scale, zero


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor):
    """(q - zero) * scale of each column's group, float32 [N, K]."""
    g = g_idx.long()
    return (q - zero[:, g]).float() * scale[:, g].float()


def pack_along_rows(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))):
    """[R, C] ints -> int32 [R, C / 8]: nibble i of word j holds column 8j + order[i]."""
    rows, cols = values.shape
    words = values.reshape(rows, cols // 8, 8)[..., list(order)].long()
    packed = sum(words[..., i] << (4 * i) for i in range(8))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


def group_indices(cols: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    """GPTQ's g_idx [K]: column k's group. With act-order the columns were quantized in a
    (here random) order and grouped in it: g_idx[order[i]] = i // group_size."""
    size = cols if group_size == -1 else group_size
    if not act_order:
        return torch.arange(cols) // size
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(cols, dtype=torch.int64)
    g_idx[order] = torch.arange(cols) // size
    return g_idx


def awq_tensors(weight: torch.Tensor, group_size: int) -> tuple[dict, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM tensors for weight [N, K] (qweight [K, N/8], qzeros [G, N/8],
    scales [G, N] fp16), and the weight they stand for."""
    cols = weight.shape[1]
    g_idx = group_indices(cols, group_size, False, 0)
    groups = int(g_idx.max()) + 1
    q, scale, zero = minmax_quantize(weight, g_idx, groups, symmetric=False)
    tensors = {
        "qweight": pack_along_rows(q.t(), AWQ_ORDER),
        "qzeros": pack_along_rows(zero.t(), AWQ_ORDER),
        "scales": scale.t().contiguous(),
    }
    return tensors, dequantize(q, scale, zero, g_idx)


def gptq_tensors(
    weight: torch.Tensor, group_size: int, act_order: bool, symmetric: bool, v2: bool, seed: int
) -> tuple[dict, torch.Tensor]:
    """GPTQ tensors for weight [N, K] (qweight [K/8, N], qzeros [G, N/8] holding zero - 1 in
    the original format, zero in v2, scales [G, N] fp16, g_idx [K] int32), and the weight they
    stand for."""
    cols = weight.shape[1]
    g_idx = group_indices(cols, group_size, act_order, seed)
    groups = int(g_idx.max()) + 1
    q, scale, zero = minmax_quantize(weight, g_idx, groups, symmetric)
    stored_zero = zero if v2 else zero - 1
    assert bool((stored_zero >= 0).all()), "a zero of 0 has no v1 form (it would read as 16)"
    tensors = {
        "qweight": pack_along_rows(q).t().contiguous(),  # K packed in order: [K/8, N]
        "qzeros": pack_along_rows(stored_zero.t()),
        "scales": scale.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, dequantize(q, scale, zero, g_idx)


# The projections that read the same input, which an act-order quantizer orders alike (its
# order comes from the input's statistics).
SAME_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2,
              "down_proj": 3}  # fmt: skip


def input_seed(name: str) -> int:
    """A seed per layer and input: ``model.layers.<i>.<block>.<proj>.weight``."""
    parts = name.split(".")
    return 10 * int(parts[2]) + SAME_INPUT[parts[4]]


def write_w4a16(
    plain: Path,
    folder: Path,
    make: Callable[[torch.Tensor, int], tuple[dict, torch.Tensor]],
    qc: dict,
) -> tuple[Path, dict[str, torch.Tensor]]:
    """``plain`` with each linear's weight replaced by ``make(weight, seed of its input)``'s
    tensors (named <module>.<tensor>); returns the folder and the dequantized weights, by
    checkpoint name."""
    tensors, dequantized = {}, {}
    for name, weight in load_file(plain / "model.safetensors").items():
        if not is_linear_weight(name):
            tensors[name] = weight
            continue
        module = name.rpartition(".")[0]
        packed, dequantized[name] = make(weight, input_seed(name))
        tensors.update({f"{module}.{key}": value for key, value in packed.items()})
    return write_folder(folder, plain, tensors, qc), dequantized


def assert_hf_greedy_up_to_ties(
    hf_model: nn.Module,
    prompt: list[int],
    tokens: list[int],
    bound: float = 0.5,
    **inputs: torch.Tensor,
) -> None:
    """``tokens`` are HF's greedy continuation of ``prompt`` but for near ties: HF, run over the
    prompt and these tokens at once (``inputs``: an image's, over the prompt's positions), ranks
    each one first, or within ``bound`` of its first at one step in eight at most. With
    activations quantized at run time, two float32 computations of one model (HF's incremental
    decode and its whole-sequence forward among them, and matmul kernels that change with the
    machine) put an activation a level apart now and then, which can flip a near-tied greedy
    choice, after which continuations part; a reader that computed something else (another
    scale, another rounding) would rank its tokens below HF's first by far more, at most steps."""
    ids = torch.tensor([prompt + tokens], device=hf_model.device)
    extended = {
        name: torch.cat([t, t.new_zeros(t.shape[0], len(tokens))], dim=1)
        if name == "mm_token_type_ids" else t
        for name, t in inputs.items()
    }  # fmt: skip
    with torch.no_grad():
        out = hf_model(input_ids=ids, **extended).logits[0, len(prompt) - 1 : -1].float()
    chosen = out.gather(-1, torch.tensor(tokens, device=out.device)[:, None])[:, 0]
    gaps = out.max(-1).values - chosen
    assert float(gaps.max()) <= bound, f"gaps to HF's first choice {gaps.tolist()}"
    assert int((gaps > 0).sum()) <= max(1, len(tokens) // 8), f"gaps {gaps.tolist()}"
