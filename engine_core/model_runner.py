"""The model runner: owns the weights, the KV-cache tensors and the attention backend.

It turns a SchedulerOutput into one flattened forward (prefills, prompt chunks, cached-prefix
prefills and decodes together), samples the rows that reached the end of their known tokens, and
copies the sampled ids to the host once per step.

A step is three calls, each of which returns at once, so the engine core can overlap them with
its own work (docs/design/overlap-scheduling.md): ``forward`` packs the inputs
(engine_core/input_batch.py: one host-to-device copy) and enqueues the forward and the sampling
rows' logits; ``sample`` enqueues the sampler (with a structured-output bitmask, if the step has
one), the device-to-host copy of the sampled ids into pinned memory and a CUDA event; ``collect``
waits for that event and reads the ids. The sampled tensor stays on the device for the next
step, whose rows that wait on one of its ids (placeholders) gather it there. ``execute`` is the
three back to back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from engine_core.attention.base import AttentionBackend, AttentionMetadata
from engine_core.attention.layer import Attention
from engine_core.config import LARGE_GPU_BYTES, EngineConfig, ModelConfig
from engine_core.cpu_malloc import keep_freed_memory
from engine_core.draft_model import (
    DraftModel,
    check_draft,
    check_draft_layers,
    check_same_tokenizer,
)
from engine_core.eagle3 import Eagle3Proposer, load_eagle3
from engine_core.forward_context import StateRows, forward_context
from engine_core.input_batch import InputBatch, PackedInputs
from engine_core.kv_groups import pool_blocks_for_one_sequence, stage_kv_layout
from engine_core.kv_offload_pool import HostKVPool
from engine_core.loader import LoadedModel, load_model, peek_model_config
from engine_core.lora.adapter import check_lora_model, load_adapter, target_shapes
from engine_core.lora.batch import LoraBatch, lora_batch
from engine_core.lora.layers import install_lora
from engine_core.lora.manager import LoraManager
from engine_core.memory_plan import (
    CUDA_HEADROOM_BYTES,
    ModelTooLargeError,
    check_max_model_len,
    check_memory,
    encoder_bytes,
    encoder_call_tokens,
    expert_scratch_bytes,
    kv_block_bytes,
    lora_slot_bytes,
    state_slot_bytes,
)
from engine_core.models.delta_rule import missing_prompt_kernels
from engine_core.models.fp8 import FP8_DTYPE, check_fp8_device
from engine_core.models.target import BuildTarget
from engine_core.mtp import MtpProposer, load_mtp
from engine_core.multimodal import (
    MultimodalRunner,
    MultimodalStep,
    placeholder_run,
    warm_up_image,
)
from engine_core.parallel import get_pipeline_stage, get_tp_group
from engine_core.pooler import PooledStep, Pooler
from engine_core.profiler import StepShape
from engine_core.request import Request, SchedulerOutput
from engine_core.sampler import Sampler, SamplerOutput
from engine_core.state_snapshots import KeptDraftState, StateMove, independent_runs
from engine_core.step_stats import GpuTimeline, StepStats
from engine_core.warm_up import (
    SHORT_PROMPT,
    StepLimits,
    image_warm_up_plan,
    pooling_warm_up_plans,
    warm_up_plans,
)
from protocol.messages import TokenLogprobs

if TYPE_CHECKING:
    from engine_core.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)

# Speculation methods tested on linear-attention models (tests/test_speculative_hybrid.py,
# test_speculative_qwen3_next_mtp.py); the others are refused by name there.
LINEAR_ATTENTION_METHODS = ("ngram", "draft_model", "mtp")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the last row of each sequence that samples
    sampling_requests: list[Request]
    # [P] int64: the rows whose logits score prompt tokens (prompt logprobs), or None. Every
    # tensor-parallel rank computes their logits too (the projection is a collective).
    prompt_rows: torch.Tensor | None = None
    prompt_rows_cpu: list[int] | None = None  # the same rows on the host
    ids_from: torch.Tensor | None = None  # the input ids not yet in input_ids (PackedInputs)
    lora: LoraBatch | None = None  # which rows use which LoRA slot; None: none does
    # Every KV layer group's metadata, group 0's (``meta``) first; empty with one group.
    group_metadata: tuple[AttentionMetadata, ...] = ()
    multimodal: MultimodalStep | None = None  # the step's image embeddings and M-RoPE positions
    state: StateRows | None = None  # the linear-attention layers' slots; None: no such layers


@dataclass
class PromptScoring:
    """The prompt tokens a step scores (requests that asked for prompt logprobs): for each
    request, its first scored position and how many, then every row's target token."""

    requests: list[Request]
    first_positions: list[int]
    counts: list[int]
    targets: list[int]  # the prompt token each row predicts, in row order


PROMPT_LOGITS_ROWS = 512  # logits [rows, vocab] float32 at a time: bounded memory for any prompt


@dataclass
class RunnerOutput:
    sampled_token_ids: list[int]  # one per sampling request, in schedule order
    logprobs: list[TokenLogprobs | None]
    # An embedding engine's: the vector of each request whose prompt ended this step, by
    # request id (None: not finite).
    embeddings: dict[str, list[float] | None] | None = None
    # Speculation: for each row with drafts, in schedule order, the target's token after its
    # last known token and after each of its drafts but the last (engine_core/speculative.py),
    # and their logprobs where the request asked (else Nones).
    draft_checks: list[list[int]] = field(default_factory=list)
    draft_logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)


@dataclass
class ForwardStep:
    """A step whose forward and logits are enqueued; ``ModelRunner.sample`` finishes it."""

    plan: SchedulerOutput
    sampling_requests: list[Request]  # the rows that sample, in order
    output_positions: Callable[[], list[int]]  # [S]: which output each sampling row draws
    logits: torch.Tensor | None  # [S, V'] in the weights' dtype, None when no row samples
    argmax: torch.Tensor | None  # [S], where the decode graph computed it with the logits
    timeline: GpuTimeline | None  # timing events, with step stats on CUDA
    # request id -> (first scored prompt position, logprobs), for the prompt tokens scored
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
    pooled: PooledStep | None = None  # an embedding engine's vectors that the step finished
    drafted: DraftedRows | None = None  # speculation: the logits at the drafted positions
    # Pipeline stages: what rank 0's first stage hands on, until the last stage's logits are in.
    handoff: StageHandoff | None = None


@dataclass
class StageHandoff:
    """A step whose first pipeline stage ran on rank 0: its output for the next stage, sent once
    (``ModelRunner.hand_on``), and what taking its logits back needs (``sample``)."""

    activations: torch.Tensor  # [2, T, hidden]: the hidden state and the residual stream
    # [S] int64, the sampling rows: a copy (the next step's inputs reuse the step buffers)
    logits_indices: torch.Tensor
    prompt_rows: torch.Tensor | None  # [P] int64: the rows that score prompt tokens, or None
    scoring: PromptScoring | None  # the prompt tokens the step scores
    sent: bool = False

    @property
    def hidden(self) -> torch.Tensor:
        """[T, hidden]: the rows whose logits the last stage sends (their count, here)."""
        return self.activations[0]


@dataclass
class DraftedRows:
    """A step's drafted positions (each drafted row's positions but its last, in schedule
    order): their logits and what the sampler needs to draw each as a plain step would."""

    logits: torch.Tensor  # [D, V']
    counts: list[int]  # positions per drafted row
    requests: list[Request]  # [D]
    positions: list[int]  # [D]: the output each draws
    ahead: list[int]  # [D]: the request's tokens after it, which its penalties do not count


@dataclass
class DraftChecks:
    """The target's token at each drafted row's positions but the last (those check the
    drafts; the last one's token is the row's sampled token), and how many a row has."""

    token_ids: torch.Tensor  # [D] int64, D = the step's drafts
    counts: list[int]
    requests: list[Request]  # [D]: each position's request
    logprobs: tuple[torch.Tensor | None, ...] | None  # as LaunchedStep's, where one asked

    def per_row(self) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Each drafted row's tokens and their logprobs, in schedule order."""
        ids = self.token_ids.tolist()
        lps: list[TokenLogprobs | None] = [None] * len(ids)
        if self.logprobs is not None:
            lps = _logprobs_per_row(self.logprobs, self.requests)
        tokens, logprobs, at = [], [], 0
        for count in self.counts:
            tokens.append(ids[at : at + count])
            logprobs.append(lps[at : at + count])
            at += count
        return tokens, logprobs


