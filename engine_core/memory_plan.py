"""Will the model fit? Checked at start-up, after the model is built on the meta device and before
any weight or KV block is allocated (docs/design/memory-planning.md, "Refuse at start-up what
cannot fit").

A model that cannot fit used to fail late and badly: a CUDA out-of-memory error half-way through
the weights, or on the CPU a ``--kv-cache-memory-gb`` past the machine's memory allocated
(refused by the kernel with a traceback, or granted and then swapped or OOM-killed). Here the
need is computed first and compared with what the device has, and the engine stops with one line
naming the sizes and what to change.

The need, per tensor-parallel rank:

- weights: the bytes of every parameter and buffer of the model as ``build_model`` makes it on
  the meta device, in the load dtype, FP8 where quantized, this rank's shard; exact, since it is
  the very module the weights then load into. On the CPU the LM head is also packed into a copy
  for oneDNN (engine_core/models/layers.py ``pack_cpu_weights``), counted too;
- the KV cache: what ``ModelRunner`` will allocate: ``--num-kv-blocks`` blocks where given, on the
  CPU ``--kv-cache-memory-gb``, and never less than one sequence of ``max_model_len`` tokens
  (all layers, K and V, the KV dtype, this rank's KV heads; with MLA the latent and rotary key
  per token and layer instead, ``ModelConfig.kv_elements_per_token``), the least the engine can
  run with. With layer groups (engine_core/kv_groups.py) a block costs one group's layers, and one
  sequence needs what every group holds at its peak: all its blocks in a full group, the
  window's and a chunk's in a window group (and the null block). A model with linear-attention
  layers (Qwen3-Next) also holds one state slot per running sequence (``--max-num-seqs`` of
  them, ``state_slot_bytes`` each; on CUDA one more, the decode graphs' padding rows') and its
  saved states for prefix hits (``--state-snapshots``, as many again by default), and with
  speculation K more per slot (the states after each verify position), taken from the same
  budget and counted here;
- on CUDA, ``CUDA_HEADROOM_BYTES`` for the activations of the largest step and the allocator's
  slack (the KV sizing keeps the same headroom);
- the host KV tier, ``--kv-offload-gb``: host memory, so on the CPU part of the same budget, and
  on CUDA checked on its own against MemAvailable (it is pinned: it can never be swapped out);
- with ``--enable-lora``, the adapters' device slots: ``--max-loras`` slots of rank
  ``--max-lora-rank`` on every projection LoRA can target (``lora/adapter.py slot_bytes``);
- on CUDA, a model with MXFP4 or W4A16 experts: the scratch its prefill dequantizes a chunk of
  experts into (``expert_scratch_bytes``; engine_core/models/mxfp4_prefill.py, w4a16_prefill.py);
- a vision-language model's encoder: the encoder cache's budget (``--encoder-cache-memory-gb``)
  and the activation peak of its largest run (``encoder_peak_bytes``), so the KV cache sized
  on CUDA leaves the encoder room (docs/design/vision.md, "The encoder's memory").

The budget: on CUDA, total memory x ``--gpu-memory-utilization`` minus what is already in use;
on the CPU, MemAvailable from /proc/meminfo (no check where that file does not exist), which
every tensor-parallel rank on the host shares.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine_core.config import EngineConfig, ModelConfig, VisionConfig, W4A16Config
from engine_core.kv_groups import (
    KVLayout,
    model_kv_layout,
    pool_blocks_for_one_sequence,
    stage_kv_layout,
)
from engine_core.lora.adapter import check_lora_model, slot_bytes, target_shapes
from engine_core.models import mxfp4
from engine_core.models.cpu_gemm import packs
from engine_core.parallel import get_pipeline_stage

logger = logging.getLogger(__name__)

# Kept free on a GPU for the activations of the largest step and the allocator's slack.
CUDA_HEADROOM_BYTES = 2 * 2**30
MEMINFO = Path("/proc/meminfo")


class ModelTooLargeError(ValueError):
    """The model and its minimum KV cache do not fit the memory budget, or the largest step does
    not fit beside them (engine_core/warm_up.py); the message says why."""


@dataclass(frozen=True)
class Budget:
    """The bytes one engine may use on its device, and what that figure was derived from."""

    bytes: int
    source: str


@dataclass(frozen=True)
class MemoryPlan:
    """What one engine core needs, against its budget (sizes in bytes, per tensor-parallel rank;
    ``ranks`` of them share the budget: every rank on a CPU host, one per GPU)."""

    model: str
    device: torch.device
    weight_bytes: int
    kv_bytes: int  # the KV cache the engine will allocate (with the state slots, if any)
    min_kv_bytes: int  # one sequence of max_model_len tokens
    max_model_len: int
    headroom_bytes: int
    budget: Budget
    ranks: int = 1
    kv_source: str = "one sequence"
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype = torch.float32
    quantized: bool = False
    host_kv_bytes: int = 0  # the host KV tier, where it shares this budget (the CPU's)
    encoder_bytes: int = 0  # a vision model's encoder cache and largest encoder run
    scratch_bytes: int = 0  # MXFP4 or W4A16 experts' dequantize scratch (CUDA)
    lora_bytes: int = 0  # the LoRA adapters' device slots (--max-loras x --max-lora-rank)

    @property
    def needed_bytes(self) -> int:
        per_rank = self.weight_bytes + self.kv_bytes + self.headroom_bytes + self.encoder_bytes
        per_rank += self.scratch_bytes + self.lora_bytes
        return self.ranks * per_rank + self.host_kv_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.budget.bytes


def gib(n: float) -> str:
    """Bytes for a message: GiB, or MiB where GiB would round a small cache to zero."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 100 else f"{n / 2**20:.2f} MiB"


