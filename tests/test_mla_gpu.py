"""The Triton MLA kernels (engine_core/attention/triton_mla.py) on a GPU, in bf16 at
DeepSeek-V2-Lite's (16 heads) and DeepSeek-V3's (128 heads) head dims (kv_lora_rank 512, rope
64, nope 128, v 128) against float64/float32 references, and a tiny DeepSeek-V3 and V2 on CUDA:
the Triton path's greedy tokens equal the torch path's (and HF's) in float32, and a decode
step replayed from a CUDA graph equals the eager one. On the CPU the same kernels run through
Triton's interpreter (tests/test_mla_triton_interpreted.py).

    .venv/bin/python -m pytest tests/test_mla_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from engine_core.attention import mla  # noqa: E402
from engine_core.attention.base import AttentionMetadata  # noqa: E402
from engine_core.attention.mla import LatentAttention  # noqa: E402
from engine_core.attention.triton_mla import (  # noqa: E402
    expanded_batch,
    mla_decode_attention,
    mla_prefill_attention,
    write_latents,
)
from engine_core.forward_context import forward_context  # noqa: E402
from engine_core.llm import LLM  # noqa: E402
from engine_core.loader import load_model  # noqa: E402
from protocol.messages import SamplingParams  # noqa: E402
from tests import test_models_deepseek  # noqa: E402
from tests.mla_cases import (  # noqa: E402
    V2_LITE,
    Dims,
    PagedLatents,
    absorbed_by_hand,
    as_fp8,
    expanded_by_torch,
    paged_latents,
    relative_error,
)
from tests.paged_harness import assert_matches, generate_greedy, hf_greedy  # noqa: E402
from tests.test_models_deepseek import ATOL  # noqa: E402

CUDA = torch.device("cuda")
V3 = Dims(heads=128, rank=512, rope=64, nope=128, v_dim=128)
TOLERANCE = 1.5e-2  # ‖out - ref‖ / ‖ref‖ with bf16 operands (as tests/test_triton_kernels.py)
SCALE = 192**-0.5 * 1.2  # DeepSeek's 1 / sqrt(192), times a YaRN mscale factor


@pytest.mark.parametrize("dims", [V2_LITE, V3], ids=["v2-lite", "v3"])
@pytest.mark.parametrize(
    "seq_lens",
    [[1, 15, 16, 17, 300, 0], [4096] * 4 + [1000, 7], [8192, 33]],
    ids=["short-and-padding", "4k-batch", "8k"],
)
@pytest.mark.parametrize("page", [16, 64])
def test_decode_matches_the_hand_computation(dims: Dims, seq_lens: list[int], page: int) -> None:
    paged = paged_latents(seq_lens, dims.rank + dims.rope, page, device=CUDA, dtype=torch.bfloat16)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    batch = len(seq_lens)
    q_lat = torch.randn(batch, dims.heads, dims.rank, generator=gen, device=CUDA) / 8
    q_pe = torch.randn(batch, dims.heads, dims.rope, generator=gen, device=CUDA)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    out = mla_decode_attention(
        q_lat.bfloat16(), q_pe.bfloat16(), paged.cache, paged.tables, lens, SCALE
    )
    ref = absorbed_by_hand(q_lat.bfloat16(), q_pe.bfloat16(), paged, SCALE)
    assert relative_error(out, ref) < TOLERANCE
    assert not out[[i for i, n in enumerate(seq_lens) if n == 0]].any()


@pytest.mark.parametrize("num_splits", [1, 5, 64])
def test_decode_split_counts_agree(num_splits: int) -> None:
    seq_lens = [5000, 1, 700]
    paged = paged_latents(seq_lens, V3.rank + V3.rope, 16, device=CUDA, dtype=torch.bfloat16)
    gen = torch.Generator(device=CUDA).manual_seed(2)
    q_lat = (torch.randn(3, V3.heads, V3.rank, generator=gen, device=CUDA) / 8).bfloat16()
    q_pe = torch.randn(3, V3.heads, V3.rope, generator=gen, device=CUDA).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    out = mla_decode_attention(
        q_lat, q_pe, paged.cache, paged.tables, lens, SCALE, num_splits=num_splits
    )
    assert relative_error(out, absorbed_by_hand(q_lat, q_pe, paged, SCALE)) < TOLERANCE


@pytest.mark.parametrize("dims", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_prefill_with_cached_context_matches_the_torch_path(dims: Dims) -> None:
    """Whole prompts, chunks after cached context (prefix hits, earlier chunks), one-token rows."""
    seq_lens, query_lens = [700, 2100, 64, 300], [700, 500, 1, 37]
    paged = paged_latents(seq_lens, dims.rank + dims.rope, 16, device=CUDA, dtype=torch.bfloat16)
    gen = torch.Generator(device=CUDA).manual_seed(3)
    width = dims.heads * (dims.nope + dims.v_dim)
    weight = torch.randn(width, dims.rank, generator=gen, device=CUDA) / dims.rank**0.5
    q = torch.randn(sum(query_lens), dims.heads, dims.nope + dims.rope, generator=gen, device=CUDA)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q, weight = q.bfloat16(), weight.bfloat16()
    batch = expanded_batch(starts, seq_lens, list(range(4)), 16, CUDA)
    out = mla_prefill_attention(q, paged.cache, paged.tables, batch, weight, dims.v_dim, SCALE)
    wide = PagedLatents(paged.cache.float(), paged.tables, seq_lens)
    ref = expanded_by_torch(q.float(), wide, query_lens, weight.float(), dims, SCALE)
    assert relative_error(out, ref) < TOLERANCE


def test_write_latents_skips_padding_slots() -> None:
    cache = torch.zeros(4, 16, V3.rank + V3.rope, device=CUDA, dtype=torch.bfloat16)
    latent = torch.randn(3, V3.rank, device=CUDA).bfloat16()
    k_pe = torch.randn(3, V3.rope, device=CUDA).bfloat16()
    write_latents(cache, latent, k_pe, torch.tensor([17, -1, 63], device=CUDA))
    flat = cache.view(-1, V3.rank + V3.rope)
    assert torch.equal(flat[17], torch.cat((latent[0], k_pe[0])))
    assert torch.equal(flat[63], torch.cat((latent[2], k_pe[2])))
    assert int((flat.abs().sum(-1) > 0).sum()) == 2


def test_fp8_write_rounds_as_the_torch_path() -> None:
    """The hardware's e4m3 conversion (rounding included, which the interpreter's test leaves
    out) stores what the torch path stores, clamp and scale too."""
    gen = torch.Generator(device=CUDA).manual_seed(6)
    latent = torch.randn(9, V3.rank, generator=gen, device=CUDA) * 100
    k_pe = torch.randn(9, V3.rope, generator=gen, device=CUDA)
    slots = torch.tensor([3, -1, 9, 0, 15, 40, 41, 2, 63], device=CUDA)
    got = torch.zeros(4, 16, V3.rank + V3.rope, device=CUDA, dtype=torch.float8_e4m3fn)
    write_latents(got, latent, k_pe, slots, 0.5)
    want = torch.zeros_like(got)
    mla.write_latents(want, torch.cat((latent, k_pe), dim=-1), slots, 0.5)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dims", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_fp8_decode_and_prefill_read_their_values(dims: Dims) -> None:
    """bf16 queries over an e4m3 cache (scale 0.5) against the references on the values it
    holds."""
    seq_lens, query_lens = [300, 17, 1000, 5], [1, 1, 7, 5]
    paged = paged_latents(seq_lens, dims.rank + dims.rope, 16, seed=4, device=CUDA)
    fp8, values = as_fp8(paged, 0.5)
    gen = torch.Generator(device=CUDA).manual_seed(5)
    q_lat = torch.randn(4, dims.heads, dims.rank, generator=gen, device=CUDA).bfloat16()
    q_pe = torch.randn(4, dims.heads, dims.rope, generator=gen, device=CUDA).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    out = mla_decode_attention(q_lat, q_pe, fp8.cache, fp8.tables, lens, SCALE, cache_scale=0.5)
    assert relative_error(out, absorbed_by_hand(q_lat, q_pe, values, SCALE)) < TOLERANCE
    width = dims.heads * (dims.nope + dims.v_dim)
    weight = (torch.randn(width, dims.rank, generator=gen, device=CUDA) / dims.rank**0.5).bfloat16()
    q = torch.randn(sum(query_lens), dims.heads, dims.nope + dims.rope, generator=gen, device=CUDA)
    batch = expanded_batch([0, 1, 2, 9, 14], seq_lens, list(range(4)), 16, CUDA)
    out = mla_prefill_attention(
        q.bfloat16(), fp8.cache, fp8.tables, batch, weight, dims.v_dim, SCALE, 0.5
    )
    ref = expanded_by_torch(q.bfloat16().float(), values, query_lens, weight.float(), dims, SCALE)
    assert relative_error(out, ref) < TOLERANCE


def load_cuda(folder: Path, use_triton: bool) -> torch.nn.Module:
    model = load_model(str(folder), CUDA, torch.float32).module
    for layer in model.attention_layers():
        assert isinstance(layer, LatentAttention)
        layer.use_triton = use_triton
    return model


@pytest.mark.parametrize("name", ["v3", "v2_lite"])
def test_tiny_deepseek_on_cuda_triton_equals_torch_path_and_hf(name: str, tmp_path: Path) -> None:
    hf_model = test_models_deepseek.make_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    prompts, new_tokens = test_models_deepseek.PROMPTS, 16
    runs = {
        use_triton: generate_greedy(
            load_cuda(tmp_path, use_triton), prompts, new_tokens, prefill_chunk=5, stagger=3,
            shuffle_blocks=True,
        )
        for use_triton in (True, False)
    }  # fmt: skip
    assert runs[True].tokens == runs[False].tokens
    for a, b in zip(runs[True].logits, runs[False].logits, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert_matches(runs[True], [hf_greedy(hf_model, p, new_tokens) for p in prompts], ATOL)


def test_decode_layer_replays_from_a_cuda_graph() -> None:
    """A decode-only step of LatentAttention on the Triton path captured in a CUDA graph, then
    replayed after the inputs and lengths changed in place, equals the eager step on the new
    inputs (within the einsums' rounding): the launches read no host value."""
    dims, page, batch = V2_LITE, 16, 4
    cache = torch.randn(64, page, dims.rank + dims.rope, device=CUDA).bfloat16()
    width = dims.heads * (dims.nope + dims.v_dim)
    weight = (torch.randn(width, dims.rank, device=CUDA) / 20).bfloat16()
    tables = torch.arange(64, dtype=torch.int32, device=CUDA).view(batch, 16)
    lens = torch.tensor([100, 7, 256, 33], dtype=torch.int32, device=CUDA)
    inputs = [
        torch.randn(batch, dims.heads, dims.nope, device=CUDA).bfloat16(),
        torch.randn(batch, dims.heads, dims.rope, device=CUDA).bfloat16(),
        torch.randn(batch, dims.rank, device=CUDA).bfloat16(),
        torch.randn(batch, dims.rope, device=CUDA).bfloat16(),
    ]
    slots = last_slots(tables, lens, page)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, device=CUDA, dtype=torch.int32),
        seq_lens=lens, block_tables=tables, max_query_len=1, max_seq_len=256,
        query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=lens.tolist(),
    )  # fmt: skip
    layer = LatentAttention(dims.heads, dims.rank, dims.nope, dims.rope, dims.v_dim, SCALE)
    layer.bind_cache([cache])
    with forward_context(meta, None):
        layer(*inputs, weight)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(*inputs, weight)
    for x in inputs:
        x.copy_(torch.randn_like(x, dtype=torch.float32).bfloat16())
    lens.copy_(torch.tensor([255, 1, 12, 200], dtype=torch.int32))
    slots.copy_(last_slots(tables, lens, page))
    graph.replay()
    with forward_context(meta, None):
        eager = layer(*inputs, weight)
    # The same kernels; cuBLAS may pick another algorithm for the einsums under capture. Stale
    # lengths would attend over other rows altogether.
    assert relative_error(captured, eager) < 1e-3