@dataclass
class LaunchedStep:
    """A step whose GPU work is enqueued; ``ModelRunner.collect`` turns it into a RunnerOutput."""

    plan: SchedulerOutput
    sampling_requests: list[Request]
    token_ids: torch.Tensor | None  # [S] int64 on the host (pinned on CUDA), filled by the copy
    logprobs: tuple[torch.Tensor, ...] | None  # host copies: chosen [S], top ids / lps [S, N]
    done: torch.cuda.Event | None  # recorded after the copies (CUDA only)
    timeline: GpuTimeline | None = None  # timing events, with step stats on CUDA
    gpu_prev_end: torch.cuda.Event | None = None  # the previous step's end, for the idle gap
    # request id -> (first scored prompt position, logprobs), for the prompt tokens scored
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
    constrained: bool = False  # a structured-output bitmask masked its sampling
    pooled: PooledStep | None = None  # an embedding engine's vectors that the step finished
    draft_checks: DraftChecks | None = None  # speculation, copied to the host with the ids


def resolve_device(name: str) -> torch.device:
    """The device --device names; ValueError for a GPU this machine or torch build lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this machine (or its torch build) has no CUDA GPU")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA GPUs")
    return device


def resolve_max_num_seqs(config: EngineConfig, model: ModelConfig | None = None) -> EngineConfig:
    """``config`` with --max-num-batched-tokens (``with_token_budget``: smaller on the CPU) and
    --max-num-seqs decided where they were left unset (``with_max_num_seqs``):
    the large default on one host whose GPU has LARGE_GPU_BYTES or more, for a model without
    linear-attention layers, whose per-sequence states (and as many saved ones) would otherwise
    take that memory from the KV cache. Over several hosts every node decides alike without
    seeing the others' GPUs: the small default. ``model``: the model's config where the caller
    has read it already (else it is read here, only where the GPU is large)."""
    device = resolve_device(config.device)
    config = config.with_token_budget(on_cpu=device.type == "cpu")
    if config.max_num_seqs is not None:
        return config
    large = (
        device.type == "cuda"
        and config.nnodes == 1
        and torch.cuda.get_device_properties(device).total_memory >= LARGE_GPU_BYTES
    )
    if large:
        model = model or peek_model_config(config.model)
        large = model is None or model.linear_attention is None
    resolved = config.with_max_num_seqs(large)
    logger.info(
        "--max-num-seqs unset: %d running sequences at most (%s)", resolved.max_num_seqs,
        f"one host whose GPU has {LARGE_GPU_BYTES // 2**30} GiB or more"
        if large
        else f"no GPU of {LARGE_GPU_BYTES // 2**30} GiB or more on one host, or a model with "
        "linear-attention layers",
    )  # fmt: skip
    return resolved


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: 'auto' keeps the model's dtype; 'fp8' stores e4m3 (EngineConfig has
    already refused any other value)."""
    if name != "fp8":
        return dtype
    check_fp8_device(device, "--kv-cache-dtype fp8")
    return FP8_DTYPE


def select_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        try:
            from engine_core.attention.triton_backend import TritonBackend
        except ImportError:
            logger.warning("Triton backend unavailable; using the torch reference attention")
        else:
            return TritonBackend()
        from engine_core.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend()
    from engine_core.attention.cpu_backend import CpuBackend

    return CpuBackend()