def number(x: float) -> str:
    """A flag's value as the user typed it: 1000000, not 1e+06 or 1000000.0."""
    return str(int(x)) if x == int(x) else f"{x:g}"


def module_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers (a tied weight once); works on the meta
    device, where nothing is allocated, so it sizes a model before its weights exist."""
    tensors = [*module.parameters(), *module.buffers()]
    unique = {id(t): t for t in tensors}.values()
    return sum(t.numel() * t.element_size() for t in unique)


def cpu_packing_bytes(module: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """The oneDNN copy of the LM head that a CPU model keeps next to its plain matrix (the
    linears' packed copies replace their plain weights, so they add nothing)."""
    if device.type != "cpu" or not packs(dtype):
        return 0
    weight = module.logits_weight() if hasattr(module, "logits_weight") else None
    return 0 if weight is None else weight.numel() * weight.element_size()


def kv_block_bytes(
    config: ModelConfig,
    num_kv_heads: int,
    block_size: int,
    kv_dtype: torch.dtype,
    layout: KVLayout | None = None,
) -> int:
    """Bytes of one KV block id: K and V of this rank's KV heads (MLA: the latent and the
    rotary key, a fraction of what K and V would take) in one layer of each layer group of
    ``layout`` (None: the model's), so over all layers where the model has one group, and over
    a pipeline stage's layers on its ranks."""
    per_layer = config.kv_elements_per_token(num_kv_heads) // len(config.attention_layer_ids)
    layers = (layout or model_kv_layout(config)).group_size
    return block_size * per_layer * layers * kv_dtype.itemsize


def state_slot_bytes(config: ModelConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one linear-attention state slot (Qwen3-Next) on one of ``tp_size`` ranks: every
    such layer's convolution inputs and recurrent state for the rank's share of the heads, in
    the model's dtype; 0 for a model without such layers."""
    la = config.linear_attention
    if la is None:
        return 0
    layers = config.num_layers - len(config.attention_layer_ids)
    return layers * la.state_elements // tp_size * dtype.itemsize


def min_kv_bytes(
    config: ModelConfig,
    num_kv_heads: int,
    max_model_len: int,
    block_size: int,
    kv_dtype: torch.dtype,
    chunk: int | None = None,
    layout: KVLayout | None = None,
) -> int:
    """The smallest cache the engine runs with: the blocks one sequence of ``max_model_len``
    tokens holds at its peak, computed in chunks of ``chunk`` tokens (None: in one), in the
    layers of ``layout`` (None: the model's)."""
    layout = layout or model_kv_layout(config)
    blocks = pool_blocks_for_one_sequence(layout, max_model_len, block_size, chunk or max_model_len)
    return blocks * kv_block_bytes(config, num_kv_heads, block_size, kv_dtype, layout)


def host_budget(meminfo: Path = MEMINFO) -> Budget | None:
    """MemAvailable (what can be allocated without swapping); None where the file is absent."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return Budget(int(value.split()[0]) * 1024, f"MemAvailable in {meminfo}")
    return None


def cuda_budget(device: torch.device, utilization: float) -> Budget:
    """total x --gpu-memory-utilization minus what is in use now (this and other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    source = (
        f"--gpu-memory-utilization {utilization:g} x {gib(total)} total on {device} "
        f"- {gib(used)} already in use"
    )
    return Budget(int(utilization * total - used), source)


def plan_memory(
    config: EngineConfig,
    model_config: ModelConfig,
    module: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    budget: Budget,
    lora_bytes: int | None = None,
) -> MemoryPlan:
    """The plan for ``module`` (built on the meta device) under ``config`` against ``budget``;
    ``lora_bytes``: the LoRA slots to count (None: ``module``'s own, where LoRA is on)."""
    num_kv_heads = model_config.num_kv_heads // config.tensor_parallel_size
    limit = model_config.max_tokens
    max_model_len = min(config.max_model_len or limit, limit)
    # This rank's stage's layers only (all of them without pipeline stages).
    layers = get_pipeline_stage().layers(model_config.num_layers)
    layout = stage_kv_layout(model_config, layers)
    block = kv_block_bytes(model_config, num_kv_heads, config.block_size, kv_dtype, layout)
    least = min_kv_bytes(
        model_config,
        num_kv_heads,
        max_model_len,
        config.block_size,
        kv_dtype,
        config.token_budget,
        layout,
    )
    # Linear-attention state slots, one per running sequence and on CUDA the graphs' padding
    # slot (at most: eager engines allocate none), and the saved states of prefix hits
    # (--state-snapshots), and with speculation K draft rows per slot, beside the blocks (the
    # runner takes them out of the same budget).
    slots = config.max_num_seqs + (device.type == "cuda") + config.num_state_snapshots()
    slots += config.max_num_seqs * config.num_drafted_positions()
    states = slots * state_slot_bytes(model_config, dtype, config.tensor_parallel_size)
    least += states
    kv, source = least, f"one sequence of {max_model_len} tokens"
    if config.num_kv_blocks:
        kv = config.num_kv_blocks * block + states
        source = f"--num-kv-blocks {config.num_kv_blocks}"
    elif device.type != "cuda":
        blocks = int((config.kv_cache_memory_gb * 2**30 - states) // block)
        kv = blocks * block + states
        source = f"--kv-cache-memory-gb {number(config.kv_cache_memory_gb)}"
    if lora_bytes is None:
        lora_bytes = lora_slot_bytes(config, model_config, dtype)
    return MemoryPlan(
        model=config.model,
        device=device,
        weight_bytes=module_bytes(module) + cpu_packing_bytes(module, device, dtype),
        kv_bytes=max(kv, least),
        min_kv_bytes=least,
        max_model_len=max_model_len,
        headroom_bytes=CUDA_HEADROOM_BYTES if device.type == "cuda" else 0,
        budget=budget,
        ranks=config.world_size if device.type != "cuda" else 1,
        kv_source=source,
        dtype=dtype,
        kv_dtype=kv_dtype,
        quantized=model_config.quantization is not None,
        host_kv_bytes=0 if device.type == "cuda" else int(config.kv_offload_gb * 2**30),
        encoder_bytes=encoder_bytes(config, model_config, dtype, max_model_len),
        scratch_bytes=expert_scratch_bytes(model_config, device, dtype),
        lora_bytes=lora_bytes,
    )


def lora_slot_bytes(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """With --enable-lora, the adapters' slots that the runner allocates beside the weights
    (engine_core/lora/layers.py install_lora); 0 without. ValueError for a model family with no
    LoRA targets, before any weight loads."""
    if not config.enable_lora:
        return 0
    check_lora_model(model_config)
    shapes = target_shapes(model_config)
    return slot_bytes(
        shapes, config.max_loras, config.max_lora_rank, dtype, config.tensor_parallel_size
    )


def expert_scratch_bytes(
    model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """On CUDA, the buffer a model with MXFP4 or W4A16 experts dequantizes a chunk of experts
    into at prefill (allocated per layer call, so one layer's worth); 0 elsewhere."""
    mc = model_config
    w4a16 = isinstance(mc.quantization, W4A16Config) and mc.num_experts > 0
    if device.type != "cuda" or not (mc.expert_format == "mxfp4" or w4a16):
        return 0
    return mxfp4.scratch_bytes(mc.num_experts, mc.hidden_size, mc.moe_intermediate_size, dtype)


def encoder_call_tokens(
    vision: VisionConfig, max_num_batched_tokens: int, max_model_len: int
) -> int:
    """The most placeholder tokens one encoder run takes (engine_core/multimodal.py splits a
    step's images into runs of this many): a step's token budget, or one largest image (no
    larger than a prompt can hold)."""
    return max(max_num_batched_tokens, min(vision.max_image_tokens, max_model_len))


def encoder_bytes(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_model_len: int
) -> int:
    """A vision-language model's encoder memory: its cache's budget and the peak of its
    largest run; 0 for a text model."""
    vision = model_config.vision
    if vision is None:
        return 0
    tokens = encoder_call_tokens(vision, config.token_budget, max_model_len)
    peak = encoder_peak_bytes(vision, model_config.hidden_size, tokens, dtype)
    return int(config.encoder_cache_memory_gb * 2**30) + peak


def encoder_peak_bytes(
    vision: VisionConfig, text_hidden: int, tokens: int, dtype: torch.dtype
) -> int:
    """An upper bound on the bytes one encoder run over images of ``tokens`` placeholder
    tokens holds at its peak, counted from the tower's shapes: a block's live activations (the
    residual, its norm, q/k/v and their window-gathered copies, the attention's output: at most
    12 rows of the tower's width a patch, and the MLP's three of its width), the pixels as they
    arrive (float32) and cast, the embeddings out (twice: the run's and the cache's slices;
    Qwen3-VL's with their DeepStack features).
    No attention scores: the towers' unmasked SDPA calls take fused kernels (flash or
    memory-efficient on CUDA, flash on the CPU) that never hold a [patches, patches] matrix.
    tests/test_vision_memory.py measures the real peak under it."""
    tower = vision.tower
    merge = vision.spatial_merge_size**2
    patches = tokens * merge
    width, inter = tower["hidden_size"], tower["intermediate_size"]
    channels = tower.get("in_channels", tower.get("num_channels", 3))
    pixels_per_patch = channels * tower.get("temporal_patch_size", 1) * tower["patch_size"] ** 2
    size = dtype.itemsize
    activations = size * patches * (12 * width + 3 * inter)
    pixels = patches * pixels_per_patch * (4 + size)
    outputs = 2 * size * tokens * text_hidden * (1 + vision.deepstack_layers)
    return activations + pixels + outputs


def check_fits(plan: MemoryPlan) -> None:
    """ModelTooLargeError, one line with the sizes and the flags that help, unless it fits."""
    if plan.fits:
        return
    parts = [
        f"weights {gib(plan.weight_bytes)}",
        f"KV cache {gib(plan.kv_bytes)} ({plan.kv_source})",
    ]
    if plan.headroom_bytes:
        parts.append(f"activation headroom {gib(plan.headroom_bytes)}")
    if plan.encoder_bytes:
        parts.append(f"vision encoder {gib(plan.encoder_bytes)}")
    if plan.scratch_bytes:
        parts.append(f"experts' dequantize scratch {gib(plan.scratch_bytes)}")
    if plan.lora_bytes:
        parts.append(f"LoRA slots {gib(plan.lora_bytes)} (--max-loras x --max-lora-rank)")
    need = " + ".join(parts)
    if plan.ranks > 1:
        need = f"{plan.ranks} tensor-parallel ranks on this host x ({need})"
    if plan.host_kv_bytes:
        need += f" + host KV tier {gib(plan.host_kv_bytes)} (--kv-offload-gb)"
    raise ModelTooLargeError(
        f"model {plan.model!r} does not fit on {plan.device}: it needs {need} = "
        f"{gib(plan.needed_bytes)}, over the budget of {gib(max(plan.budget.bytes, 0))} "
        f"({plan.budget.source}); the smallest KV cache it can run with is "
        f"{gib(plan.min_kv_bytes)} (one sequence of {plan.max_model_len} tokens). "
        f"Try {remedies(plan)}"
    )


def remedies(plan: MemoryPlan) -> str:
    """What the user can change, for the device in the plan."""
    options = ["a smaller --kv-offload-gb"] if plan.host_kv_bytes else []
    options += ["a smaller --max-loras or --max-lora-rank"] if plan.lora_bytes else []
    if plan.kv_bytes > plan.min_kv_bytes:
        flag = "--num-kv-blocks" if plan.kv_source.startswith("--num") else "--kv-cache-memory-gb"
        options.append(f"a smaller {flag}")
    options.append("a smaller --max-model-len")
    if plan.device.type == "cuda":
        options += [] if plan.quantized else ["--quantization fp8"]
        options += [] if plan.kv_dtype.itemsize == 1 else ["--kv-cache-dtype fp8"]
        options += [
            "a larger --tensor-parallel-size",
            "a higher --gpu-memory-utilization",
            "freeing the GPU",
        ]
    else:
        options += ["--dtype bfloat16"] if plan.dtype == torch.float32 else []
        options.append("freeing memory")
    return ", ".join(options[:-1]) + f" or {options[-1]}, or a smaller model"


def check_memory(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    module: nn.Module,
    model_config: ModelConfig,
    lora_bytes: int | None = None,
) -> None:
    """The loader's hook (``load_model(..., check_fit=...)``): refuse, before any allocation, a
    model whose weights and KV cache exceed this device's budget (``lora_bytes``: as
    plan_memory's)."""
    if device.type == "cuda":
        budget = cuda_budget(device, config.gpu_memory_utilization)
        check_pinned_host_tier(config.kv_offload_gb, host_budget())
    else:
        budget = host_budget() if device.type == "cpu" else None
    if budget is None:
        return
    plan = plan_memory(config, model_config, module, device, dtype, kv_dtype, budget, lora_bytes)
    check_fits(plan)


def check_max_model_len(config: EngineConfig, model_config: ModelConfig) -> None:
    """ValueError where an asked --max-model-len is past what the model takes (its positions,
    or an embedding model's input limit), or past what an asked --num-kv-blocks holds for one
    sequence: refused before any weight loads, where serving would cut it. A pool sized from
    memory is checked once sized (model_runner.py ``_kv_blocks_that_fit``)."""
    asked = config.max_model_len
    if asked is None:
        return
    limit = model_config.max_tokens
    if asked > limit:
        what = "positions" if limit == model_config.max_position_embeddings else "input tokens"
        raise ValueError(
            f"--max-model-len {asked} is past the model's {limit} {what}: give at most {limit}, "
            "or leave it unset to serve the model's limit"
        )
    blocks = config.num_kv_blocks
    if blocks is None:
        return
    # Any pipeline stage's layers have the model's windows (kv_groups.py stage_kv_layout).
    layout = model_kv_layout(model_config)
    needed = pool_blocks_for_one_sequence(layout, asked, config.block_size, config.token_budget)
    if blocks < needed:
        raise ValueError(
            f"--num-kv-blocks {blocks} holds less than one sequence of --max-model-len {asked} "
            f"({needed} blocks of {config.block_size} tokens): give more blocks or a smaller "
            "--max-model-len"
        )


def check_pinned_host_tier(gb: float, budget: Budget | None) -> None:
    """ModelTooLargeError where a GPU engine's --kv-offload-gb exceeds the host's available
    memory (None: not known, not checked)."""
    need = int(gb * 2**30)
    if budget is None or need <= budget.bytes:
        return
    raise ModelTooLargeError(
        f"--kv-offload-gb {number(gb)} needs {gib(need)} of pinned host memory, over the "
        f"{gib(max(budget.bytes, 0))} available ({budget.source}); try a smaller --kv-offload-gb"
    )
