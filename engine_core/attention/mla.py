"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache.

Each token caches one row of ``kv_lora_rank + qk_rope_head_dim`` values per layer: its
normalized KV latent c and its rotated rotary key, shared by every head (a 61-layer DeepSeek-V3
token takes 70 KB in bf16, where K and V of 128 heads would take 4.6 MB). Every head's no-rope
key and value are linear in c: ``kv_b_proj`` [H * (N + V), R] holds W_UK [H, N, R] and
W_UV [H, V, R]. Two ways to attend, one result:

- expanded (prompts and prompt chunks, many queries over one context): the context's latents
  go through kv_b_proj into per-head keys [L, H, N + P] and values [L, H, V], then ordinary
  causal attention;
- absorbed (decodes, one query over a long context): W_UK is folded into the query
  (q_lat = q_nope W_UK, [H, R]), so the scores are q_lat . c + q_pe . k_pe against the cache
  rows as they are, the probabilities weigh the latents (o_lat [H, R]), and W_UV maps o_lat to
  each head's output. No per-token expansion: the cache is read once, not H times.

``tests/test_models_deepseek.py`` checks the two against each other and both against HF.

On CUDA both run as Triton kernels (engine_core/attention/triton_mla.py): the absorbed decode
over the paged latents, split over the context; the expanded prefill through the GQA prefill
kernel (whose V head size may differ from Q/K's). A decode-only step then reads no host value
(its launches depend on shapes only). Elsewhere, and where a test asks for it (``use_triton``),
the torch path: plain tensor ops per sequence, reading host copies of the lengths.

With ``--kv-cache-dtype fp8`` the cache holds each row divided by the layer's ``k_scale`` (1.0
unless the runner sets one), clamped to e4m3's range and rounded, as the plain K/V cache does:
half the bytes of bf16, so twice the tokens in the same memory. Readers widen the rows to the
queries' dtype; the decode kernel folds the scale into the softmax scale and its output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.attention.base import AttentionMetadata, cached_values, write_cache_rows
from engine_core.forward_context import get_forward_context