def build_target(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> BuildTarget:
    """What the model is built for. Decode steps replay CUDA graphs on CUDA unless eager is
    forced or the model is split into pipeline stages (``_capture_graphs``); with LoRA the
    projections keep the checkpoint's layout (``BuildTarget.lora``)."""
    graphs = device.type == "cuda" and not config.enforce_eager
    graphs = graphs and config.pipeline_parallel_size == 1
    return BuildTarget(device, dtype, cuda_graphs=graphs, lora=config.enable_lora)


class ModelRunner:
    """Built in order: the model in its final form (loaded for its target), the KV cache sized
    to what is left, the attention backend and CUDA graphs, the sampler and the step buffers.
    The engine core then warms it up (``warm_up``) before the first request."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = resolve_max_num_seqs(config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        loaded = self._load_model()
        self.model = loaded.module
        self.model_config: ModelConfig = loaded.config
        self.model_dir = loaded.model_dir
        # Speculation's draft model (engine_core/draft_model.py), EAGLE-3 head (eagle3.py) or
        # MTP layer (mtp.py), loaded before the KV cache is sized: its weights and its share of
        # every block come out of the same memory.
        self._check_speculation_method()
        self.drafter = self._load_draft()
        # Adapter slots take their memory before the KV cache is sized from what is left.
        self.loras = self._install_lora() if config.enable_lora else None
        # This process's share of the KV heads: all of them unless tensor-parallel.
        self.num_kv_heads = self.model_config.num_kv_heads // config.tensor_parallel_size
        limit = self.model_config.max_tokens
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.block_size = config.block_size
        # The decoder layers this process runs and caches: a pipeline stage's, else all.
        self.stage = get_pipeline_stage()
        self.stage_layers = self.stage.layers(self.model_config.num_layers)
        # Layers grouped by kind, each group its own block tables (engine_core/kv_groups.py).
        self.kv_layout = stage_kv_layout(self.model_config, self.stage_layers)
        # Linear-attention layers: one state slot per running request (block_manager.py).
        self.num_state_slots = config.max_num_seqs if self.kv_layout.state_layers else 0
        # One more slot where decode graphs may replay: their padding rows' (no request holds it).
        graphs = build_target(config, self.device, self.dtype).cuda_graphs
        self.pad_state_slot = self.num_state_slots if self.num_state_slots and graphs else None
        # Saved states for prefix hits (engine_core/state_snapshots.py): rows of the same
        # tensors, after the slots (snapshot_row).
        self.num_state_snapshots = config.num_state_snapshots() if self.num_state_slots else 0
        self._check_state_kind()
        self.num_kv_blocks = config.num_kv_blocks or self._kv_blocks_that_fit()
        self.kv_cache = self._allocate_kv_cache()
        self.host_kv = self._allocate_host_kv()  # the host KV tier (--kv-offload-gb), or None
        self.state_cache = self._allocate_state_slots()
        self._set_kv_scales(loaded.kv_scales)
        self.backend = select_backend(self.device)
        if self.drafter is not None:
            self.drafter.allocate_cache(self.num_kv_blocks, self.block_size, self.backend)
        self.graph_runner = self._capture_graphs()  # None on the CPU or with enforce_eager
        self.sampler = Sampler(
            self.model_config.eos_token_ids, self.model_config.vocab_size, seed=config.seed
        )
        # An embedding model's engine pools the steps' hidden states; it never samples.
        self.pooler = Pooler() if self.model_config.embedding is not None else None
        self.multimodal = self._multimodal_runner()  # None: the model takes no images
        self.stats = StepStats()  # the engine core hands its own in
        # While the profiler traces (engine_core/profiler.py), each step's shape, for the trace's
        # kernels; None else.
        self.step_shapes: list[StepShape] | None = None
        self._replayed_decode_graph = False  # by the last forward (_step_shape)
        self.input_batch = InputBatch(
            self.device,
            self.block_size,
            max_num_tokens=config.token_budget,
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            kv_windows=self.kv_layout.windows,
            kv_attention_chunks=self.kv_layout.attention_chunks,
            mark_uniform=config.speculation() is not None,  # its verify steps (speculative.py)
            orders_rows=getattr(self.backend, "orders_decode_rows", False),
        )
        self._init_step_state()

    def _load_model(self) -> LoadedModel:
        """The model, built and loaded in its final form for this device (models/target.py);
        refused before any weight is allocated if it cannot fit (memory_plan.py)."""
        config = self.config
        if self.device.type == "cpu":
            keep_freed_memory()  # no page faults on every layer's temporaries (cpu_malloc.py)
        else:
            # The host's tensor work is small here (the model runs on the GPU); torch's OpenMP
            # workers would only spin between ops and take the cores that the grammar engine's
            # mask threads need (docs/design/structured-outputs.md, "The bitmask inside the
            # overlapped step").
            torch.set_num_threads(1)
        target = build_target(config, self.device, self.dtype)

        def fits(module: torch.nn.Module, model_config: ModelConfig) -> None:
            check_max_model_len(config, model_config)  # the served model's only
            check_memory(config, self.device, self.dtype, self.kv_dtype, module, model_config)

        return load_model(
            config.model, self.device, self.dtype, config.quantization, fits, target, config.runner
        )

    def _check_speculation_method(self) -> None:
        """Refuse, before any drafter loads, a method not tested on this model's layers, and
        any on an embedding model (it decodes nothing to speculate on)."""
        spec = self.config.speculation()
        if spec is not None and self.model_config.embedding is not None:
            raise ValueError("--speculative-config: an embedding model decodes no tokens to draft")
        if spec is None or self.model_config.linear_attention is None:
            return
        if spec.method not in LINEAR_ATTENTION_METHODS:
            raise ValueError(
                f"--speculative-config method {spec.method!r} is not supported for models with "
                "linear-attention layers (Qwen3-Next, Qwen3.5) yet; "
                f"{', '.join(LINEAR_ATTENTION_METHODS)} are"
            )

    def _load_draft(self) -> DraftModel | Eagle3Proposer | MtpProposer | None:
        """The draft model of ``"method": "draft_model"``, checked against the target (the same
        vocabulary and tokenizer, its context, plain attention) and against the memory left
        beside the target's weights; the head of ``eagle3``; the target checkpoint's MTP layer
        of ``mtp``; None for any other proposer."""
        spec = self.config.speculation()
        if spec is not None and spec.method == "eagle3":
            return self._load_eagle3(spec.model, spec.num_speculative_tokens)
        if spec is not None and spec.method == "mtp":
            config, device, dtype = self.model_config, self.device, self.dtype
            k = spec.num_speculative_tokens
            return load_mtp(self.model, config, self.model_dir, k, device, dtype)
        if spec is None or spec.method != "draft_model":
            return None
        assert spec.model is not None  # SpeculativeConfig.check
        config = self.config
        if self.model_config.embedding is not None or self.model_config.vision is not None:
            # A vision target's image rows have no ids a text draft could read.
            raise ValueError(
                "--speculative-config draft model: the target must be a text model that "
                "generates (not an embedding or vision-language model)"
            )
        # The draft takes no adapters, but the target's slots are allocated after it loads:
        # the draft's plan keeps their bytes aside.
        slots = lora_slot_bytes(config, self.model_config, self.dtype)
        fits = partial(check_memory, config, self.device, self.dtype, self.dtype, lora_bytes=slots)
        # The target's graphs decide the draft's (``_capture_graphs``), and with them the
        # layouts its layers take for graphs; never LoRA's (the base draft proposes).
        graphs = build_target(config, self.device, self.dtype).cuda_graphs
        target = BuildTarget(self.device, self.dtype, cuda_graphs=graphs)
        try:
            loaded = load_model(spec.model, self.device, self.dtype, None, fits, target, "generate")
        except FileNotFoundError as exc:  # say which flag named the path
            raise FileNotFoundError(f"--speculative-config draft model: {exc}") from None
        limit = self.model_config.max_position_embeddings
        check_draft(loaded.config, self.model_config, min(config.max_model_len or limit, limit))
        check_draft_layers(loaded.module)
        check_same_tokenizer(self.model_dir, loaded.model_dir)
        return DraftModel(loaded, spec.num_speculative_tokens, self.device, self.dtype)

    def _load_eagle3(self, model: str | None, max_drafts: int) -> Eagle3Proposer:
        """The EAGLE-3 head (engine_core/eagle3.py), refusing what it cannot run beside; the
        target's forward then writes the hidden states it reads, for any step this engine
        runs (up to --max-num-batched-tokens rows; a decode graph's up to --max-num-seqs)."""
        assert model is not None  # SpeculativeConfig.check
        config = self.config
        rows = max(config.token_budget, config.max_num_seqs)
        mc, device, dtype = self.model_config, self.device, self.dtype
        return load_eagle3(model, self.model, mc, max_drafts, rows, device, dtype)

    def _install_lora(self) -> LoraManager:
        """Give every targetable projection its adapter slots (engine_core/lora/), and the
        manager that fills them."""
        config, model_config = self.config, self.model_config
        check_lora_model(model_config)
        if model_config.embedding is not None:
            raise ValueError("--enable-lora: an embedding model serves no LoRA adapters")
        try:
            layers = install_lora(
                self.model,
                target_shapes(model_config),
                config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.device,
                get_tp_group(),
            )
        except torch.cuda.OutOfMemoryError:
            raise ModelTooLargeError(
                f"--max-loras {config.max_loras} LoRA slots of rank {config.max_lora_rank} do "
                "not fit beside the model; lower --max-loras or --max-lora-rank"
            ) from None
        load = partial(load_adapter, config=model_config, max_rank=config.max_lora_rank)
        logger.info(
            "LoRA: %d slots of rank %d (%.1f MiB), %d adapters in host memory",
            config.max_loras,
            config.max_lora_rank,
            sum(layer.num_bytes for layer in layers.values()) / 2**20,
            config.lora_host_capacity,
        )
        share = self.config.tensor_parallel_size > 1  # rank 0's changes go to the workers
        return LoraManager(layers, load, config.max_loras, config.lora_host_capacity, share)

    def _multimodal_runner(self) -> MultimodalRunner | None:
        vision = self.model_config.vision
        if vision is None:
            return None
        if not 0 <= vision.image_token_id < self.model_config.vocab_size:
            # No prompt can hold the placeholder (HF's model could not embed it either): the
            # tower is never run, and a request with images is refused as by a text model.
            logger.warning(
                "the checkpoint's image_token_id %d is outside its vocabulary of %d tokens: "
                "this engine takes no images",
                vision.image_token_id,
                self.model_config.vocab_size,
            )
            return None
        budget = int(self.config.encoder_cache_memory_gb * 2**30)
        call_tokens = encoder_call_tokens(vision, self.config.token_budget, self.max_model_len)
        return MultimodalRunner(self.model, vision, self.device, budget, call_tokens)

    def _init_step_state(self) -> None:
        """What carries from one step to the next: the last step's sampled ids, the ring of
        pinned landing buffers for the ids and their events, the GPU timeline's last end."""
        # The last launched step's sampled ids [S] (on the device) and the request of each row.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sampling: list[Request] = []
        self._scoring: PromptScoring | None = None  # the prompt tokens this step scores
        # A step is collected only after the next one is launched, so two must be live at once.
        self._host_ids = [self._host_ids_buffer(self.config.max_num_seqs) for _ in range(3)]
        self._host_ids_next = 0
        self._done_events = [torch.cuda.Event() for _ in range(3)] if self._on_cuda else []
        # The engine's one stream, for its events: looked up once (each lookup costs the host
        # microseconds a step).
        self._stream = torch.cuda.current_stream(self.device) if self._on_cuda else None
        self._last_gpu_end: torch.cuda.Event | None = None

    # ---- set-up -------------------------------------------------------------------------------

    def _check_state_kind(self) -> None:
        """Warn where the state-snapshot settings keep nothing."""
        if not self.num_state_slots:
            if self.config.state_snapshots:  # sizing only: it changes no output
                logger.warning(
                    "--state-snapshots %d keeps nothing: this model has no linear-attention "
                    "layers, whose states it would save",
                    self.config.state_snapshots,
                )
            return
        if self.config.enable_prefix_caching and not self.num_state_snapshots:
            logger.warning(
                "prefix caching is off for this model: its linear-attention layers need a "
                "saved state at a hit's end, and --state-snapshots 0 keeps none"
            )

    @property
    def _state_tensor_slots(self) -> int:
        """The rows the state tensors hold: the block manager's slots, the graphs' padding
        one, the saved states, and with speculation each slot's draft rows."""
        return self.snapshot_row(self.num_state_snapshots) + self.num_draft_states

    @property
    def num_draft_states(self) -> int:
        """Rows for the states after a verify step's positions but its last (which is the
        slot's), K per slot: the state after any kept draft (forward_context.py
        VerifyPosition)."""
        return self.num_state_slots * self.config.num_drafted_positions()

    def snapshot_row(self, snapshot: int) -> int:
        """The state tensors' row of saved state ``snapshot``: after every slot."""
        return self.num_state_slots + (self.pad_state_slot is not None) + snapshot

    def draft_state_row(self, slot: int, position: int) -> int:
        """The state tensors' row of ``slot``'s state after verify position ``position`` (<
        K): after the saved states."""
        drafts = self.config.num_drafted_positions()
        return self.snapshot_row(self.num_state_snapshots) + slot * drafts + position

    def _copy_states(self, copies: Sequence[StateMove]) -> None:
        """A plan's copies between state slots, saved states and draft rows, before the
        forward, on the engine's stream, outside any graph: in its order where that matters (a
        kept draft's state, then a save of that slot; a save and a later restore of the same
        snapshot, or of the same slot), else a run of them at once, as a decode step at a large
        batch makes (a save every block's steps per request)."""
        moves = []
        for copy in copies:
            if isinstance(copy, KeptDraftState):
                moves.append((self.draft_state_row(copy.slot, copy.position), copy.slot))
                continue
            row = self.snapshot_row(copy.snapshot)
            moves.append((copy.slot, row) if copy.save else (row, copy.slot))
        for run in independent_runs(moves):
            copy_state_rows(self.state_cache, run)

    def _allocate_state_slots(self) -> list[torch.Tensor]:
        """The linear-attention layers' state slots, in the model's dtype: per layer, each
        slot's convolution inputs and recurrent state (models/qwen3_next.py)."""
        if not self.num_state_slots:
            return []
        note = missing_prompt_kernels(self.device)
        if note is not None:
            logger.warning(note)
        tensors = []
        for layer in self.model.linear_attention_layers():
            shapes = layer.state_shapes(self._state_tensor_slots)
            own = [torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes]
            layer.bind_state(*own)
            tensors += own
        logger.info(
            "linear-attention state: %d slots (%.2f GiB)",
            self.num_state_slots,
            sum(t.numel() * t.element_size() for t in tensors) / 2**30,
        )
        return tensors

    def _kv_blocks_that_fit(self) -> int:
        # The state slots come out of the same budget as the blocks (memory_plan.py).
        tp_size = self.config.tensor_parallel_size
        slot = state_slot_bytes(self.model_config, self.dtype, tp_size)
        states = self._state_tensor_slots * slot
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Keep headroom for activations of the largest step and the allocator's slack,
            # a vision model's encoder cache and largest encoder run, and MXFP4 or W4A16 experts'
            # dequantize scratch (memory_plan.py).
            budget = self.config.gpu_memory_utilization * total - used - CUDA_HEADROOM_BYTES
            budget -= encoder_bytes(self.config, self.model_config, self.dtype, self.max_model_len)
            budget -= expert_scratch_bytes(self.model_config, self.device, self.dtype)
        else:
            budget = self.config.kv_cache_memory_gb * 2**30
        if states >= budget:
            raise ValueError(
                f"--max-num-seqs {self.num_state_slots} linear-attention state slots and "
                f"{self.num_state_snapshots} saved states (--state-snapshots) need "
                f"{states / 2**30:.2f} GiB, all the KV cache's memory or more; lower "
                "--max-num-seqs or --state-snapshots, or give the cache more memory"
            )
        budget -= states
        block = kv_block_bytes(
            self.model_config, self.num_kv_heads, self.block_size, self.kv_dtype, self.kv_layout
        )
        if self.drafter is not None:  # a block id holds the draft's K and V too
            block += self.drafter.block_bytes(self.block_size)
        blocks = int(budget // block)
        one_sequence = pool_blocks_for_one_sequence(
            self.kv_layout, self.max_model_len, self.block_size, self.config.token_budget
        )
        if blocks < one_sequence:
            raise ValueError(
                f"the KV cache fits only {blocks} blocks of {self.block_size} tokens, fewer than "
                f"one sequence of {self.max_model_len} tokens needs; lower --max-model-len (or "
                "--block-size, whose blocks are whole) or give the cache more memory"
            )
        return blocks

    def _allocate_kv_cache(self) -> torch.Tensor | list[torch.Tensor]:
        layers = self.model.attention_layers()
        if any(type(layer) is not Attention for layer in layers):
            return self._allocate_layer_caches(layers)
        mc, layout = self.model_config, self.kv_layout
        # [group_size, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]: layer j of every
        # group uses pair j (kv_groups.py); with one group, pair i is layer i.
        shape = (
            layout.group_size,
            2,
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
        )
        cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        # A pipeline stage's layers are numbered as in the model, from its first.
        for i, layer in enumerate(layers, start=self.stage_layers.start):
            group, pair = layout.placement(i)
            kind = layout.groups[group]
            if (layer.sliding_window, layer.attention_chunk) != (kind.window, kind.attention_chunk):
                raise ValueError(
                    f"layer {i} attends through a window of {layer.sliding_window} and chunks "
                    f"of {layer.attention_chunk} but the config puts it in a group of window "
                    f"{kind.window} and chunks of {kind.attention_chunk}"
                )
            layer.k_cache, layer.v_cache = cache[pair, 0], cache[pair, 1]
            layer.kv_group = group
        self._log_kv_cache(cache.numel() * cache.element_size())
        return cache

    def _allocate_layer_caches(self, layers: list[torch.nn.Module]) -> list[torch.Tensor]:
        """Caches of the shapes each layer declares (``cache_shapes``: MLA's latent rows), one
        tensor each, all with the same blocks: the block manager's ids index every layer."""
        if len(self.kv_layout.groups) > 1:
            raise ValueError(
                "layer groups (sliding-window layers beside full ones) are supported for plain "
                "K/V attention only, not for this model's cache layout"
            )
        tensors = []
        for layer in layers:
            shapes = layer.cache_shapes(self.num_kv_blocks, self.block_size)
            own = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for shape in shapes]
            layer.bind_cache(own)
            tensors += own
        self._log_kv_cache(sum(t.numel() * t.element_size() for t in tensors))
        return tensors

    def _allocate_host_kv(self) -> HostKVPool | None:
        """The host KV tier's slots: as many blocks as --kv-offload-gb holds, every layer of a
        block together (the block manager keeps its bookkeeping, engine_core/kv_offload.py).
        The gigabytes are the engine's: under tensor parallelism each rank holds its shard of
        every slot, and a pipeline stage's ranks their layers' part of it (the slots are
        counted from the whole model's block), so all ranks have the same slots."""
        gb = self.config.kv_offload_gb
        if not gb:
            return None
        layout = self.kv_layout
        plain = isinstance(self.kv_cache, torch.Tensor)
        if len(layout.groups) > 1 or layout.gives_back or layout.state_layers or not plain:
            raise ValueError(
                "--kv-offload-gb supports models whose layers are all plain full attention "
                "(no sliding-window, chunked, linear-attention or latent (MLA) layers)"
            )
        assert isinstance(self.kv_cache, torch.Tensor)
        block = kv_block_bytes(self.model_config, self.num_kv_heads, self.block_size, self.kv_dtype)
        slots = int(gb * 2**30 // (block * self.config.tensor_parallel_size))
        if slots < 1:
            raise ValueError(f"--kv-offload-gb {gb} holds no KV block ({block} bytes each)")
        pool = HostKVPool(self.kv_cache, slots)
        logger.info(
            "host KV tier: %d blocks x %d tokens (%.2f GiB%s)",
            slots,
            self.block_size,
            pool.num_bytes / 2**30,
            ", pinned" if self._on_cuda else "",
        )
        return pool

    @property
    def num_host_kv_blocks(self) -> int:
        """Slots of the host KV tier (0: none)."""
        return 0 if self.host_kv is None else self.host_kv.host.shape[0]

    def _log_kv_cache(self, num_bytes: int) -> None:
        layout, groups = self.kv_layout, ""
        if len(layout.groups) > 1 or layout.gives_back:  # kv_groups.py: a block is one layer
            groups = (  # of each group
                f", {len(layout.groups)} layer group(s) of {layout.group_size} layers, "
                f"windows {list(layout.windows)}, attention chunks {list(layout.attention_chunks)}"
            )
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB)%s",
            self.num_kv_blocks,
            self.block_size,
            num_bytes / 2**30,
            groups,
        )

    def _set_kv_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """An FP8 cache's per-layer K and V scales: the checkpoint's, or 1.0 where it has none
        (e4m3 reaches 448, far beyond the K/V values of the models we serve). A plain cache
        stores K and V as they are and reads no scale."""
        if self.kv_dtype != FP8_DTYPE:
            return
        for i, layer in enumerate(self.model.attention_layers(), start=self.stage_layers.start):
            layer.k_scale, layer.v_scale = scales.get(i, (1.0, 1.0))
        logger.info(
            "FP8 KV cache, scales %s", "from the checkpoint" if scales else "1.0 (none given)"
        )

    def step_failed(self, error: BaseException) -> None:
        """A step raised ``error``. One process can go on (the server fails the step's requests);
        a tensor-parallel rank 0 cannot, and ends its process (tp_runner.py)."""

    def can_step_after_a_cut(self) -> bool:
        """A step was cut by an exception (Ctrl-C included) in the offline API, which goes on
        in this process: whether another step can run. One process: yes."""
        return True

    def announce_stop(self) -> None:
        """The engine stops for good (a signal; no restart follows): tell whoever would wait
        for its next start (other nodes: tp_runner.py). Nothing here."""

    def shutdown(self) -> None:
        """Release what outlives the object (tensor-parallel workers; here the LoRA reader)."""
        if self.loras is not None:
            self.loras.shutdown()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run the dummy steps that reach what a first request would otherwise load and allocate
        on its own time (engine_core/warm_up.py), with a sampler of their own: the engine's
        seeded generator draws nothing for them."""
        started = time.perf_counter()
        mc = self.model_config
        plans = self.warm_up_plans()
        if not plans:  # no prompt fits --max-model-len: this engine serves nothing anyway
            return
        words = -(-mc.vocab_size // 32)

        def allow_all(rows: list[Request]) -> torch.Tensor:
            return torch.full((len(rows), words), -1, dtype=torch.int32)  # every bit set

        sampler, self.sampler = self.sampler, Sampler(mc.eos_token_ids, mc.vocab_size, seed=0)
        try:
            for plan in plans:
                self._warm_up_step(plan, allow_all)
        finally:
            self.sampler = sampler
            self._prev_sampled, self._prev_sampling = None, []
            if self.multimodal is not None:  # no request may hit the blank image
                self.multimodal.forget()
            self.mark_idle()  # the wait for the first request is no step's overhead
        logger.info(
            "warm-up: %d steps (up to %d tokens, %d rows) in %.0f ms",
            len(plans),
            max(plan.num_batched_tokens for plan in plans),
            max(len(plan.scheduled) for plan in plans),
            1e3 * (time.perf_counter() - started),
        )

    def warm_up_plans(self) -> list[SchedulerOutput]:
        """The steps ``warm_up`` runs, within this engine's limits and KV cache."""
        limits = StepLimits(
            budget=self.config.token_budget,
            max_rows=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            vocab_size=self.model_config.vocab_size,
        )
        plans = (
            pooling_warm_up_plans(limits)
            if self.pooler is not None
            else warm_up_plans(limits, PROMPT_LOGITS_ROWS)
        )
        image_plan = self._image_warm_up_plan(limits)
        plans += [image_plan] if image_plan is not None else []
        for plan in plans if self.num_state_slots else ():
            for i, row in enumerate(plan.scheduled):  # no more rows than slots (max_num_seqs)
                row.state_slot = i
        return plans

    def _image_warm_up_plan(self, limits: StepLimits) -> SchedulerOutput | None:
        vision = self.model_config.vision
        if self.multimodal is None or vision is None or self.pooler is not None:
            return None
        most = min(self.multimodal.call_tokens, limits.max_model_len - 1 - SHORT_PROMPT)
        image = warm_up_image(vision, most)
        if image is None:
            return None
        run = placeholder_run(image, vision)
        return image_warm_up_plan(limits, image, run, vision.bidirectional_images)

    def _warm_up_step(
        self, plan: SchedulerOutput, masks: Callable[[list[Request]], torch.Tensor]
    ) -> None:
        try:
            step = self.forward(plan)
            self.collect(self.sample(step, masks(step.sampling_requests)))
        except torch.cuda.OutOfMemoryError as exc:
            # A step this large would fail the same way in the middle of serving.
            raise ModelTooLargeError(
                f"a step of {plan.num_batched_tokens} tokens and {len(plan.scheduled)} "
                f"sequences (--max-num-batched-tokens {self.config.token_budget}, "
                f"--max-num-seqs {self.config.max_num_seqs}) runs out of GPU memory beside the "
                "model and its KV cache; try a smaller --max-num-batched-tokens or "
                "--max-num-seqs, a lower --gpu-memory-utilization or a smaller --num-kv-blocks"
            ) from exc

    # ---- CUDA graphs (engine_core/cuda_graph.py) -----------------------------------------------

    def _capture_graphs(self) -> CudaGraphRunner | None:
        """Capture the decode and prefill graphs at start-up on CUDA (after the KV cache exists:
        graphs bake in its addresses); None on the CPU or when ``enforce_eager`` is set."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.config.pipeline_parallel_size > 1:
            # A stage's forward receives and sends activations and rank 0's receives logits
            # from the last stage; no graph captures those yet (docs/design/multi-node.md).
            logger.warning("--pipeline-parallel-size > 1: running without CUDA graphs for now")
            return None
        if self.config.enable_expert_parallel:
            # The all-to-all's split sizes are host integers read back each MoE layer
            # (models/expert_dispatch.py); no fixed-capacity dispatch yet.
            logger.warning("--enable-expert-parallel: running without CUDA graphs for now")
            return None
        if self.model_config.embedding is not None:
            # Embedding engines run eagerly (for now): their steps are prompt chunks, and the
            # decode graphs would compute logits that they never read, with no head for them.
            return None
        if not all(getattr(module, "cuda_graph_safe", True) for module in self.model.modules()):
            # gpt-oss's experts run code that reads host values (no fused kernels for its bf16
            # experts yet): every step runs eagerly.
            logger.warning("%s runs without CUDA graphs for now", type(self.model).__name__)
            return None
        if not getattr(self.backend, "cuda_graph_safe", False):
            logger.warning("the attention backend reads host values; running decode eagerly")
            return None
        from engine_core.cuda_graph import (
            CudaGraphRunner,
            prefill_graph_bounds,
            verify_graph_queries,
        )

        max_prefill_tokens, extend_prefill_to = prefill_graph_bounds(
            self.config.max_prefill_graph_tokens,
            self.config.token_budget,
            self.config.tensor_parallel_size,
        )
        spec = self.config.speculation()
        # Verify steps of K drafts get graphs of their own where the verify kernel serves every
        # layer (docs/design/speculative-decoding.md).
        drafts = 0 if spec is None else spec.num_speculative_tokens
        verify_queries = verify_graph_queries(self.model, self.backend, drafts) if drafts else 0
        if not all(getattr(module, "prompt_graphs_safe", True) for module in self.model.modules()):
            # DeepSeek's latent attention: its decode steps read no host value, its prompt
            # steps do (attention/triton_mla.py); nor do Qwen3-Next's linear-attention layers,
            # whose prompt chunks loop on the host (models/qwen3_next.py).
            logger.info("%s: prompt steps run eagerly", type(self.model).__name__)
            max_prefill_tokens, extend_prefill_to, verify_queries = 0, 0, 0
        runner = CudaGraphRunner(
            self.model,
            self.backend,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            hidden_size=self.model_config.hidden_size,
            dtype=self.dtype,
            device=self.device,
            max_prefill_tokens=max_prefill_tokens,
            extend_prefill_to=extend_prefill_to,
            vocab_size=self.model_config.vocab_size,
            lora_slots=self.config.max_loras if self.loras is not None else 0,
            verify_queries=verify_queries,
            num_kv_groups=len(self.kv_layout.groups),
            state_tensors=self.state_cache,
            pad_state_slot=self.pad_state_slot,
        )
        runner.capture()
        if self.drafter is not None:  # its forwards replay where the target's do
            self.drafter.capture_graphs(
                self.config.max_num_seqs, self.max_model_len, runner.max_prefill_tokens
            )
        return runner

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The model's forward: a graph replay for a step that fits one, else eager (always
        for a step with image rows: their embeddings and 3D positions are not graph inputs)."""
        graphs = self.graph_runner is not None and inputs.multimodal is None
        self._replayed_decode_graph = False
        if graphs and self.graph_runner.can_run(inputs.meta):
            self._replayed_decode_graph = inputs.meta.is_decode_only
            return self.graph_runner.run(
                inputs.input_ids, inputs.positions, inputs.meta, inputs.ids_from, inputs.lora,
                inputs.group_metadata, inputs.state,
            )  # fmt: skip
        if inputs.ids_from is not None:
            inputs.input_ids.copy_(inputs.ids_from)
        key_ends = None if inputs.multimodal is None else inputs.multimodal.key_ends
        with forward_context(
            inputs.meta, self.backend, inputs.lora, inputs.group_metadata, inputs.state, key_ends
        ):
            if inputs.multimodal is not None:
                return self.model(inputs.input_ids, inputs.positions, inputs.multimodal)
            return self.model(inputs.input_ids, inputs.positions)

    def _step_shape(self, out: SchedulerOutput) -> StepShape:
        """The step just launched as its attention saw it (engine_core/profiler.py)."""
        graph_rows = self.graph_runner.last_decode_rows if self._replayed_decode_graph else 0
        return StepShape.of(out, graph_rows, self.input_batch.shared_tokens)

    def attention_facts(self) -> dict[str, Any]:
        """What a replay of this rank's attention needs to launch it as it ran (the profiler's
        steps file): heads, pages, the block tables' width, the cache's dtype, and whether
        every layer is plain causal attention (no window, chunk, latent attention, linear
        attention or sinks), the kind the replay runs."""
        mc, layout = self.model_config, self.kv_layout
        plain = (
            len(layout.groups) == 1
            and layout.windows == (None,)
            and layout.attention_chunks == (None,)
            and mc.mla is None
            and mc.linear_attention is None
            and not mc.attention_sinks
        )
        return {
            "model": self.config.model,
            "heads": mc.num_heads // self.config.tensor_parallel_size,
            "kv_heads": self.num_kv_heads,
            "head_dim": mc.head_dim,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "plain_attention": plain,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
        }

    def _draft_alongside(
        self, out: SchedulerOutput, inputs: ModelInputs, hidden: torch.Tensor
    ) -> None:
        """The draft model's forward over the step's inputs (a graph replay of the target's
        may have left the ids to gather in ``ids_from``); the EAGLE-3 head's over the step's
        positions, from the target's hidden states; the MTP layer's, from ``hidden`` (the
        target's final hidden states)."""
        assert self.drafter is not None
        if isinstance(self.drafter, Eagle3Proposer):
            self.drafter.run_alongside(out, inputs.meta)
            return
        if isinstance(self.drafter, MtpProposer):
            self.drafter.run_alongside(out, inputs.meta, hidden)
            return
        self.drafter.run_alongside(inputs.input_ids, inputs.positions, inputs.meta, inputs.ids_from)

    # ---- one step -----------------------------------------------------------------------------

    @property
    def _on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _host_ids_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int64, pin_memory=self._on_cuda)  # [size]

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        """Flatten the scheduled requests into one batch of tokens and attention metadata."""
        packed = self.input_batch.pack(out, self._prev_sampling, self._prev_sampled)
        self._output_positions = packed.output_positions
        rows: list[int] = []
        self._scoring = None
        if out.prompt_logprob_seqs:
            rows, self._scoring = plan_prompt_scoring(out, packed.meta.query_start_loc_cpu)
        inputs = model_inputs(packed, prompt_rows_on(rows, self.device), rows or None)
        if self.loras is not None:
            slots = self._lora_slots(out)
            inputs.lora = self._lora_rows(slots, packed.meta.query_start_loc_cpu)
        if self.num_state_slots:
            scheduled = out.scheduled
            inputs.state = StateRows.plan(
                [s.state_slot for s in scheduled],
                [s.start == 0 for s in scheduled],
                packed.meta.query_start_loc_cpu,
                self.device,
                [len(s.drafts) for s in scheduled],
                self.draft_state_row,
            )
        if self.multimodal is not None:
            step = self.multimodal.prepare(out, packed.meta.query_start_loc_cpu)
            if step is not None and not step.rows.numel():
                # No image rows: every row's three M-RoPE positions are equal, where M-RoPE is
                # plain RoPE at that position, so the step runs as any other (graphs too).
                if step.positions is not None:
                    inputs.positions = step.positions[0]
            else:
                inputs.multimodal = step
        return inputs

    def _lora_slots(self, out: SchedulerOutput) -> list[int]:
        """The adapter slot of each scheduled request, in row order (NO_SLOT: the base)."""
        assert self.loras is not None
        return [self.loras.slot_of(s.request.request_id) for s in out.scheduled]

    def _lora_rows(self, slots: list[int], query_start: list[int]) -> LoraBatch | None:
        """Which of the step's rows use which adapter slot (None: only the base model's), laid
        out for the graphs' static tile table where there are graphs."""
        row_slots = [(query_start[i + 1] - query_start[i], slot) for i, slot in enumerate(slots)]
        graph_tiles = self.graph_runner.lora_tiles if self.graph_runner is not None else 0
        return lora_batch(row_slots, self.device, min_tiles=graph_tiles)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one unconstrained step and wait for its sampled ids."""
        return self.collect(self.sample(self.forward(out)))

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> ForwardStep:
        """Enqueue one step's inputs, forward and sampling logits (and score prompt tokens)."""
        stats = self.stats
        timeline = GpuTimeline() if stats.enabled and self._on_cuda else None
        self.input_batch.timeline = timeline  # the input copy is the first stretch
        with stats.phase("prepare"):
            if out.kv_moves is not None:
                assert self.host_kv is not None
                self.host_kv.apply(out.kv_moves)  # before this step writes or reads the blocks
            if out.state_copies:
                self._copy_states(out.state_copies)  # before this step reads the slots
            inputs = self.prepare_inputs(out)
        with stats.phase("forward"):
            if timeline is not None:
                timeline.begin()
            hidden = self._forward(inputs)  # [T, hidden]; before the last stage [2, T, hidden]
            if self.step_shapes is not None:  # once launched: the host's work beside the GPU's
                self.step_shapes.append(self._step_shape(out))
            if self.drafter is not None:  # the draft's KV follows the target's, slot for slot
                self._draft_alongside(out, inputs, hidden)
            if timeline is not None:
                timeline.end()
        requests = inputs.sampling_requests
        step = ForwardStep(out, requests, self._output_positions, None, None, timeline)
        if not self.stage.is_last:
            # The logits come from the last stage once this one's output is handed on, which
            # the engine core may do after settling the oldest step (core.py _step_pipelined).
            rows = inputs.logits_indices.clone()
            step.handoff = StageHandoff(hidden, rows, inputs.prompt_rows, self._scoring)
            return step
        if self.pooler is not None:
            step.pooled = self.pooler.pool(out, hidden, inputs.meta.query_start_loc_cpu)
        if inputs.prompt_rows is not None and self._scoring is not None:
            step.prompt_logprobs = self._score_prompts(hidden, inputs.prompt_rows, self._scoring)
        sampling_logits = None
        if any(s.drafts for s in out.scheduled):
            # The sampling rows' logits come out of the drafted rows' product: one pass over
            # the LM head's weights a verify step, not two.
            sampling_rows = inputs.logits_indices if requests else None
            step.drafted, sampling_logits = self._drafted_rows(
                out, hidden, inputs.meta.query_start_loc_cpu, sampling_rows
            )
        if requests:
            with stats.phase("sample"):
                if timeline is not None:
                    timeline.begin()  # the sampler's stretch ends with the copy back
                if sampling_logits is not None:
                    step.logits, step.argmax = sampling_logits, None
                else:
                    step.logits, step.argmax = self._logits(hidden, inputs)
        return step

    @torch.inference_mode()
    def sample(
        self,
        step: ForwardStep,
        bitmask: torch.Tensor | None = None,
        draft_bitmask: torch.Tensor | None = None,
    ) -> LaunchedStep:
        """Enqueue the sampler over ``step``'s logits (masked by the structured-output
        ``bitmask`` of its sampling rows, if any; its drafted positions' by ``draft_bitmask``)
        and the copy of its ids to the host."""
        if step.handoff is not None:
            self._take_logits(step)
        # This step's slot in the ring of host landing buffers and their events.
        self._host_ids_next = (self._host_ids_next + 1) % len(self._host_ids)
        requests = step.sampling_requests
        if not requests:
            self._prev_sampled, self._prev_sampling = None, []
            launched = self._launched(step.plan, requests, None, None, step.timeline)
            launched.prompt_logprobs = step.prompt_logprobs
            launched.pooled = step.pooled
            return self._timed(launched)
        assert step.logits is not None
        checks = None
        with self.stats.phase("sample"):
            sampled = self.sampler(
                step.logits, requests, step.output_positions, bitmask, step.argmax
            )
            if step.drafted is not None:  # enqueued before the step's event, as its copy must
                checks = self._check_drafts(step.drafted, draft_bitmask)
        # The next step gathers its placeholder ids from here, on the device.
        self._prev_sampled = sampled.token_ids
        self._share_sampled(sampled.token_ids)
        self._prev_sampling = requests
        with self.stats.phase("to_host"):
            launched = self._to_host(step.plan, sampled, requests, step.timeline)
        launched.prompt_logprobs = step.prompt_logprobs
        launched.constrained = bitmask is not None
        launched.draft_checks = checks
        if step.timeline is not None:
            step.timeline.end()
        return self._timed(launched)

    def hand_on(self, step: ForwardStep) -> None:
        """Send a step's first-stage output on to the next pipeline stage (once; nothing to do
        without stages)."""
        handoff = step.handoff
        if handoff is not None and not handoff.sent:
            self.stage.send_activations(handoff.activations)
            handoff.sent = True

    def _take_logits(self, step: ForwardStep) -> None:
        """Rank 0 of a pipeline: hand the step on, then receive what the last stage computes
        for it, in the order it sends them (tp_runner.py TPWorker.follow): the scored prompt
        rows' logits, then the sampling rows'."""
        handoff = step.handoff
        assert handoff is not None
        self.hand_on(step)
        hidden = handoff.hidden
        if handoff.prompt_rows is not None and handoff.scoring is not None:
            step.prompt_logprobs = self._score_prompts(hidden, handoff.prompt_rows, handoff.scoring)
        if step.sampling_requests:
            if step.timeline is not None:
                step.timeline.begin()  # the sampler's stretch, as forward begins it unstaged
            step.logits = self.model.compute_logits(hidden[handoff.logits_indices], widen=False)
        step.handoff = None

    def _drafted_rows(
        self,
        out: SchedulerOutput,
        hidden: torch.Tensor,
        query_start: list[int],
        sampling_rows: torch.Tensor | None = None,
    ) -> tuple[DraftedRows, torch.Tensor | None]:
        """The logits at every drafted row's positions but its last (which samples as usual),
        and in the same product those of ``sampling_rows`` [S] (the step's sampling rows), if
        given. Row j draws the token at index start + 1 + j of its request, whose penalties
        count only the tokens before that index (not the later drafts, nor the placeholder
        after them)."""
        counts: list[int] = []
        requests: list[Request] = []
        positions: list[int] = []
        ahead: list[int] = []
        rows = drafted_row_indices(out, query_start)
        for s in out.scheduled:
            if s.drafts:
                num = len(s.drafts)
                counts.append(num)
                requests += [s.request] * num
                drawn = range(s.start + 1, s.start + 1 + num)  # the indices the rows draw
                positions += [index - s.request.num_prompt_tokens for index in drawn]
                ahead += [len(s.request.token_ids) - index for index in drawn]
        index = torch.tensor(rows, dtype=torch.int64).to(self.device)
        if sampling_rows is not None:
            index = torch.cat((index, sampling_rows))
        logits = self.model.compute_logits(hidden[index], widen=False)  # [D (+ S), V']
        drafted = DraftedRows(logits[: len(rows)], counts, requests, positions, ahead)
        return drafted, None if sampling_rows is None else logits[len(rows) :]

    def _check_drafts(self, rows: DraftedRows, bitmask: torch.Tensor | None) -> DraftChecks:
        """The target's token at each drafted position, drawn as the non-speculative step would
        draw it there, so a draft is kept exactly when the target's own token equals it
        (engine_core/speculative.py)."""
        sampled = self.sampler(
            rows.logits, rows.requests, rows.positions, bitmask, ahead=rows.ahead
        )
        lps = None
        if sampled.logprobs is not None:
            lps = (sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs)
        if self._on_cuda:  # copied behind the step's event, with the sampled ids
            return DraftChecks(
                _copy_to_pinned(sampled.token_ids),
                rows.counts,
                rows.requests,
                None if lps is None else tuple(_copy_to_pinned(t) for t in lps),
            )
        return DraftChecks(sampled.token_ids, rows.counts, rows.requests, lps)

    def _logits(
        self, hidden: torch.Tensor, inputs: ModelInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling rows' logits [S, V'] in the weights' dtype (the sampler widens what
        needs more than an argmax), and their argmax [S] where the decode graph computed both
        (engine_core/cuda_graph.py DecodeTail), else None."""
        tail = self.graph_runner.take_tail() if self.graph_runner is not None else None
        # A decode graph's rows are the step's sequences; here each one samples (a one-token
        # prompt chunk short of its prompt's end would not).
        if tail is not None and tail[0].shape[0] == len(inputs.sampling_requests):
            return tail
        return self.model.compute_logits(hidden[inputs.logits_indices], widen=False), None

    def _share_sampled(self, token_ids: torch.Tensor) -> None:
        """Hand a step's sampled ids [S] to whoever else gathers placeholders from them: nobody
        here; the other ranks under tensor parallelism (engine_core/tp_runner.py)."""

    def _score_prompts(
        self, hidden: torch.Tensor, rows: torch.Tensor, scoring: PromptScoring
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """The logprob of each scored prompt token (and the top N at its position), on the
        host. It waits for this step's forward: prompt logprobs are for evaluation, not speed."""
        top_n = max(r.params.prompt_logprobs or 0 for r in scoring.requests)
        targets = torch.tensor(scoring.targets, dtype=torch.int64, device=self.device)
        chosen, ranks, top_ids, top_lps = [], [], [], []
        for part, goal in zip(
            rows.split(PROMPT_LOGITS_ROWS), targets.split(PROMPT_LOGITS_ROWS), strict=True
        ):
            logprobs = self.model.compute_logits(hidden[part]).log_softmax(dim=-1)  # [n, V]
            chosen.append(logprobs.gather(1, goal[:, None]).squeeze(1))
            ranks.append((logprobs >= chosen[-1][:, None]).sum(dim=-1))
            if top_n:
                lps, ids = logprobs.topk(top_n, dim=-1)
                top_lps.append(lps)
                top_ids.append(ids)
            # Freed before the next chunk's logits exist: one chunk's [n, V] blocks at a time,
            # as the warm-up (engine_core/warm_up.py) allocated them.
            del logprobs
        return split_prompt_logprobs(scoring, chosen, ranks, top_ids, top_lps)

    def _timed(self, step: LaunchedStep) -> LaunchedStep:
        """Chain the step's GPU timeline (step stats) to the previous step's, for the gap."""
        if step.timeline is not None:
            step.gpu_prev_end, self._last_gpu_end = self._last_gpu_end, step.timeline.last
        return step

    def _to_host(
        self,
        out: SchedulerOutput,
        sampled: SamplerOutput,
        requests: list[Request],
        timeline: GpuTimeline | None,
    ) -> LaunchedStep:
        """Enqueue the step's single device-to-host copy (ids, and logprobs when any row asked),
        into pinned memory on CUDA; ``collect`` reads it once the step's event has completed."""
        if not self._on_cuda:  # the CPU computed it all already: nothing to copy
            lps = None
            if sampled.logprobs is not None:
                lps = (sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs)
            return self._launched(out, requests, sampled.token_ids, lps, timeline)
        num = len(requests)
        if self._host_ids[self._host_ids_next].numel() < num:
            self._host_ids[self._host_ids_next] = self._host_ids_buffer(num)
        host_ids = self._host_ids[self._host_ids_next][:num]
        host_ids.copy_(sampled.token_ids, non_blocking=True)
        lps = None
        if sampled.logprobs is not None:
            lps = tuple(
                _copy_to_pinned(t)
                for t in (sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs)
            )
        return self._launched(out, requests, host_ids, lps, timeline)

    def _launched(
        self,
        out: SchedulerOutput,
        requests: list[Request],
        host_ids: torch.Tensor | None,
        logprobs: tuple[torch.Tensor, ...] | None,
        timeline: GpuTimeline | None,
    ) -> LaunchedStep:
        done = None
        if self._on_cuda:
            done = self._done_events[self._host_ids_next]
            done.record(self._stream)
        return LaunchedStep(out, requests, host_ids, logprobs, done, timeline)

    def mark_idle(self) -> None:
        """The engine has nothing to run: the next step's GPU gap is idleness, not overhead."""
        self._last_gpu_end = None

    def collect(self, step: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's copy (its event only: no device-wide sync) and read it."""
        with self.stats.phase("wait"):
            if step.done is not None:
                step.done.synchronize()
        if step.timeline is not None and step.timeline.first is not None:
            gap = None
            if step.gpu_prev_end is not None:
                gap = step.gpu_prev_end.elapsed_time(step.timeline.first)
            busy, inner_idle = step.timeline.busy_and_idle_ms()
            self.stats.add_gpu(busy, inner_idle, gap)
        if step.token_ids is None:
            pooled = Pooler.to_host(step.pooled) if step.pooled is not None else None
            return RunnerOutput([], [], pooled)
        token_ids = step.token_ids.tolist()
        if step.logprobs is None:
            logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        else:
            logprobs = _logprobs_per_row(step.logprobs, step.sampling_requests)
        result = RunnerOutput(token_ids, logprobs)
        if step.draft_checks is not None:
            result.draft_checks, result.draft_logprobs = step.draft_checks.per_row()
        return result


def drafted_row_indices(out: SchedulerOutput, query_start: Sequence[int]) -> list[int]:
    """The step's rows whose logits check drafts: each drafted row's positions but its last
    (which samples as usual), in schedule order."""
    rows: list[int] = []
    for i, s in enumerate(out.scheduled):
        if s.drafts:
            rows += range(query_start[i], query_start[i] + len(s.drafts))
    return rows


def model_inputs(
    packed: PackedInputs, prompt_rows: torch.Tensor | None, prompt_rows_cpu: list[int] | None
) -> ModelInputs:
    """A packed step (engine_core/input_batch.py) and its prompt-scoring rows as the forward's
    inputs."""
    return ModelInputs(
        input_ids=packed.input_ids,
        positions=packed.positions,
        meta=packed.meta,
        logits_indices=packed.logits_indices,
        sampling_requests=packed.sampling_requests,
        prompt_rows=prompt_rows,
        prompt_rows_cpu=prompt_rows_cpu,
        ids_from=packed.ids_from,
        group_metadata=packed.group_metadata,
    )


def copy_state_rows(tensors: Sequence[torch.Tensor], moves: list[tuple[int, int]]) -> None:
    """Copy row ``src`` of every tensor to row ``dst`` for each (src, dst) of ``moves``, which
    must be independent (``independent_runs``): one copy per tensor and move for one or two,
    else a gather and a scatter per tensor, the row ids sent from pinned memory without
    waiting for the stream (a pageable copy would)."""
    if len(moves) <= 2:
        for src, dst in moves:
            for tensor in tensors:
                tensor[dst].copy_(tensor[src])
        return
    rows = torch.tensor(list(zip(*moves, strict=True)), dtype=torch.int64)  # [2, n]: src, dst
    device = tensors[0].device
    if device.type == "cuda":
        rows = rows.pin_memory().to(device, non_blocking=True)
    for tensor in tensors:
        tensor.index_copy_(0, rows[1], tensor.index_select(0, rows[0]))


def prompt_rows_on(rows: list[int] | None, device: torch.device) -> torch.Tensor | None:
    """The rows that score prompt tokens as a [P] int64 tensor on ``device`` (None: no rows)."""
    return torch.tensor(rows, dtype=torch.int64).to(device) if rows else None


def plan_prompt_scoring(
    out: SchedulerOutput, query_start: list[int]
) -> tuple[list[int], PromptScoring]:
    """The batch rows whose logits score prompt tokens, and what they score. Position p scores
    prompt token p + 1; positions scored before a preemption are not scored again."""
    rows: list[int] = []
    scoring = PromptScoring([], [], [], [])
    for seq in out.prompt_logprob_seqs:
        s = out.scheduled[seq]
        request = s.request
        lo = max(s.start, len(request.prompt_logprobs))
        hi = min(s.start + s.num_new_tokens, request.num_prompt_tokens - 1)
        if hi <= lo:
            continue
        row_of_start = query_start[seq] - s.start
        rows += range(row_of_start + lo, row_of_start + hi)
        scoring.requests.append(request)
        scoring.first_positions.append(lo)
        scoring.counts.append(hi - lo)
        scoring.targets += request.prompt_token_ids[lo + 1 : hi + 1]
    return rows, scoring


def split_prompt_logprobs(
    scoring: PromptScoring,
    chosen: list[torch.Tensor],
    ranks: list[torch.Tensor],
    top_ids: list[torch.Tensor],
    top_lps: list[torch.Tensor],
) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """The scored rows' logprobs and ranks, back on the host, per request (each its own top
    N)."""
    values = torch.cat(chosen).tolist()
    rank_values = torch.cat(ranks).tolist()
    ids = torch.cat(top_ids).tolist() if top_ids else None
    lps = torch.cat(top_lps).tolist() if top_lps else None
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    row = 0
    for request, first, count in zip(
        scoring.requests, scoring.first_positions, scoring.counts, strict=True
    ):
        n = request.params.prompt_logprobs or 0
        entries = [
            TokenLogprobs(
                values[i],
                ids[i][:n] if ids and n else [],
                lps[i][:n] if lps and n else [],
                rank_values[i],
            )
            for i in range(row, row + count)
        ]
        out[request.request_id] = (first, entries)
        row += count
    return out


def _copy_to_pinned(tensor: torch.Tensor | None) -> torch.Tensor | None:
    if tensor is None:
        return None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def _logprobs_per_row(
    tensors: tuple[torch.Tensor | None, ...], requests: list[Request]
) -> list[TokenLogprobs | None]:
    chosen_t, top_ids_t, top_lps_t = tensors
    assert chosen_t is not None
    chosen = chosen_t.tolist()
    top_ids = top_ids_t.tolist() if top_ids_t is not None else None
    top_lps = top_lps_t.tolist() if top_lps_t is not None else None
    logprobs: list[TokenLogprobs | None] = []
    for row, request in enumerate(requests):
        n = request.params.logprobs
        if n is None:
            logprobs.append(None)
            continue
        ids = top_ids[row][:n] if top_ids and n else []
        lps = top_lps[row][:n] if top_lps and n else []
        logprobs.append(TokenLogprobs(chosen[row], ids, lps))
    return logprobs
