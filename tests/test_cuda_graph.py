"""CUDA graphs, decode and prefill: replay equals eager, padding rows touch nothing, greedy
tokens equal HF (with chunked and prefix-cached prefills going through the prefill graphs).

The GPU tests are skipped where there is no CUDA device; the bucket arithmetic runs everywhere.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from engine_core.attention.base import AttentionBackend, AttentionMetadata
from engine_core.attention.prefill_tiles import capacity, tile_list
from engine_core.config import ModelConfig
from engine_core.cuda_graph import (
    CudaGraphRunner,
    extends_prefill_graphs,
    graph_batch_sizes,
    prefill_graph_bounds,
    prefill_graph_sizes,
)
from engine_core.forward_context import forward_context

if TYPE_CHECKING:
    from engine_core.llm import LLM

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_graph_batch_sizes_cover_every_batch_up_to_the_cap() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
    assert len(graph_batch_sizes(256)) == 4 + 31


def test_shared_graph_sizes_double_from_the_minimum_rows_up_to_their_cap() -> None:
    from engine_core.cuda_graph import shared_graph_sizes

    halves = [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
    assert shared_graph_sizes(1024) == halves
    assert shared_graph_sizes(256) == halves[:11]
    assert shared_graph_sizes(48) == [8, 12, 16, 24, 32, 48]
    assert shared_graph_sizes(40) == [8, 12, 16, 24, 32, 40]
    assert shared_graph_sizes(8) == [8]
    assert shared_graph_sizes(6) == []  # under SHARED_PREFIX_MIN_ROWS


@pytest.mark.parametrize(
    ("options", "shared_sizes", "pass_in_decode_graphs"),
    [
        ({}, [8, 12], False),  # graphs of their own for steps over shared pages
        ({"lora_slots": 2}, [], True),  # LoRA: the decode graphs carry the pass (as before)
        ({"shared_decode_graphs": False}, [], False),  # EAGLE-3's head: never shared pages
        ({"num_kv_groups": 2}, [], False),  # windows or chunks: pages not shared alike
    ],
)
def test_which_decode_graphs_attend_shared_pages(
    tmp_path: Path, options: dict[str, Any], shared_sizes: list[int], pass_in_decode_graphs: bool
) -> None:
    """Where the shared-prefix pass goes, decided as the runner is built (the probe at
    capture may still drop the shared graphs): graphs of their own (half doublings up to
    max_num_seqs), in the decode graphs themselves, or nowhere."""
    from engine_core.attention.torch_ref import TorchReferenceBackend
    from engine_core.cuda_graph import CudaGraphRunner
    from engine_core.llm import LLM
    from tests.factories import write_tiny_llama

    llm = LLM(str(write_tiny_llama(tmp_path)), device="cpu", block_size=16, num_kv_blocks=32)
    cpu = torch.device("cpu")
    common = {"max_model_len": 128, "block_size": 16, "hidden_size": 64, "device": cpu}
    graphs = CudaGraphRunner(
        llm.engine.runner.model, TorchReferenceBackend(), max_num_seqs=12, dtype=torch.float32,
        **common, **options,
    )  # fmt: skip
    assert graphs.shared_sizes == shared_sizes
    assert graphs.pass_in_decode_graphs == pass_in_decode_graphs


def test_tile_list_names_each_sequences_query_tiles_then_pads() -> None:
    # Query lengths 5, 1, 40 at 16 rows a tile: 1, 1 and 3 tiles.
    tiles = tile_list([5, 1, 40], block_m=16, rows=8)
    padding = [[-1, 0]] * 3
    assert tiles.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2], *padding]
    assert tile_list([64, 65], block_m=64).tolist() == [[0, 0], [1, 0], [1, 1]]
    # The bound a graph is captured with holds for any split of its tokens.
    assert capacity(46, 3, 16) == 3 + 3 >= len(tile_list([5, 1, 40], 16))
    with pytest.raises(ValueError, match="do not fit"):
        tile_list([40], block_m=16, rows=2)


def test_prefill_graph_sizes_double_up_to_the_cap() -> None:
    assert prefill_graph_sizes(0) == []
    assert prefill_graph_sizes(8) == [8]
    assert prefill_graph_sizes(16) == [16]
    assert prefill_graph_sizes(100) == [16, 32, 64, 100]
    assert prefill_graph_sizes(300) == [16, 32, 64, 128, 256, 300]


def test_prefill_graph_sizes_double_then_step_by_quarters_up_to_the_cap() -> None:
    quarters = [320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    assert prefill_graph_sizes(2048) == [16, 32, 64, 128, 256, *quarters]
    assert prefill_graph_sizes(8192) == [16, 32, 64, 128, 256, *quarters, 4096, 8192]
    sizes = prefill_graph_sizes(2048)
    # From 256 on, a step of any token count pads by at most a quarter.
    for tokens in range(257, 2049):
        padded = min(size for size in sizes if size >= tokens)
        assert padded <= 1.25 * tokens, (tokens, padded)


def test_prefill_graph_bounds_follow_the_flag() -> None:
    # Unset: 2,048 always, up to the step budget where measured worth it; one GPU only.
    assert prefill_graph_bounds(None, 8192, 1) == (2048, 8192)
    assert prefill_graph_bounds(None, 8192, 2) == (2048, 0)
    assert prefill_graph_bounds(None, 1024, 1) == (1024, 1024)  # nothing past the budget
    # Set: exactly that (within the budget), never measured or extended.
    assert prefill_graph_bounds(4096, 8192, 1) == (4096, 0)
    assert prefill_graph_bounds(16384, 8192, 1) == (8192, 0)
    assert prefill_graph_bounds(0, 8192, 1) == (0, 0)


def test_prefill_graphs_extend_only_where_the_host_outlasts_a_whole_steps_gpu_work() -> None:
    # 2,048-token graph: 1 ms on the GPU. To 8,192 tokens that is 4 ms of GPU work at most.
    assert extends_prefill_graphs(host_s=0.015, gpu_s=0.001, top=2048, extend_to=8192)
    assert not extends_prefill_graphs(host_s=0.0039, gpu_s=0.001, top=2048, extend_to=8192)
    # llama-1b-like: 12 ms of launches against 5 ms of kernels (20 ms at 8,192 tokens).
    assert not extends_prefill_graphs(host_s=0.012, gpu_s=0.005, top=2048, extend_to=8192)
    # To 4,096 only: twice the GPU work, which 12 ms of launches still outlast.
    assert extends_prefill_graphs(host_s=0.012, gpu_s=0.005, top=2048, extend_to=4096)
    # Nothing to extend to, or no prefill graph to measure.
    assert not extends_prefill_graphs(host_s=1.0, gpu_s=0.001, top=2048, extend_to=2048)
    assert not extends_prefill_graphs(host_s=1.0, gpu_s=0.001, top=0, extend_to=8192)


# ---- replay against eager on a random-weight model ------------------------------------------

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024


def decode_batch(
    n: int, num_blocks: int, rng: random.Random, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """n decoding sequences on distinct random blocks, contexts from 1 to ~MAX_MODEL_LEN/2."""
    seq_lens = [rng.randint(1, MAX_MODEL_LEN // 2) for _ in range(n)]
    width = max(-(-s // BLOCK_SIZE) for s in seq_lens)
    free = rng.sample(range(num_blocks), n * width)
    tables = torch.tensor(free, dtype=torch.int32).view(n, width)
    positions = torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64)
    slots = tables[torch.arange(n), positions // BLOCK_SIZE].long() * BLOCK_SIZE
    slots += positions % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=seq_lens,
    )
    ids = torch.tensor([rng.randrange(vocab) for _ in range(n)], device=device)
    return ids, positions.to(device), meta


@dataclass
class GraphsOnRandomModel:
    """A random-weight model on the GPU over a random bf16 KV cache, its graphs captured."""

    model: torch.nn.Module
    config: ModelConfig
    cache: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    backend: AttentionBackend
    graphs: CudaGraphRunner


def graphs_on_random_model(
    preset: str,
    seed: int,
    num_blocks: int,
    max_num_seqs: int,
    max_prefill_tokens: int = 0,
    extend_prefill_to: int = 0,
    block_size: int = BLOCK_SIZE,
) -> GraphsOnRandomModel:
    from engine_core.attention.triton_backend import TritonBackend
    from engine_core.presets import build_random_model

    device = torch.device("cuda")
    model, config = build_random_model(preset, device, torch.bfloat16, seed=seed)
    cache = torch.randn(
        config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim,
        device=device,
    ).to(torch.bfloat16)  # fmt: skip
    for i, layer in enumerate(model.attention_layers()):
        layer.k_cache, layer.v_cache = cache[i, 0], cache[i, 1]
    backend = TritonBackend()
    graphs = CudaGraphRunner(
        model,
        backend,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        hidden_size=config.hidden_size,
        dtype=torch.bfloat16,
        device=device,
        max_prefill_tokens=max_prefill_tokens,
        extend_prefill_to=extend_prefill_to,
        vocab_size=config.vocab_size,  # the decode graphs capture the logits and their argmax
    )
    graphs.capture(progress=False)
    return GraphsOnRandomModel(model, config, cache, backend, graphs)


def check_replay_equals_eager(
    on: GraphsOnRandomModel,
    ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    label: str,
    tolerance: float = 2e-2,
) -> None:
    """The graph's output is eager's; it wrote the same new K/V into the same slots, and its
    padding rows (slot -1) wrote nothing."""
    cache = on.cache
    before = cache.clone()
    with torch.inference_mode(), forward_context(meta, on.backend):
        eager = on.model(ids, positions).float()
    after_eager = cache.clone()
    cache.copy_(before)
    with torch.inference_mode():
        hidden = on.graphs.run(ids, positions, meta)
        check_decode_tail(on, hidden, meta)
        replayed = hidden.float()
    assert replayed.shape == eager.shape
    assert torch.isfinite(replayed).all()
    err = ((replayed - eager).norm() / eager.norm()).item()
    assert err < tolerance, f"{label}: graph vs eager relative error {err:.2e}"
    num_slots = cache.shape[2] * cache.shape[3]
    written = torch.zeros(num_slots, dtype=torch.bool, device=cache.device)
    written[meta.slot_mapping] = True
    flat = (on.config.num_layers, 2, num_slots, -1)
    untouched = ~written
    assert torch.equal(cache.view(flat)[:, :, untouched], before.view(flat)[:, :, untouched])
    new_graph = cache.view(flat)[:, :, written].float()
    new_eager = after_eager.view(flat)[:, :, written].float()
    assert ((new_graph - new_eager).norm() / new_eager.norm()).item() < 2e-2


def check_decode_tail(
    on: GraphsOnRandomModel, hidden: torch.Tensor, meta: AttentionMetadata
) -> None:
    """A decode replay hands out, once, the logits the model projects from its output (within
    the rounding of F.linear's: on Hopper the skinny GEMM computes them) and their argmax over
    the vocabulary; a prefill replay hands out none."""
    tail = on.graphs.take_tail()
    assert on.graphs.take_tail() is None
    if not meta.is_decode_only:
        assert tail is None
        return
    assert tail is not None
    logits, argmax = tail
    expected = on.model.compute_logits(hidden, widen=False)
    assert logits.shape == expected.shape == (meta.num_seqs, on.config.vocab_size)
    err = (logits.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err.item() <= 2**-7, f"logits differ from F.linear's by {err.item():.2e}"
    assert torch.equal(argmax, logits[:, : on.config.vocab_size].argmax(dim=-1))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("preset", ["smollm2-135m", "gpt2"])
def test_graph_replay_equals_eager(preset: str) -> None:
    num_blocks = 1024  # room for 24 sequences of up to MAX_MODEL_LEN / 2 tokens
    on = graphs_on_random_model(preset, seed=3, num_blocks=num_blocks, max_num_seqs=24)
    rng = random.Random(0)
    device = on.cache.device
    for n in (1, 3, 8, 13, 24):
        ids, positions, meta = decode_batch(n, num_blocks, rng, on.config.vocab_size, device)
        check_replay_equals_eager(on, ids, positions, meta, f"batch {n}")


def mixed_step(
    specs: list[tuple[int, int]],
    num_blocks: int,
    rng: random.Random,
    vocab: int,
    device: torch.device,
    block_size: int = BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One step over sequences given as (context already cached, new tokens): whole prompts
    (context 0), prefix-cached prompts and chunks (context > 0), decodes (1 new token)."""
    seq_lens = [context + new for context, new in specs]
    width = max(-(-s // block_size) for s in seq_lens)
    tables = torch.tensor(rng.sample(range(num_blocks), len(specs) * width), dtype=torch.int32)
    tables = tables.view(len(specs), width)
    positions = torch.cat([torch.arange(c, c + n) for c, n in specs])
    seq_of_row = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(specs)])
    slots = tables[seq_of_row, positions // block_size].long() * block_size
    slots += positions % block_size
    starts = [0]
    for _, n in specs:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        max_query_len=max(n for _, n in specs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    ids = torch.tensor([rng.randrange(vocab) for _ in range(starts[-1])], device=device)
    return ids, positions.to(device), meta


GRAPH_SEQS = 16  # max_num_seqs of the graphs below

# Steps the prefill graphs must run as eager does: one prompt below, at and above a bucket's
# size, a prefix-cached prompt, a chunk after earlier chunks, prompts mixed with decodes, the
# most sequences a graph takes (one prompt among 15 decodes; 16 short prompts).
PREFILL_STEPS = [
    [(0, 5)],
    [(0, 16)],
    [(0, 17)],
    [(0, 200)],
    [(48, 30)],
    [(300, 64), (90, 1), (0, 12)],
    [(0, 40), (17, 1), (5, 1), (60, 33)],
    [(0, 100)] + [(20 + 9 * i, 1) for i in range(GRAPH_SEQS - 1)],
    [(i * 7, 9) for i in range(GRAPH_SEQS)],
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("preset", ["smollm2-135m", "gpt2"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_graph_replay_equals_eager(preset: str, block_size: int) -> None:
    """Pages of 32 tokens replay as eager runs them too. (Both presets' heads are of 64, so
    their prompt rows keep the pointer-load kernel; the descriptor-load variant, heads of 128
    only, replays in test_prefill_graphs_replay_the_descriptor_load_kernel.)"""
    num_blocks = 512
    on = graphs_on_random_model(
        preset, seed=4, num_blocks=num_blocks, max_num_seqs=GRAPH_SEQS, max_prefill_tokens=256,
        block_size=block_size,
    )  # fmt: skip
    assert sorted(on.graphs.prefill_graphs) == [16, 32, 64, 128, 256]
    rng = random.Random(1)
    vocab, device = on.config.vocab_size, on.cache.device
    for specs in PREFILL_STEPS:
        ids, positions, meta = mixed_step(specs, num_blocks, rng, vocab, device, block_size)
        assert on.graphs.can_run(meta), specs
        check_replay_equals_eager(on, ids, positions, meta, str(specs))
    # Steps past the graphs' bounds run eagerly.
    too_many_seqs = [(0, 2)] * (GRAPH_SEQS + 1)
    too_many_tokens = [(0, 257)]
    for specs in (too_many_seqs, too_many_tokens):
        _, _, meta = mixed_step(specs, num_blocks, rng, vocab, device, block_size)
        assert not on.graphs.can_run(meta)


@pytest.mark.gpu
@requires_cuda
def test_prefill_graphs_replay_the_descriptor_load_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heads of 128 over pages of 32: the prompt rows attend through the descriptor-load
    variant, whose descriptor scratch a graph's capture takes from the graph's pool; every
    replay equals the eager run, a graph's padding rows included."""
    from engine_core import presets
    from engine_core.attention import triton_kernels

    hf = presets._llama(512, 2, 4, 2, 1024, tied=True, theta=10000.0)  # 4 heads of 128
    monkeypatch.setitem(presets._HF_CONFIGS, "heads-of-128", hf)
    monkeypatch.setitem(presets.PRESETS, "heads-of-128", presets.model_config_from_hf(hf))
    calls: list[int] = []
    real = triton_kernels.tma_page_prefill_attention

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_kernels, "tma_page_prefill_attention", counted)
    num_blocks = 512
    on = graphs_on_random_model(
        "heads-of-128", seed=4, num_blocks=num_blocks, max_num_seqs=GRAPH_SEQS,
        max_prefill_tokens=256, block_size=32,
    )  # fmt: skip
    assert on.config.head_dim == 128 and calls  # the capture took the variant
    rng = random.Random(1)
    vocab, device = on.config.vocab_size, on.cache.device
    for specs in PREFILL_STEPS:
        ids, positions, meta = mixed_step(specs, num_blocks, rng, vocab, device, 32)
        assert on.graphs.can_run(meta), specs
        check_replay_equals_eager(on, ids, positions, meta, str(specs))


@pytest.mark.gpu
@requires_cuda
def test_extended_prefill_graphs_replay_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where start-up finds the host the bottleneck, prefill graphs go on to the step's whole
    budget, and the steps past the old bound replay as eager runs them."""
    import engine_core.cuda_graph as cuda_graph

    timings: list[int] = []
    measure = CudaGraphRunner._eager_and_graph_seconds

    def measured(self: CudaGraphRunner, size: int) -> tuple[float, float]:
        host_s, gpu_s = measure(self, size)  # the real measurement runs (and must not fail) ...
        timings.append(size)
        return 1.0, gpu_s  # ... then a host this slow makes the decision certain

    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "_eager_and_graph_seconds", measured)
    num_blocks = 512
    on = graphs_on_random_model(
        "smollm2-135m", seed=4, num_blocks=num_blocks, max_num_seqs=GRAPH_SEQS,
        max_prefill_tokens=64, extend_prefill_to=300,
    )  # fmt: skip
    assert timings == [64]
    assert sorted(on.graphs.prefill_graphs) == [16, 32, 64, 128, 256, 300]
    assert on.graphs.max_prefill_tokens == 300
    rng = random.Random(2)
    vocab, device = on.config.vocab_size, on.cache.device
    for specs in ([(0, 65)], [(0, 200), (40, 1)], [(0, 290), (7, 10)], [(16, 260)]):
        ids, positions, meta = mixed_step(specs, num_blocks, rng, vocab, device)
        assert on.graphs.can_run(meta), specs
        check_replay_equals_eager(on, ids, positions, meta, str(specs))
    _, _, meta = mixed_step([(0, 301)], num_blocks, rng, vocab, device)
    assert not on.graphs.can_run(meta)


@pytest.mark.gpu
@requires_cuda
def test_prefill_graphs_stay_where_the_gpu_is_the_bottleneck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine_core.cuda_graph as cuda_graph

    monkeypatch.setattr(
        cuda_graph.CudaGraphRunner, "_eager_and_graph_seconds", lambda self, size: (0.001, 0.001)
    )
    on = graphs_on_random_model(
        "gpt2", seed=4, num_blocks=64, max_num_seqs=GRAPH_SEQS, max_prefill_tokens=64,
        extend_prefill_to=300,
    )  # fmt: skip
    assert sorted(on.graphs.prefill_graphs) == [16, 32, 64]
    assert on.graphs.max_prefill_tokens == 64


@pytest.mark.gpu
@requires_cuda
def test_engine_measures_its_host_for_prefill_graphs_only_when_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the engine: with --max-prefill-graph-tokens unset, start-up measures and (here
    told the host is slow) extends the prefill graphs to the step budget; set, it measures
    nothing and keeps the bound given."""
    import engine_core.cuda_graph as cuda_graph

    measured: list[int] = []
    measure = CudaGraphRunner._eager_and_graph_seconds

    def slow_host(self: CudaGraphRunner, size: int) -> tuple[float, float]:
        measured.append(size)
        return 1.0, measure(self, size)[1]

    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "_eager_and_graph_seconds", slow_host)
    model_dir = write_tiny_gpt2(tmp_path / "gpt2")
    auto = tiny_llm_on_cuda(model_dir, max_num_batched_tokens=4096)
    graphs = auto.engine.runner.graph_runner
    assert graphs is not None and measured == [2048]
    assert graphs.max_prefill_tokens == 4096 and 4096 in graphs.prefill_graphs
    measured.clear()
    fixed = tiny_llm_on_cuda(model_dir, max_num_batched_tokens=4096, max_prefill_graph_tokens=64)
    graphs = fixed.engine.runner.graph_runner
    assert graphs is not None and measured == []
    assert sorted(graphs.prefill_graphs) == [16, 32, 64]


# ---- greedy tokens through the engine, graphs on, against HF transformers on the GPU --------


def write_tiny_gpt2(path: Path, vocab_size: int = 384) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        n_inner=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wte.weight.mul_(8.0)  # tied head: well-separated greedy choices
    model.save_pretrained(path)
    return path


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    # Our ignore_eos keeps going past EOS without masking it; HF does the same with no EOS set
    # (its min_new_tokens would mask EOS instead).
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def tiny_llm_on_cuda(
    model_dir: Path, enforce_eager: bool = False, device: str = "cuda", **options: Any
) -> LLM:
    """An offline engine over a tiny test model on CUDA (or ``device``): float32, 8 sequences
    at most, 128 blocks of 16 tokens, and ``options`` (more engine arguments)."""
    from engine_core.llm import LLM

    return LLM(
        str(model_dir),
        device=device,
        dtype="float32",
        block_size=16,
        num_kv_blocks=128,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
        **options,
    )


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_tokens_equal_hf_on_gpu(
    architecture: str, enforce_eager: bool, tmp_path: Path
) -> None:
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path) if architecture == "llama" else write_tiny_gpt2(tmp_path)
    rng = random.Random(5)
    # Five sequences: decode batches pad to the captured size 8; lengths cross block borders.
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 9, 16, 33, 70)]
    max_tokens = 24
    llm = tiny_llm_on_cuda(model_dir, enforce_eager)
    assert (llm.engine.runner.graph_runner is None) == enforce_eager
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, detokenize=False)]
    assert ours == hf_greedy(model_dir, prompts, max_tokens)
    graphs = llm.engine.runner.graph_runner
    if architecture == "llama" and graphs is not None:
        # Heads of 16 rotate in the decode launch, but in two launches with the shared pass
        # (TritonBackend.decode_rotated): the shared decode graph of 8 rows is kept.
        assert sorted(graphs.shared_graphs) == [8]


