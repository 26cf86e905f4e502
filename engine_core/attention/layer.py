"""The attention layer that every model calls: write this step's K/V, then attend over the cache.

The layer holds no metadata of its own. Which tokens go where, and which backend runs, come from
the forward context the model runner enters around each forward, so a layer keeps the plain
``forward(q, k, v)`` shape that CUDA-graph capture needs.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention over one layer's KV cache.

    ``k_cache`` and ``v_cache`` ([num_blocks, block_size, kv_heads, head_dim]) are plain attributes,
    not buffers: the model runner owns and sizes them after the weights are loaded, and they must
    stay out of ``state_dict``. So are ``k_scale`` and ``v_scale``: an FP8 cache holds K / k_scale
    and V / v_scale (set by the runner; other caches ignore them).

    ``kv_group``: the layer group whose block tables it reads (the runner sets it; group 0's
    are the forward's ``attn_metadata``).

    ``sinks`` (gpt-oss): a learned logit per query head that joins every softmax's denominator
    and weighs no value, so a head can attend to nothing; a parameter the checkpoint fills.

    ``attention_chunk`` (Llama 4's chunked local attention, C): a query at position p sees only
    the keys in [p // C * C, p].
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        sinks: bool = False,
        attention_chunk: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of kv heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.attention_chunk = attention_chunk
        # Passed to the backends only where set, so a backend that knows no chunks is not
        # asked for one it would ignore (the Triton and CPU backends both take it).
        self._chunk = {} if attention_chunk is None else {"attention_chunk": attention_chunk}
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0
        # Its KV layer group (engine_core/kv_groups.py), set by the runner with its cache: whose
        # block tables and slots of the forward context it reads.
        self.kv_group = 0
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None  # [H]

    def cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The paged cache tensors this layer needs (``bind_cache`` takes them in this order):
        K and V, [num_blocks, block_size, kv_heads, head_dim] each."""
        return [(num_blocks, block_size, self.num_kv_heads, self.head_dim)] * 2

    def bind_cache(self, tensors: list[torch.Tensor]) -> None:
        """Attach the cache tensors the model runner allocated from ``cache_shapes``."""
        self.k_cache, self.v_cache = tensors

    def rotates_in_kv_write(self) -> bool:
        """Whether this forward's backend can rotate q and k in its KV write (``forward``'s
        ``rotary``): one launch for both on the Triton backend."""
        return getattr(get_forward_context().backend, "rotates_in_kv_write", False)

    def _rotates_in_decode(self, backend: object) -> bool:
        """Whether the backend's decode attention can also rotate q and k and write the new
        K/V (``decode_rotated``) for this layer's heads: one launch for all three."""
        rotates = getattr(backend, "rotates_in_decode", None)
        return rotates is not None and rotates(self.head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [T, H*D], k and v [T, KVH*D] -> [T, H*D]. With ``rotary`` (cos, sin [T, R], where
        rotates_in_kv_write), q and k are not yet rotated: the KV write rotates them (q in
        place), as models/layers.py rotate_qk would; a decode step's attention does, where the
        backend rotates_in_decode (q is then not written, but in a step whose attention reads
        a shared prefix: TritonBackend.decode_rotated)."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("Attention.k_cache/v_cache are unset: allocate the KV cache first")
        ctx = get_forward_context()
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        scales = (self.k_scale, self.v_scale)
        caches = (self.k_cache, self.v_cache)
        meta = ctx.attn_metadata if self.kv_group == 0 else ctx.group_metadata[self.kv_group]
        extra: dict[str, torch.Tensor] = {} if self.sinks is None else {"sinks": self.sinks}
        if ctx.key_ends is not None:  # rows that see past themselves (Gemma 3's images)
            extra["key_ends"] = ctx.key_ends
        fused = self.sinks is None and self._rotates_in_decode(ctx.backend)  # no sink term there
        if rotary is not None and meta.is_decode_only and fused:
            out = ctx.backend.decode_rotated(
                q, k, v, *rotary, *caches, meta, self.scale, self.sliding_window, *scales,
                **self._chunk,
            )  # fmt: skip
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        slots = meta.slot_mapping
        if rotary is None:
            ctx.backend.write_kv(*caches, k, v, slots, *scales)
        else:
            ctx.backend.write_kv_rotated(q, k, v, *rotary, *caches, slots, *scales)
        out = ctx.backend.forward(
            q,
            self.k_cache,
            self.v_cache,
            meta,
            self.scale,
            self.sliding_window,
            *scales,
            **extra,
            **self._chunk,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
