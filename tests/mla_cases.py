"""MLA test cases shared by the interpreted kernel tests (tests/test_mla_triton_interpreted.py)
and the GPU ones (tests/test_mla_gpu.py): random paged latent caches and the two independent
references, a float64 hand computation of the absorbed decode and the torch path's expanded
attention (LatentAttention.expanded)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine_core.attention.mla import LatentAttention


@dataclass(frozen=True)
class Dims:
    heads: int
    rank: int  # kv_lora_rank
    rope: int
    nope: int = 16
    v_dim: int = 24


SMALL = Dims(heads=4, rank=64, rope=16)
V2_LITE = Dims(heads=16, rank=512, rope=64, nope=128, v_dim=128)


@dataclass
class PagedLatents:
    """A latent cache of random rows, NaN in every slot no sequence owns (a stray read poisons
    the output), and each sequence's block table over shuffled blocks."""

    cache: torch.Tensor  # [num_blocks, page, R + P]
    tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: list[int]

    def context(self, seq: int) -> torch.Tensor:  # [L, R + P]
        page = self.cache.shape[1]
        blocks = self.tables[seq][: -(-self.seq_lens[seq] // page)].long()
        return self.cache[blocks].flatten(0, 1)[: self.seq_lens[seq]]


def paged_latents(
    seq_lens: list[int],
    width: int,
    page: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PagedLatents:
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // page) for n in seq_lens]
    order = list(range(sum(counts) + 3))
    random.Random(seed).shuffle(order)
    cache = torch.full((len(order), page, width), float("nan"))
    tables = torch.zeros(len(seq_lens), max(max(counts), 1), dtype=torch.int32)
    for seq, (n, count) in enumerate(zip(seq_lens, counts, strict=True)):
        blocks = [order.pop() for _ in range(count)]
        tables[seq, :count] = torch.tensor(blocks, dtype=torch.int32)
        rows = torch.full((count * page, width), float("nan"))
        rows[:n] = torch.randn(n, width, generator=gen)
        cache[blocks] = rows.view(count, page, width)
    return PagedLatents(cache.to(device, dtype), tables.to(device), seq_lens)


def as_fp8(paged: PagedLatents, scale: float) -> tuple[PagedLatents, PagedLatents]:
    """(the cache in e4m3 as an FP8 cache holds it: rows / scale, clamped, rounded; the float32
    values it stands for, the references' input). Unowned slots stay NaN in both."""
    e4m3 = (paged.cache.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    values = e4m3.float() * scale
    return (
        PagedLatents(e4m3, paged.tables, paged.seq_lens),
        PagedLatents(values, paged.tables, paged.seq_lens),
    )


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def absorbed_by_hand(
    q_lat: torch.Tensor, q_pe: torch.Tensor, paged: PagedLatents, scale: float
) -> torch.Tensor:  # [B, H, R]
    """softmax((q_lat . c + q_pe . k_pe) * scale) @ c per sequence, in float64; zeros for an
    empty (padding) sequence."""
    rank = q_lat.shape[-1]
    out = torch.zeros(q_lat.shape, dtype=torch.float64, device=q_lat.device)
    for seq, n in enumerate(paged.seq_lens):
        if n == 0:
            continue
        ctx = paged.context(seq).double()  # [L, R + P]
        scores = q_lat[seq].double() @ ctx[:, :rank].T + q_pe[seq].double() @ ctx[:, rank:].T
        out[seq] = (scores * scale).softmax(-1) @ ctx[:, :rank]
    return out


def expanded_by_torch(
    q: torch.Tensor,
    paged: PagedLatents,
    query_lens: list[int],
    weight: torch.Tensor,
    dims: Dims,
    scale: float = 0.15,
) -> torch.Tensor:
    """LatentAttention.expanded (the torch path) for each sequence's last query rows."""
    layer = LatentAttention(dims.heads, dims.rank, dims.nope, dims.rope, dims.v_dim, scale)
    outs, start = [], 0
    for seq, n in enumerate(query_lens):
        rows = q[start : start + n]
        outs.append(
            layer.expanded(
                rows[..., : dims.nope], rows[..., dims.nope :], paged.context(seq), weight
            )
        )
        start += n
    return torch.cat(outs)