def last_slots(tables: torch.Tensor, lens: torch.Tensor, page: int) -> torch.Tensor:
    """Each sequence's last token's cache slot, through its block table."""
    last = lens.long() - 1
    return tables.gather(1, (last // page)[:, None])[:, 0].long() * page + last % page


def engine_tokens(
    folder: Path, batches: list[list[list[int]]], **kwargs: object
) -> tuple[list, object]:
    """Greedy tokens through ``LLM`` on CUDA in float32, one ``generate`` a batch (a later one
    finds the earlier ones' blocks in the prefix cache), and the runner's graph runner."""
    llm = LLM(str(folder), device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=128,
              block_size=4, **kwargs)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        tokens = [
            out.token_ids
            for prompts in batches
            for out in llm.generate(prompts, params, detokenize=False)
        ]
        return tokens, llm.engine.runner.graph_runner
    finally:
        llm.engine.shutdown()


def test_engine_replays_deepseek_decodes_from_graphs_as_eager_and_hf(tmp_path: Path) -> None:
    """The engine captures a tiny DeepSeek-V3's decode steps (not its prompt steps): its greedy
    tokens equal --enforce-eager's and HF's, a prompt after another's cached blocks too."""
    hf_model = test_models_deepseek.make_hf_model("v3")
    hf_model.save_pretrained(tmp_path)
    prompts = test_models_deepseek.PROMPTS
    batches = [prompts, [prompts[2][:20] + [7, 8, 9]]]
    graphed, graphs = engine_tokens(tmp_path, batches)
    assert graphs is not None and graphs.graphs and not graphs.prefill_graphs
    eager, no_graphs = engine_tokens(tmp_path, batches, enforce_eager=True)
    assert no_graphs is None
    want = [hf_greedy(hf_model, p, 16).tokens[0] for batch in batches for p in batch]
    assert graphed == eager == want
