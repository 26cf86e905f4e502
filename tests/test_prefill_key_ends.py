"""The Triton prefill kernel with key ends (engine_core/attention/triton_kernels.py
``paged_prefill_attention(key_ends=...)``, Gemma 3's images): each query row sees the keys
from its window's start up to max(its own position, its key end), against a float64 hand
computation of HF Gemma 3's mask written independently (causal OR same image, AND the
window): several sequences in one launch on shuffled blocks (a whole prompt with two images, a
chunk that starts inside an image after a prefix hit, a chunk that starts where an image does,
a decode, a sequence of no rows), images across query tiles and key tiles, windows shorter and
longer than an image, GQA, the padding rows of a graph-sized work list; key ends that are only
causal give the causal kernel's bits; the Triton backend sends a step with key ends to the
kernel; and, interpreted, the tiny Gemma 3 vision engine on the Triton backend gives HF's
tokens with its image steps attended by the kernel and never by the torch reference.

On the CPU it runs through Triton's interpreter (triton is not in the main venv)::

    TRITON_INTERPRET=1 PYTHONPATH=$PWD:/work/vllm-cpu-venv/lib/python3.11/site-packages \\
        .venv/bin/python -m pytest tests/test_prefill_key_ends.py -q

On a GPU (marked ``gpu``) in float32, float16 and bfloat16, at Gemma 3 4B's heads too (8 query
heads, 4 kv heads, head dim 256) with its 256-token images.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.gpu
if not (INTERPRET or torch.cuda.is_available()):
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from tests.test_triton_kernels import patch_interpreter_index  # noqa: E402

if INTERPRET:
    patch_interpreter_index()

from engine_core.attention.base import AttentionMetadata  # noqa: E402
from engine_core.attention.prefill_tiles import tile_list  # noqa: E402
from engine_core.attention.triton_backend import TritonBackend  # noqa: E402
from engine_core.attention.triton_kernels import (  # noqa: E402
    PrefillLaunch,
    paged_prefill_attention,
)
from frontend.vision import VisionProcessor  # noqa: E402
from tests import test_vision_gemma3  # noqa: E402

# The tiny Gemma 3 with images, HF's model and processor: test_vision_gemma3's fixtures.
vl_dir = test_vision_gemma3.vl_dir
hf = test_vision_gemma3.hf
processor = test_vision_gemma3.processor

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
BLOCK = 16
if INTERPRET:
    DTYPES = [torch.float32, torch.float16]
    HEAD_SHAPES = [(4, 4, 16), (8, 2, 32)]  # (heads, kv heads, head dim): GQA 1 and 4
    IMAGE = 12  # an image's run of tokens
else:
    DTYPES = [torch.float32, torch.float16, torch.bfloat16]
    HEAD_SHAPES = [(8, 2, 64), (32, 8, 128), (8, 4, 256)]  # the last: Gemma 3 4B's
    IMAGE = 256  # Gemma 3's mm_tokens_per_image
TOLERANCE = {torch.float32: 1e-4 if INTERPRET else 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# Launch shapes: the engine's, and 16-row query tiles over 16-key tiles, so that images cross
# both kinds of tile border even at the interpreter's small sizes.
LAUNCHES = [None, PrefillLaunch(block_n=16, block_m=16)]


@dataclass(frozen=True)
class Seq:
    """One sequence of a step: ``context`` tokens already cached, then ``rows`` new ones;
    ``images``: [start, end) runs of absolute positions whose tokens see each other."""

    context: int
    rows: int
    images: tuple[tuple[int, int], ...] = ()

    @property
    def length(self) -> int:
        return self.context + self.rows

    def key_ends(self) -> list[int]:
        """One past the last key each new row sees: its image's end inside one, else itself."""
        ends = []
        for p in range(self.context, self.length):
            inside = [end for start, end in self.images if start <= p < end]
            ends.append(inside[0] if inside else p + 1)
        return ends


