"""Greedy generation with our models over a paged KV cache, with no scheduler in between.

An independent check of the models and the attention backend: it allocates the KV tensors,
hands out blocks from a free list, builds AttentionMetadata for each flattened batch and runs the
forward inside forward_context, exactly as the interfaces describe, but without any of the model
runner's or scheduler's code. A CPU model runs as the engine runs it there: its linears packed
for oneDNN (models/cpu_gemm.py) and the CPU attention backend, unless a backend is given.
``generate_greedy`` can start sequences at different steps and split prompts into chunks, so
one forward mixes prefills, prefill chunks and decodes.

``hf_greedy`` is the reference side: HF transformers ``generate`` on the same weights;
``save_hf_case`` saves a random HF model and its references for the per-family tests, and
``assert_matches`` compares our greedy run with them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch
from torch import nn

from engine_core.attention.base import AttentionBackend, AttentionMetadata
from engine_core.attention.cpu_backend import CpuBackend
from engine_core.attention.torch_ref import TorchReferenceBackend
from engine_core.forward_context import forward_context
from engine_core.models.layers import pack_cpu_weights


def engine_backend(model: nn.Module) -> AttentionBackend:
    """The attention backend the engine runs ``model`` with, the model readied as the engine
    readies it: on the CPU its linears packed for oneDNN and the CPU backend; elsewhere the
    torch reference (the GPU tests pass the Triton backend themselves)."""
    if next(model.parameters()).device.type != "cpu":
        return TorchReferenceBackend()
    pack_cpu_weights(model)
    return CpuBackend()


@dataclass
class Sequence:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed


@dataclass
class GreedyResult:
    tokens: list[list[int]]  # new tokens per sequence
    logits: list[torch.Tensor]  # per sequence: [num_new, vocab] float32, the logits each came from


class PagedRunner:
    """Owns the KV cache of one model and runs flattened batches of (sequence, new tokens).

    The cache starts filled with NaN: a read of a slot that was never written poisons the
    output, so the tests catch any gather that strays outside a sequence's written tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int = 4,
        num_blocks: int = 256,
        shuffle_blocks: bool = False,
        fill: float = float("nan"),
        backend: AttentionBackend | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = backend or engine_backend(model)
        # The activations' dtype: a GGUF model's first parameter may be its embedding's blocks.
        weight = next(p for p in model.parameters() if p.is_floating_point())
        self.device = weight.device
        for layer in model.attention_layers():
            shapes = layer.cache_shapes(num_blocks, block_size)
            layer.bind_cache(
                [torch.full(s, fill, dtype=weight.dtype, device=weight.device) for s in shapes]
            )
        self.free_blocks = list(range(num_blocks))
        if shuffle_blocks:
            random.Random(0).shuffle(self.free_blocks)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` enough blocks to hold ``num_tokens`` tokens."""
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(self.free_blocks.pop(0))

    @torch.no_grad()
    def step(self, chunks: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Run one forward over the next ``n`` tokens of each sequence; [B, vocab] logits of
        each chunk's last token. Advances every sequence's ``num_computed``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start, seq_lens = [0], []
        for seq, n in chunks:
            start, end = seq.num_computed, seq.num_computed + n
            self.allocate(seq, end)
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [self.slot(seq, p) for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
        meta = self.metadata([seq for seq, _ in chunks], slots, query_start, seq_lens)
        with forward_context(meta, self.backend):
            hidden = self.model(self.int64(ids), self.int64(positions))  # [T, hidden]
        last = self.int64(query_start[1:]) - 1  # [B]
        for seq, n in chunks:
            seq.num_computed += n
        return self.model.compute_logits(hidden[last])  # [B, vocab]

    def int64(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def slot(self, seq: Sequence, position: int) -> int:
        block = seq.block_ids[position // self.block_size]
        return block * self.block_size + position % self.block_size

    def metadata(
        self,
        seqs: list[Sequence],
        slots: list[int],
        query_start: list[int],
        seq_lens: list[int],
    ) -> AttentionMetadata:
        width = max(len(seq.block_ids) for seq in seqs)
        tables = [seq.block_ids + [0] * (width - len(seq.block_ids)) for seq in seqs]
        int32 = {"dtype": torch.int32, "device": self.device}
        return AttentionMetadata(
            slot_mapping=self.int64(slots),
            query_start_loc=torch.tensor(query_start, **int32),
            seq_lens=torch.tensor(seq_lens, **int32),
            block_tables=torch.tensor(tables, **int32),
            max_query_len=max(end - start for start, end in pairwise(query_start)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=list(query_start),
            seq_lens_cpu=list(seq_lens),
        )


def generate_greedy(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    block_size: int = 4,
    prefill_chunk: int | None = None,
    stagger: int = 0,
    shuffle_blocks: bool = False,
    backend: AttentionBackend | None = None,
) -> GreedyResult:
    """Greedy-decode every prompt, all sequences sharing each forward.

    Sequence i joins at step ``i * stagger`` (so its prefill shares a batch with the others'
    decodes); ``prefill_chunk`` splits prompts into chunks of at most that many tokens.
    """
    runner = PagedRunner(
        model, block_size=block_size, shuffle_blocks=shuffle_blocks, backend=backend
    )
    seqs = [Sequence(list(p)) for p in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while any(len(out) < max_new_tokens for out in tokens):
        active = [
            i for i in range(len(seqs)) if step >= i * stagger and len(tokens[i]) < max_new_tokens
        ]
        step += 1
        if not active:
            continue
        chunks = [(seqs[i], min(seqs[i].num_pending, prefill_chunk or 1 << 30)) for i in active]
        for i, row in zip(active, runner.step(chunks), strict=True):
            if seqs[i].num_pending == 0:  # this chunk reached the end: sample
                token = int(row.argmax())
                seqs[i].token_ids.append(token)
                tokens[i].append(token)
                logits[i].append(row)
    return GreedyResult(tokens=tokens, logits=[torch.stack(rows) for rows in logits])


@torch.no_grad()
def hf_greedy(hf_model: nn.Module, prompt: list[int], max_new_tokens: int) -> GreedyResult:
    """HF transformers ``generate(do_sample=False)`` for one prompt, with EOS disabled."""
    input_ids = torch.tensor([prompt], device=hf_model.device)
    out = hf_model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,  # fixed-length outputs, so both sides generate the same count
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float()  # [num_new, vocab]
    return GreedyResult(tokens=[new], logits=[logits])


# ---- the per-family HF comparisons ---------------------------------------------------------------


def load_float32(folder: Path, **kwargs: object) -> nn.Module:
    """A checkpoint folder through our loader, on the CPU in float32 (as the HF comparisons run);
    ``kwargs`` go to ``load_model`` (e.g. a quantization)."""
    from engine_core.loader import load_model

    return load_model(str(folder), torch.device("cpu"), torch.float32, **kwargs).module


def random_prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """One prompt of random token ids per length, seeded by the length (the same every run)."""
    return [
        torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in lengths
    ]


def randomize(model: nn.Module, seed: int) -> None:
    """Every parameter random (HF zero-initialises biases, which would hide a bias bug); norm
    scales near 1 so activations keep a sane size."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            is_scale = param.ndim == 1 and name.endswith("weight")
            param.copy_(1 + noise if is_scale else noise)


@dataclass
class HFCase:
    name: str
    folder: Path  # the HF model, saved with save_pretrained
    hf_model: nn.Module
    prompts: list[list[int]]
    reference: list[GreedyResult]  # HF generate, one per prompt


def save_hf_case(
    name: str, hf_model: nn.Module, prompts: list[list[int]], folder: Path, new_tokens: int
) -> HFCase:
    """Save ``hf_model`` in ``folder`` and take HF's greedy reference for each prompt."""
    hf_model.save_pretrained(folder)
    reference = [hf_greedy(hf_model, prompt, new_tokens) for prompt in prompts]
    return HFCase(name, folder, hf_model, prompts, reference)


def assert_matches(got: GreedyResult, reference: list[GreedyResult], atol: float) -> None:
    """Our tokens equal HF's for each sequence, and the logits behind them agree within atol."""
    for i, ref in enumerate(reference):
        assert got.tokens[i] == ref.tokens[0], f"prompt {i}"
        torch.testing.assert_close(got.logits[i].cpu(), ref.logits[0], atol=atol, rtol=0)