@pytest.mark.gpu
@requires_cuda
def test_no_shared_decode_graphs_where_no_layer_takes_the_pass(tmp_path: Path) -> None:
    """Over an FP8 cache the backend declines the shared-prefix pass in every layer: the
    capture's probe drops the shared decode graphs (none captured, none chosen)."""
    from engine_core.llm import LLM
    from tests.factories import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path)
    llm = LLM(
        str(model_dir), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", block_size=16,
        num_kv_blocks=128, max_num_seqs=8,
    )  # fmt: skip
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and graphs.shared_graphs == {} and graphs.shared_sizes == []


@pytest.mark.gpu
@requires_cuda
def test_chunked_and_cached_prefills_through_graphs_equal_hf(tmp_path: Path) -> None:
    """Prompts that share a prefix (prefix-cache hits) and prompts longer than the step budget
    (chunks after earlier chunks), every prefill step small enough for a prefill graph."""
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path)
    rng = random.Random(8)
    shared = [rng.randrange(3, 384) for _ in range(70)]
    prompts = [shared + [rng.randrange(3, 384) for _ in range(n)] for n in (3, 20, 41)]
    prompts.append([rng.randrange(3, 384) for _ in range(150)])  # three chunks of 64
    max_tokens = 24
    llm = tiny_llm_on_cuda(model_dir, max_num_batched_tokens=64, enable_prefix_caching=True)
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and graphs.max_prefill_tokens == 64
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # One at a time, so the later prompts find the shared prefix in the cache.
    ours = [llm.generate([p], params, detokenize=False)[0].token_ids for p in prompts]
    hits = llm.engine.scheduler.counts().prefix_cache_hits
    assert hits >= 2 * (70 // 16) * 16, hits
    assert ours == hf_greedy(model_dir, prompts, max_tokens)


@pytest.mark.gpu
@requires_cuda
def test_a_burst_sharing_a_prefix_through_graphs_equals_hf(tmp_path: Path) -> None:
    """Prompts sharing 70 tokens sent at once: the later ones, admitted in the same step,
    hit the blocks the first computes in that step (the Triton kernels write every row's K/V
    before any row attends), in one prefill graph, with overlap."""
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path)
    rng = random.Random(9)
    shared = [rng.randrange(3, 384) for _ in range(70)]
    prompts = [shared + [rng.randrange(3, 384) for _ in range(n)] for n in (3, 20, 41, 9)]
    llm = tiny_llm_on_cuda(model_dir, max_num_batched_tokens=256, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, detokenize=False)]
    hits = llm.engine.scheduler.counts().prefix_cache_hits
    assert hits == 3 * (70 // 16) * 16, hits
    assert ours == hf_greedy(model_dir, prompts, 16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("head_dim", [128, 16])
def test_decodes_over_a_shared_system_prompt_equal_hf(
    monkeypatch: pytest.MonkeyPatch, enforce_eager: bool, head_dim: int, tmp_path: Path
) -> None:
    """Eight conversations opening with the same 300-token system prompt decode together: the
    prefix cache gives them its 18 whole blocks, which each decode step names as its shared
    prefix (attended once for all rows, attention/triton_kernels.py _shared_prefix_kernel),
    through the decode graphs or eagerly. Heads of 128 take the plain decode path; heads of
    16 rotate in the decode launch but not in these steps (TritonBackend.decode_rotated
    writes first, then takes the pass). The start-up
    warm-up built the pass's kernels (engine_core/warm_up.py, the shared-prefix decodes):
    serving compiles neither attention kernel (in this process; a variant that earlier work
    in it built would not show)."""
    import triton

    from engine_core.attention import triton_kernels
    from engine_core.attention.triton_backend import TritonBackend
    from engine_core.cuda_graph import GraphBuffers
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    # The pass's launches in decode steps (at the warm-up, the capture, and eager steps), not
    # in steps with prompt rows (mixed_starts given).
    launches: list[int] = []
    launch = triton_kernels._shared_prefix_partials

    def counted(*args: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        if args[8] is None:
            launches.append(1)
        return launch(*args)

    monkeypatch.setattr(triton_kernels, "_shared_prefix_partials", counted)
    staged: list[int] = []
    if enforce_eager:
        chosen = TritonBackend.shared_prefix

        def spy(self: TritonBackend, *args: Any) -> torch.Tensor | None:
            shared = chosen(self, *args)
            staged.append(0 if shared is None else int(shared[0]))
            return shared

        monkeypatch.setattr(TritonBackend, "shared_prefix", spy)
    else:
        stage = GraphBuffers.stage_shared_prefix

        def record(self: GraphBuffers, shared: torch.Tensor | None) -> None:
            staged.append(0 if shared is None else int(shared[0]))
            stage(self, shared)

        monkeypatch.setattr(GraphBuffers, "stage_shared_prefix", record)
    model_dir = write_tiny_llama(tmp_path, head_dim=head_dim)
    rng = random.Random(12)
    system = [rng.randrange(3, 384) for _ in range(300)]
    prompts = [system + [rng.randrange(3, 384) for _ in range(n)] for n in range(3, 27, 3)]
    llm = tiny_llm_on_cuda(
        model_dir, enforce_eager, max_num_batched_tokens=512, enable_prefix_caching=True
    )
    at_start = len(launches)  # the warm-up's and the graphs' capture's
    launches.clear()
    staged.clear()
    compiled: list[str] = []
    monkeypatch.setattr(
        triton.knobs.runtime, "jit_cache_hook", lambda **kw: compiled.append(kw["repr"])
    )
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm.engine.runner.step_shapes = []  # as the profiler records them
    ours = [o.token_ids for o in llm.generate(prompts, params, detokenize=False)]
    assert not [c for c in compiled if "_shared_prefix_kernel" in c or "_decode_kernel" in c]
    assert max(staged) == 18 * 16, staged
    # The steps file says so: the steps of all eight rows, their 18 shared blocks, and the
    # graph of eight rows with the pass (none when eager).
    full = [s for s in llm.engine.runner.step_shapes if s.new == (1,) * len(prompts)]
    assert full and {(s.shared, s.graph_rows) for s in full} == {
        (18 * 16, 0 if enforce_eager else len(prompts))
    }
    assert at_start and (launches or not enforce_eager)  # graphs replay the pass unseen
    graphs = llm.engine.runner.graph_runner
    if graphs is not None:  # the graphs with the pass replayed those steps
        assert sorted(graphs.shared_graphs) == [8] and graphs.shared_replays >= 10
    assert ours == hf_greedy(model_dir, prompts, 20)


@pytest.mark.gpu
@requires_cuda
def test_decodes_beside_prompt_chunks_over_a_shared_system_prompt_equal_hf(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Twelve conversations over one 300-token system prompt at once, their prompts taken
    in 512-token steps: the first ones decode while the later ones' chunks run beside them,
    and those steps (prefill graphs) attend their one-token sequences' shared pages once
    (attention/triton_kernels.py, MIXED). Every reply equals HF's."""
    from engine_core.cuda_graph import GraphBuffers
    from engine_core.llm import LLM
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    staged: list[int] = []  # the shared tokens of each step with prompt rows
    stage = GraphBuffers.stage_common

    def record(self: GraphBuffers, step: Any, metas: Any, rows: int) -> None:
        shared = metas[0].shared_prefix
        staged.append(0 if shared is None else int(shared[0]))
        stage(self, step, metas, rows)

    monkeypatch.setattr(GraphBuffers, "stage_common", record)
    model_dir = write_tiny_llama(tmp_path, head_dim=128)
    rng = random.Random(13)
    system = [rng.randrange(3, 384) for _ in range(300)]
    # Their own parts of 40-150 tokens: prefilling them takes a few steps, beside decodes.
    prompts = [system + [rng.randrange(3, 384) for _ in range(n)] for n in range(40, 160, 10)]
    llm = LLM(
        str(model_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=256,
        max_num_seqs=16, max_num_batched_tokens=512, enable_prefix_caching=True,
    )  # fmt: skip
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(prompts, params, detokenize=False)]
    assert 18 * 16 in staged, staged
    assert ours == hf_greedy(model_dir, prompts, 20)


# compiled_after_warm_up's workloads: prompt lengths, and the tokens each prompt generates.
FIRST_PROMPTS, FIRST_MAX_TOKENS = (40, 50, 60), (8, 8, 8)
SECOND_PROMPTS, SECOND_MAX_TOKENS = (20, 33, 47, 70, 78), (280, 200, 150, 100, 60)
SECOND_WORKLOAD_TOKENS = sum(SECOND_MAX_TOKENS)  # EOS ignored
NO_COMPILE_PREFILL_GRAPH_TOKENS = 32  # longer prompt steps run eagerly


def no_compile_check_engine(architecture: str, model_dir: Path, device: str) -> LLM:
    """compiled_after_warm_up's engine over a tiny model of ``architecture`` it writes."""
    from tests.factories import write_tiny_llama, write_tiny_qwen3_moe

    if architecture == "llama":
        model_dir = write_tiny_llama(model_dir)
    else:  # head dim 32, as the GPU run that showed the MoE kernels compiling
        model_dir = write_tiny_qwen3_moe(model_dir, head_dim=32)
    return tiny_llm_on_cuda(
        model_dir, device=device, max_prefill_graph_tokens=NO_COMPILE_PREFILL_GRAPH_TOKENS
    )


def compiled_after_warm_up(
    architecture: str, model_dir: Path, device: str
) -> tuple[list[str], int]:
    """The Triton kernels this process builds for a second workload, and the tokens it
    generates, after a warm-up workload with the same features at other sizes: an eager
    prefill of another token count (prefill graphs up to 32 tokens only), decode past 16
    blocks of context (block tables 16 wide, whose row stride Triton would specialize as a
    multiple of 16), batches shrinking to one row.
    Run in a fresh process (see the test): a variant some earlier work in the process built
    would not show. On the CPU (no Triton there) it only runs the workloads."""
    from protocol.messages import SamplingParams

    llm = no_compile_check_engine(architecture, model_dir, device)
    rng = random.Random(3)

    def workload(lengths: tuple[int, ...], max_tokens: tuple[int, ...]) -> int:
        prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]
        kinds = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1}, {"logprobs": 2}]
        params = [
            SamplingParams(max_tokens=m, ignore_eos=True, **kinds[i % len(kinds)])
            for i, m in enumerate(max_tokens)
        ]
        return sum(len(o.token_ids) for o in llm.generate(prompts, params, detokenize=False))

    # The warm-up: one eager prefill of 150 tokens (300 expert slots), then 3 rows decoding
    # with tables 3 to 5 blocks wide.
    workload(FIRST_PROMPTS, FIRST_MAX_TOKENS)
    compiled: list[str] = []
    if device != "cpu":
        import triton

        triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(kw["repr"])
    # An eager prefill of 248 tokens (496 slots: a multiple of 16; with 8 experts the same
    # expert tiles and grouping block as 300), then contexts up to 300 tokens (tables 2 to 19
    # blocks wide), the requests ending one by one.
    tokens = workload(SECOND_PROMPTS, SECOND_MAX_TOKENS)
    return compiled, tokens


def _compiled_after_warm_up_main() -> None:
    """Child process entry: compiled_after_warm_up(*argv) as JSON on stdout's last line."""
    import json
    import sys

    architecture, model_dir, device = sys.argv[1:4]
    print(json.dumps(compiled_after_warm_up(architecture, Path(model_dir), device)))


def compiled_in_a_fresh_process(
    architecture: str, model_dir: Path, device: str
) -> tuple[list[str], int]:
    import json
    import subprocess
    import sys

    code = "from tests.test_cuda_graph import _compiled_after_warm_up_main as m; m()"
    done = subprocess.run(
        [sys.executable, "-c", code, architecture, str(model_dir), device],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    return compiled, tokens


def test_the_no_compile_check_runs_its_workloads_in_a_child_process(tmp_path: Path) -> None:
    """The plumbing of the GPU test below, on the CPU (no Triton kernel runs there): the child
    builds the model, runs both workloads to the end and answers in JSON."""
    assert compiled_in_a_fresh_process("llama", tmp_path, "cpu") == ([], SECOND_WORKLOAD_TOKENS)


def test_the_no_compile_checks_second_prefill_is_a_size_class_no_warm_up_built(
    tmp_path: Path,
) -> None:
    """Were the expert kernels' slot count (tokens x top-k) specialized again, Triton would
    build one variant for multiples of 16 and one for other counts. The engine's own start-up
    warm-up (engine_core/warm_up.py) and the first workload run eager MoE steps before the
    second workload: the GPU test below catches such a regression only while neither of them
    has a multiple of 16 and the second workload's eager prefill has one."""
    llm = no_compile_check_engine("qwen3_moe", tmp_path, "cpu")
    top_k = llm.engine.model_config.num_experts_per_tok
    warm_up_eager = [
        plan.num_batched_tokens
        for plan in llm.engine.runner.warm_up_plans()
        if plan.num_batched_tokens > NO_COMPILE_PREFILL_GRAPH_TOKENS
    ]
    assert warm_up_eager  # the budget-sized step
    for tokens in [*warm_up_eager, sum(FIRST_PROMPTS)]:
        assert tokens * top_k % 16 != 0, tokens
    assert sum(SECOND_PROMPTS) * top_k % 16 == 0


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("architecture", ["llama", "qwen3_moe"])
def test_nothing_compiles_mid_serving_as_contexts_and_batches_change(
    architecture: str, tmp_path: Path
) -> None:
    """Once a workload has run, another with the same features at other sizes compiles no
    Triton kernel (compiled_after_warm_up says which sizes). A compilation there stalls every
    running request: 85-116 ms with an empty Triton cache for the decode inputs' launch, 1.2 s
    for qwen3-30b-a3b's expert kernels (docs/design/cuda-graphs-and-warm-up.md, "Nothing compiles
    mid-serving"). In a fresh process, since a variant an earlier test built
    (test_graph_replay_equals_eager's tables reach 32 blocks) would hide one the serving path
    needs."""
    compiled, tokens = compiled_in_a_fresh_process(architecture, tmp_path, "cuda")
    assert tokens == SECOND_WORKLOAD_TOKENS  # the workload ran to the end
    assert compiled == []


@pytest.mark.gpu
@requires_cuda
def test_sampled_penalized_and_logprob_rows_through_decode_graphs_equal_eager(
    tmp_path: Path,
) -> None:
    """The decode graphs' logits feed the eager sampler for every row that needs more than an
    argmax: seeded sampling, a penalty and logprobs come out as with no graphs at all, and the
    argmax-only row, which takes the graph's argmax, as HF's greedy tokens."""
    from protocol.messages import SamplingParams
    from tests.factories import write_tiny_llama

    model_dir = write_tiny_llama(tmp_path)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (4, 17, 30, 45)]
    common = {"max_tokens": 20, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, **common),
        SamplingParams(temperature=0.0, logprobs=3, **common),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, **common),
        SamplingParams(temperature=0.0, **common),
    ]
    runs = {}
    for eager in (False, True):
        llm = tiny_llm_on_cuda(model_dir, eager)
        graphs = llm.engine.runner.graph_runner
        assert (graphs is None) == eager and (eager or graphs.tail is not None)
        runs[eager] = llm.generate(prompts, params, detokenize=False)
        del llm
    graphed, eager_outs = runs[False], runs[True]
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager_outs]
    for mine, theirs in zip(graphed[1].logprobs, eager_outs[1].logprobs, strict=True):
        assert mine.top_token_ids == theirs.top_token_ids
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
    assert graphed[3].token_ids == hf_greedy(model_dir, [prompts[3]], 20)[0]