def mixed_step(image: int) -> list[Seq]:
    """A whole prompt with two images; a chunk that starts inside an image (a prefix hit ended
    there) and holds another; a decode; a sequence of no rows; a chunk that starts where its
    image does, the image reaching the chunk's end."""
    return [
        Seq(0, 3 * image, ((3, 3 + image), (image + 7, 2 * image + 7))),
        Seq(image, 2 * image + 5, ((image // 2, 3 * image // 2), (2 * image, 3 * image))),
        Seq(3 * image + 1, 1),
        Seq(2 * image, 0),
        Seq(image + 2, image + 4, ((image + 6, 2 * image + 6),)),
    ]


class Case:
    """A step over ``seqs`` whose whole context's K/V is in a random cache, on shuffled blocks,
    with ``pad_rows`` rows past the last sequence (a prefill graph's) in q and the work list."""

    def __init__(
        self,
        seqs: list[Seq],
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        seed: int,
        pad_rows: int = 0,
    ) -> None:
        heads, kv_heads, head_dim = shape
        gen = torch.Generator().manual_seed(seed)
        self.seqs = seqs
        needed = [-(-max(s.length, 1) // BLOCK) for s in seqs]
        num_blocks = sum(needed) + 2
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = torch.zeros(len(seqs), max(needed) + 2, dtype=torch.int32)
        for i, count in enumerate(needed):
            blocks, order = order[:count], order[count:]
            self.tables[i, :count] = torch.tensor(blocks, dtype=torch.int32)
        cache = (num_blocks, BLOCK, kv_heads, head_dim)
        self.k_cache = torch.randn(*cache, generator=gen).to(DEVICE, dtype)
        self.v_cache = torch.randn(*cache, generator=gen).to(DEVICE, dtype)
        self.starts = [0]
        for s in seqs:
            self.starts.append(self.starts[-1] + s.rows)
        total = self.starts[-1] + pad_rows
        # Sharp scores (q scaled up), so that a wrong mask moves the output well past tolerance.
        q = torch.randn(total, heads, head_dim, generator=gen) * 2.0
        self.q = q.to(DEVICE, dtype)
        ends = [e for s in seqs for e in s.key_ends()] + [0] * pad_rows
        self.key_ends = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
        self.scale = head_dim**-0.5
        self.pad_rows = pad_rows

    def run(self, launch: PrefillLaunch | None = None, **kwargs: Any) -> torch.Tensor:
        block_m = (launch.block_m if launch else None) or (64 if self.q.shape[0] > 16 else 16)
        lens = [s.rows for s in self.seqs]
        rows = len(tile_list(lens, block_m)) + 3 if self.pad_rows else None  # -1 rows past
        tiles = torch.from_numpy(tile_list(lens, block_m, rows)).to(DEVICE)
        out = torch.zeros_like(self.q) if self.pad_rows else None
        return paged_prefill_attention(
            self.q, self.k_cache, self.v_cache, self.tables.to(DEVICE),
            torch.tensor([s.length for s in self.seqs], dtype=torch.int32, device=DEVICE),
            torch.tensor(self.starts, dtype=torch.int32, device=DEVICE),
            max(lens), self.scale, tiles=tiles, launch=launch, out=out, **kwargs,
        )  # fmt: skip

    def by_hand(self, window: int | None = None) -> torch.Tensor:
        """float64, HF Gemma 3's mask: a query at p sees key k where k <= p or both are in one
        image, and (with a window) k > p - window."""
        heads, kv_heads = self.q.shape[1], self.k_cache.shape[2]
        k_flat = self.k_cache.double().flatten(0, 1)  # [slots, kv heads, D]
        v_flat = self.v_cache.double().flatten(0, 1)
        out = torch.zeros(self.q.shape, dtype=torch.float64, device=DEVICE)
        for b, s in enumerate(self.seqs):
            slots = [int(self.tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(s.length)]
            # [L, H, D]: query head h reads kv head h // group, as HF's repeat_kv does.
            k_heads = k_flat[slots].repeat_interleave(heads // kv_heads, dim=1)
            v_heads = v_flat[slots].repeat_interleave(heads // kv_heads, dim=1)
            keys = torch.arange(s.length, device=DEVICE)
            for j in range(s.rows):
                p = s.context + j
                same_image = torch.zeros(s.length, dtype=torch.bool, device=DEVICE)
                for start, end in s.images:
                    if start <= p < end:
                        same_image |= (keys >= start) & (keys < end)
                visible = (keys <= p) | same_image
                if window is not None:
                    visible &= keys > p - window
                q = self.q[self.starts[b] + j].double()  # [H, D]
                scores = torch.einsum("hd,khd->hk", q, k_heads) * self.scale
                probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
                out[self.starts[b] + j] = torch.einsum("hk,khd->hd", probs, v_heads)
        return out


def assert_close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    err = ((out.double() - want).norm() / want.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", HEAD_SHAPES)
def test_key_ends_match_a_float64_hand_computation(
    shape: tuple[int, int, int], dtype: torch.dtype, launch: PrefillLaunch | None
) -> None:
    case = Case(mixed_step(IMAGE), shape, dtype, seed=shape[2])
    want = case.by_hand()
    assert_close(case.run(launch, key_ends=case.key_ends), want, dtype)
    # The mask matters here: the causal kernel is far from the images' attention.
    causal = case.run(launch).double()
    assert ((causal - want).norm() / want.norm()) > 0.05


@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("window", [5, IMAGE + 9, 4 * IMAGE])
def test_a_window_bounds_the_first_key_from_the_row_itself(
    window: int, launch: PrefillLaunch | None
) -> None:
    """Windows shorter than an image (an image's first token still sees its last), longer
    than one, longer than every sequence."""
    dtype = DTYPES[0]
    case = Case(mixed_step(IMAGE), HEAD_SHAPES[-1], dtype, seed=window)
    out = case.run(launch, key_ends=case.key_ends, sliding_window=window)
    assert_close(out, case.by_hand(window), dtype)


def test_padding_rows_stay_zero_and_the_rest_is_right() -> None:
    """A graph-sized step: rows past the last sequence and work-list rows of sequence -1."""
    dtype = DTYPES[0]
    case = Case(mixed_step(IMAGE), HEAD_SHAPES[0], dtype, seed=5, pad_rows=7)
    out = case.run(LAUNCHES[1], key_ends=case.key_ends)
    real = case.starts[-1]
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    assert_close(out[:real], case.by_hand()[:real], dtype)


def test_causal_key_ends_give_the_causal_kernel_s_bits() -> None:
    """Key ends of a step without images (each row's own position + 1) change nothing."""
    seqs = [Seq(0, 2 * IMAGE + 3), Seq(IMAGE, IMAGE), Seq(5, 1)]
    case = Case(seqs, HEAD_SHAPES[-1], DTYPES[0], seed=9)
    for launch in LAUNCHES:
        assert torch.equal(case.run(launch, key_ends=case.key_ends), case.run(launch))


def test_key_ends_of_another_shape_or_dtype_are_refused() -> None:
    case = Case([Seq(0, 4)], HEAD_SHAPES[0], DTYPES[0], seed=1)
    with pytest.raises(ValueError, match="key_ends must be"):
        case.run(key_ends=case.key_ends.long())
    with pytest.raises(ValueError, match="key_ends must be"):
        case.run(key_ends=case.key_ends[:3])


@pytest.mark.parametrize("decode_only", [False, True])
def test_the_backend_sends_a_step_with_key_ends_to_the_kernel(decode_only: bool) -> None:
    """TritonBackend.forward with key ends: the prefill kernel's attention, also for a step of
    one row a sequence (the decode kernel is causal only; such a row is an image's last)."""
    seqs = [Seq(IMAGE, 1), Seq(2, 1)] if decode_only else mixed_step(IMAGE)
    if decode_only:
        seqs[0] = Seq(IMAGE, 1, ((3, IMAGE + 1),))  # the row is its image's last token
    dtype = DTYPES[0]
    case = Case(seqs, HEAD_SHAPES[-1], dtype, seed=3)
    lens = [s.length for s in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(case.starts[-1], dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(case.starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_tables=case.tables.to(DEVICE), max_query_len=max(s.rows for s in seqs),
        max_seq_len=max(lens), query_start_loc_cpu=case.starts, seq_lens_cpu=lens,
    )  # fmt: skip
    out = TritonBackend().forward(
        case.q, case.k_cache, case.v_cache, meta, case.scale, key_ends=case.key_ends
    )
    assert_close(out, case.by_hand(), dtype)


@pytest.mark.skipif(not INTERPRET, reason="the GPU's engine test: test_vision_gemma3_gpu.py")
def test_the_gemma3_vision_engine_on_the_triton_backend_gives_hf_s_tokens(
    monkeypatch: pytest.MonkeyPatch,
    vl_dir: Path,
    processor: VisionProcessor,
    hf: tuple[Any, Any],
) -> None:
    """The tiny Gemma 3 with images on the CPU with the Triton backend (interpreted, float32):
    one image amid text, HF's tokens (which a causal mask does not give); the image steps'
    sliding and full layers attended through the prefill kernel (counted), none through the
    torch reference."""
    from engine_core import model_runner
    from engine_core.attention import torch_ref, triton_backend
    from tests import test_vision_gemma3 as gemma3
    from tests.vision_factories import random_image

    calls = {"key ends": 0, "windowed": 0, "reference": 0}
    kernel = triton_backend.paged_prefill_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("key_ends") is not None:
            calls["key ends"] += 1
            calls["windowed"] += kwargs.get("sliding_window") is not None
        return kernel(*args, **kwargs)

    def refused(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["reference"] += 1
        raise AssertionError("the torch reference attended on the Triton backend")

    monkeypatch.setattr(triton_backend, "paged_prefill_attention", counted)
    monkeypatch.setattr(torch_ref.TorchReferenceBackend, "forward", refused)
    monkeypatch.setattr(model_runner, "select_backend", lambda device: TritonBackend())
    ids, images, pil = gemma3.prompt(
        vl_dir, processor, hf, ["Look:", random_image(2, width=60, height=150), "what?"]
    )
    want = gemma3.hf_greedy(hf, ids, pil, gemma3.NEW_TOKENS)
    assert gemma3.hf_greedy(hf, ids, pil, gemma3.NEW_TOKENS, bidirectional=False) != want
    llm = gemma3.make_llm(vl_dir, device="cpu", dtype="float32")
    try:
        out = llm.generate([ids], gemma3.PARAMS, detokenize=False, images=[images])
        assert out[0].token_ids == want
    finally:
        llm.engine.shutdown()
    assert calls["key ends"] > calls["windowed"] > 0  # the full and the sliding layers
    assert calls["reference"] == 0
