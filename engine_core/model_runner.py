"""The model runner: owns the weights, the KV-cache tensors and the attention backend.

It turns a SchedulerOutput into one flattened forward (prefills, prompt chunks, cached-prefix
prefills and decodes together), samples the rows that reached the end of their known tokens, and
copies the sampled ids to the host once per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core.attention.base import AttentionBackend, AttentionMetadata
from engine_core.config import EngineConfig, ModelConfig
from engine_core.forward_context import forward_context
from engine_core.loader import load_model
from engine_core.request import Request, SchedulerOutput
from engine_core.sampler import Sampler, SamplerOutput
from protocol.messages import TokenLogprobs

if TYPE_CHECKING:
    from engine_core.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: the last row of each sequence that samples
    sampling_requests: list[Request]


@dataclass
class RunnerOutput:
    sampled_token_ids: list[int]  # one per sampling request, in schedule order
    logprobs: list[TokenLogprobs | None]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


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


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        loaded = load_model(config.model, self.device, self.dtype)
        self.model = loaded.module
        self.model_config: ModelConfig = loaded.config
        self.model_dir = loaded.model_dir
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks or self._kv_blocks_that_fit()
        self.kv_cache = self._allocate_kv_cache()
        self.backend = select_backend(self.device)
        self.graph_runner = self._capture_graphs()  # None on the CPU or with enforce_eager
        self.sampler = Sampler(
            self.model_config.eos_token_ids, self.model_config.vocab_size, seed=config.seed
        )

    # ---- set-up -------------------------------------------------------------------------------

    def _block_bytes(self) -> int:
        mc = self.model_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def _kv_blocks_that_fit(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Keep headroom for activations of the largest step and the allocator's slack.
            headroom = 2 * 2**30
            budget = self.config.gpu_memory_utilization * total - used - headroom
        else:
            budget = self.config.kv_cache_memory_gb * 2**30
        blocks = int(budget // self._block_bytes())
        max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        if blocks < max_blocks_per_seq:
            raise ValueError(
                f"the KV cache fits only {blocks} blocks of {self.block_size} tokens, fewer than "
                f"one sequence of {self.max_model_len} tokens needs; lower --max-model-len or "
                "give the cache more memory"
            )
        return blocks

    def _allocate_kv_cache(self) -> torch.Tensor:
        mc = self.model_config
        # [layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]
        shape = (
            mc.num_layers,
            2,
            self.num_kv_blocks,
            self.block_size,
            mc.num_kv_heads,
            mc.head_dim,
        )
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.model.attention_layers()):
            layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
        logger.info(
            "KV cache: %d blocks x %d tokens (%.2f GiB)",
            self.num_kv_blocks,
            self.block_size,
            cache.numel() * cache.element_size() / 2**30,
        )
        return cache

    # ---- CUDA graphs (engine_core/cuda_graph.py) -----------------------------------------------

    def _capture_graphs(self) -> CudaGraphRunner | None:
        """Capture decode graphs at start-up on CUDA (after the KV cache exists: graphs bake in
        its addresses); None on the CPU or when ``enforce_eager`` is set."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if not getattr(self.backend, "cuda_graph_safe", False):
            logger.warning("the attention backend reads host values; running decode eagerly")
            return None
        from engine_core.cuda_graph import CudaGraphRunner

        runner = CudaGraphRunner(
            self.model,
            self.backend,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            hidden_size=self.model_config.hidden_size,
            dtype=self.dtype,
            device=self.device,
        )
        runner.capture()
        return runner

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        """The model's forward: a graph replay for a decode batch that fits one, else eager."""
        if self.graph_runner is not None and self.graph_runner.can_run(inputs.meta):
            return self.graph_runner.run(inputs.input_ids, inputs.positions, inputs.meta)
        with forward_context(inputs.meta, self.backend):
            return self.model(inputs.input_ids, inputs.positions)

    # ---- one step -----------------------------------------------------------------------------

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInputs:
        """Flatten the scheduled requests into one batch of tokens and attention metadata."""
        bs = self.block_size
        token_chunks, position_chunks, slot_chunks = [], [], []
        query_start_loc, seq_lens, logits_rows, sampling = [0], [], [], []
        max_blocks = max(len(s.block_ids) for s in out.scheduled)
        block_tables = np.zeros((len(out.scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(out.scheduled):
            start, end = s.start, s.start + s.num_new_tokens
            positions = np.arange(start, end, dtype=np.int64)
            blocks = np.asarray(s.block_ids, dtype=np.int64)
            token_chunks.append(np.asarray(s.request.token_ids[start:end], dtype=np.int64))
            position_chunks.append(positions)
            slot_chunks.append(blocks[positions // bs] * bs + positions % bs)
            block_tables[i, : len(s.block_ids)] = s.block_ids
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            seq_lens.append(end)
            if s.samples:
                logits_rows.append(query_start_loc[-1] - 1)
                sampling.append(s.request)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(np.concatenate(slot_chunks)),
            query_start_loc=self._to_device(np.asarray(query_start_loc, dtype=np.int32)),
            seq_lens=self._to_device(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=self._to_device(block_tables),
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return ModelInputs(
            input_ids=self._to_device(np.concatenate(token_chunks)),
            positions=self._to_device(np.concatenate(position_chunks)),
            meta=meta,
            logits_indices=self._to_device(np.asarray(logits_rows, dtype=np.int64)),
            sampling_requests=sampling,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        inputs = self.prepare_inputs(out)
        hidden = self._forward(inputs)  # [T, hidden]
        if not inputs.sampling_requests:
            return RunnerOutput([], [])
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [S, vocab]
        sampled = self.sampler(logits, inputs.sampling_requests)
        return self._to_host(sampled, inputs.sampling_requests)

    def _to_host(self, sampled: SamplerOutput, requests: list[Request]) -> RunnerOutput:
        """The step's single device-to-host copy (ids, and logprobs when any row asked)."""
        token_ids = sampled.token_ids.tolist()
        if sampled.logprobs is None:
            return RunnerOutput(token_ids, [None] * len(token_ids))
        chosen = sampled.logprobs.tolist()
        top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        logprobs: list[TokenLogprobs | None] = []
        for row, request in enumerate(requests):
            n = request.params.logprobs
            if n is None:
                logprobs.append(None)
                continue
            ids = top_ids[row][:n] if top_ids and n else []
            lps = top_lps[row][:n] if top_lps and n else []
            logprobs.append(TokenLogprobs(chosen[row], ids, lps))
        return RunnerOutput(token_ids, logprobs)