class LatentAttention(nn.Module):
    """The cache side of MLA: writes each token's latent row, attends per sequence.

    ``cache`` [num_blocks, block_size, R + P] is a plain attribute, sized and bound by the model
    runner (``cache_shapes``/``bind_cache``), as Attention's K/V caches are.
    """

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.rank, self.nope, self.rope, self.v_dim = (
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        self.scale = scale
        self.sliding_window = None
        self.attention_chunk = None
        self.cache: torch.Tensor | None = None
        self.k_scale = 1.0  # an FP8 cache holds rows / k_scale (the runner's _set_kv_scales)
        self.absorb_decode = True  # decodes take the absorbed path (tests switch it off)
        # The Triton kernels or the torch path; None: Triton on CUDA (tests choose either).
        self.use_triton: bool | None = None

    @property
    def width(self) -> int:
        """Elements per token in the cache: the latent and the rotary key."""
        return self.rank + self.rope

    def cache_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        return [(num_blocks, block_size, self.width)]

    def bind_cache(self, tensors: list[torch.Tensor]) -> None:
        (self.cache,) = tensors

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_pe: torch.Tensor,  # [T, H, P], rotated
        latent: torch.Tensor,  # [T, R], normalized
        k_pe: torch.Tensor,  # [T, P], rotated
        kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    ) -> torch.Tensor:  # [T, H, V]
        if self.cache is None:
            raise RuntimeError("LatentAttention.cache is unset: allocate the KV cache first")
        meta = get_forward_context().attn_metadata
        use_triton = q_nope.is_cuda if self.use_triton is None else self.use_triton
        if use_triton:
            return self.triton_forward(q_nope, q_pe, latent, k_pe, kv_b_weight, meta)
        rows = torch.cat((latent, k_pe), dim=-1)
        write_latents(self.cache, rows, meta.slot_mapping, self.k_scale)
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)
        starts = meta.query_start_loc_cpu
        decodes = self.absorbed_seqs(meta)
        if decodes:
            rows = torch.tensor([starts[s] for s in decodes], device=q_nope.device)
            out[rows] = self.absorbed(q_nope[rows], q_pe[rows], meta, decodes, kv_b_weight)
        for seq in range(meta.num_seqs):
            start, end = starts[seq], starts[seq + 1]
            if end == start or seq in decodes:
                continue
            context = self.context(meta, seq, q_nope.dtype)
            out[start:end] = self.expanded(q_nope[start:end], q_pe[start:end], context, kv_b_weight)
        return out

    def absorbed_seqs(self, meta: AttentionMetadata) -> list[int]:
        """The sequences that take the absorbed path: the decodes (one new token)."""
        if not self.absorb_decode:
            return []
        starts = meta.query_start_loc_cpu
        return [s for s in range(meta.num_seqs) if starts[s + 1] - starts[s] == 1]

    def triton_forward(
        self,
        q_nope: torch.Tensor,  # [T, H, N]
        q_pe: torch.Tensor,  # [T, H, P], rotated
        latent: torch.Tensor,  # [T, R], normalized
        k_pe: torch.Tensor,  # [T, P], rotated
        kv_b_weight: torch.Tensor,  # [H * (N + V), R]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, V]
        """forward through the Triton kernels; a decode-only step reads no host value."""
        from engine_core.attention import triton_mla  # imports triton: CUDA (or the interpreter)

        assert self.cache is not None
        triton_mla.write_latents(self.cache, latent, k_pe, meta.slot_mapping, self.k_scale)
        if meta.is_decode_only and self.absorb_decode:
            return self.triton_absorbed(q_nope, q_pe, meta.block_tables, meta.seq_lens, kv_b_weight)
        out = q_nope.new_zeros(q_nope.shape[0], self.num_heads, self.v_dim)
        plan = triton_mla.step_plan(
            tuple(meta.query_start_loc_cpu), tuple(meta.seq_lens_cpu), self.absorb_decode,
            self.cache.shape[1], q_nope.device,
        )  # fmt: skip
        if plan.decode_rows is not None:
            rows, seqs = plan.decode_rows, plan.decode_seqs
            out[rows] = self.triton_absorbed(
                q_nope[rows], q_pe[rows], meta.block_tables[seqs], meta.seq_lens[seqs],
                kv_b_weight,
            )  # fmt: skip
        if plan.expanded is not None:
            rows = plan.expanded.rows
            q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)  # [Tp, H, N + P]
            out[rows] = triton_mla.mla_prefill_attention(
                q, self.cache, meta.block_tables, plan.expanded, kv_b_weight, self.v_dim,
                self.scale, self.k_scale,
            )  # fmt: skip
        return out

    def triton_absorbed(
        self,
        q_nope: torch.Tensor,  # [B, H, N]: one query per decoding sequence
        q_pe: torch.Tensor,  # [B, H, P]
        block_tables: torch.Tensor,  # [B, max_blocks]
        seq_lens: torch.Tensor,  # [B]
        kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    ) -> torch.Tensor:  # [B, H, V]
        """absorbed, through the Triton decode kernel."""
        from engine_core.attention.triton_mla import mla_decode_attention

        assert self.cache is not None
        w_uk, w_uv = absorbed_weights(kv_b_weight, self.num_heads, self.nope)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # [B, H, R]
        o_lat = mla_decode_attention(
            q_lat, q_pe, self.cache, block_tables, seq_lens, self.scale, cache_scale=self.k_scale
        )
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)

    def context(self, meta: AttentionMetadata, seq: int, dtype: torch.dtype) -> torch.Tensor:
        """Sequence ``seq``'s cached rows [L, R + P] in ``dtype``, through its block table."""
        assert self.cache is not None
        seq_len, block_size = meta.seq_lens_cpu[seq], self.cache.shape[1]
        blocks = meta.block_tables[seq][: -(-seq_len // block_size)].long()
        return cached_values(self.cache[blocks].flatten(0, 1)[:seq_len], dtype, self.k_scale)

    def expanded(
        self,
        q_nope: torch.Tensor,  # [Q, H, N]: the last Q positions of the context
        q_pe: torch.Tensor,  # [Q, H, P]
        context: torch.Tensor,  # [L, R + P]
        kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    ) -> torch.Tensor:  # [Q, H, V]
        """Per-head keys and values from the context's latents, then causal attention."""
        seq_len = context.shape[0]
        latent, k_pe = context.split((self.rank, self.rope), dim=-1)
        kv = F.linear(latent, kv_b_weight).view(seq_len, self.num_heads, -1)  # [L, H, N + V]
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)  # [Q, H, N + P]
        return causal_attention(q, k, v, self.scale)

    def absorbed(
        self,
        q_nope: torch.Tensor,  # [B, H, N]: one query per decoding sequence
        q_pe: torch.Tensor,  # [B, H, P]
        meta: AttentionMetadata,
        seqs: list[int],
        kv_b_weight: torch.Tensor,  # [H * (N + V), R]
    ) -> torch.Tensor:  # [B, H, V]
        """Decodes against the latent rows as cached: W_UK folded into the queries, W_UV
        applied to the attended latents."""
        w_uk, w_uv = absorbed_weights(kv_b_weight, self.num_heads, self.nope)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # [B, H, R]
        q = torch.cat((q_lat, q_pe), dim=-1)  # [B, H, R + P]
        o_lat = torch.empty_like(q_lat)  # [B, H, R]
        for i, seq in enumerate(seqs):
            context = self.context(meta, seq, torch.float32)  # [L, R + P]
            scores = (q[i].float() @ context.T) * self.scale  # [H, L]
            probs = scores.softmax(dim=-1)
            o_lat[i] = (probs @ context[:, : self.rank]).to(q.dtype)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)


def absorbed_weights(
    kv_b_weight: torch.Tensor, num_heads: int, nope: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj's weight [H * (N + V), R] as (W_UK [H, N, R], W_UV [H, V, R])."""
    per_head = kv_b_weight.view(num_heads, -1, kv_b_weight.shape[-1])  # [H, N + V, R]
    return per_head[:, :nope], per_head[:, nope:]


def write_latents(
    cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0
) -> None:
    """rows [T, R + P] into their cache slots; slot -1 (padding) is skipped. An FP8 cache
    stores rows / scale, clamped to e4m3's range."""
    keep = slot_mapping >= 0
    flat = cache.view(-1, cache.shape[-1])  # [num_slots, R + P]
    write_cache_rows(flat, slot_mapping[keep], rows[keep], scale)


def causal_attention(
    q: torch.Tensor,  # [Q, H, Dk]: the last Q positions
    k: torch.Tensor,  # [L, H, Dk]
    v: torch.Tensor,  # [L, H, Dv]
    scale: float,
) -> torch.Tensor:  # [Q, H, Dv]
    num_queries, seq_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(seq_len - num_queries, seq_len, device=q.device)[:, None]  # [Q, 1]
    keep = torch.arange(seq_len, device=q.device)[None, :] <= q_pos  # [Q, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, Q, Dk]
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=keep,
        scale=scale,
    )  # [1, H, Q, Dv]
    return out[0].transpose(0, 1)
