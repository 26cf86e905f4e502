"""Batched sampling on the logits' device: one call per step, one row per request.

Order of work on a row's logits (each stage is skipped when no row in the batch needs it):

1. drop padded vocabulary columns (``logits[:, :vocab_size]``);
2. penalties (repetition over prompt + output, then frequency and presence over the output);
3. logit_bias: each request's biases added to their tokens' logits;
4. the structured-output bitmask (engine_core/grammar.py): tokens the request's constraint does
   not allow next get -inf (rows without a constraint have every bit set);
5. min_tokens: EOS (unless ignore_eos) and the request's stop ids get -inf;
6. logprobs, when asked for, are read HERE: the log_softmax of the model's distribution after the
   penalties and masks that change what the model may say, but before temperature and top-k/p,
   min-p, which are choices of how to draw from it (vLLM's "raw" logprobs; OpenAI reports the
   model's probabilities too, not those of the truncated sampling distribution);
7. greedy rows: argmax; sampled rows: divide by temperature, filter (top-k, then top-p, then
   min-p) to -inf, and take the exponential race ``argmax(logits - log E)``, E ~ Exp(1) per
   token (the Gumbel-max trick: -log E is Gumbel). A filtered token stays at -inf, so it can
   never win.

Randomness: a row whose request has a seed draws E = -log U with U from a counter-based hash of
(seed, output position, token id), so its tokens depend on nothing else in the batch, on no
earlier step, and survive preemption and recompute; the hash is exact int64 arithmetic, so it is
the same on CPU and CUDA and costs a fixed number of kernels however many rows are seeded. Other
rows draw E from one torch.Generator owned by the Sampler.

Nothing here reads a device value on the host: the only host work is building a few per-step
tensors from the requests' parameters.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine_core.grammar import apply_bitmask
from engine_core.request import Request
from protocol.messages import SamplingParams

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: torch.Tensor | None  # [B] float32, the sampled token's; None if no row asked
    top_token_ids: torch.Tensor | None  # [B, N] int64, N = max top-N asked (caller slices)
    top_logprobs: torch.Tensor | None  # [B, N] float32, sorted descending along N


class Sampler:
    """Turns a step's logits into one token per request, batched on the logits' device."""

    def __init__(
        self, eos_token_ids: Sequence[int], vocab_size: int, seed: int | None = None
    ) -> None:
        """``seed`` seeds the generator of unseeded rows (None: a fresh random seed)."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        output_positions: Sequence[int] | Callable[[], Sequence[int]] | None = None,
        bitmask: torch.Tensor | None = None,
        argmax: torch.Tensor | None = None,
        ahead: Sequence[int] | None = None,
    ) -> SamplerOutput:
        """Sample from ``logits`` [B, V]; row i belongs to ``requests[i]``.

        The token drawn for row i is output number ``output_positions[i]`` of its request
        (default: ``request.num_output_tokens``, the next one). With overlap the request may
        already hold placeholders of steps planned after this one, so the runner passes them,
        as a function that computes them: a batch that only takes argmaxes never reads them.
        ``bitmask`` [B, ceil(V / 32)] int32, on any device: the tokens each row may sample.
        ``argmax`` [B]: the logits' argmax over the vocabulary where it is already computed (a
        decode CUDA graph's); an all-argmax-only batch then takes it as its tokens.
        ``ahead`` [B]: how many of the request's last tokens lie after the token row i draws
        (speculation's later drafts, engine_core/speculative.py), which its penalties must not
        count; default none.
        """
        logits = logits[:, : self.vocab_size]  # [B, V]
        if all(r.argmax_only for r in requests):
            # The common serving batch: skip building the per-row lists of every stage below,
            # which would all leave the logits as they are. The argmax reads the logits in their
            # own dtype: widening bf16 to float32 is exact, so it picks the same token.
            token_ids = logits.argmax(dim=-1) if argmax is None else argmax
            return SamplerOutput(token_ids, None, None, None)
        logits = logits.float()
        if output_positions is None:
            output_positions = [r.num_output_tokens for r in requests]
        elif callable(output_positions):
            output_positions = output_positions()
        if any(r.uses_penalties for r in requests):
            logits = apply_penalties(logits, requests, ahead)
        if any(r.params.logit_bias for r in requests):
            logits = apply_logit_bias(logits, requests)
        if bitmask is not None:
            logits = apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True))
        logits = apply_min_tokens(logits, requests, self.eos_token_ids, output_positions)
        token_ids = self._sample(logits, requests, output_positions)
        return _gather_logprobs(logits, token_ids, requests)

    def _sample(
        self, logits: torch.Tensor, requests: Sequence[Request], positions: Sequence[int]
    ) -> torch.Tensor:
        params = [r.params for r in requests]
        greedy = [p.greedy for p in params]
        if all(greedy):
            return logits.argmax(dim=-1)
        device = logits.device
        scaled = apply_top_k_top_p_min_p(_scale_by_temperature(logits, params), params)
        # Exponential race (Gumbel-max): argmax(logits - log E), E ~ Exp(1) per token.
        noise = self._exponential_noise(requests, positions, logits.shape, device)  # [B, V]
        sampled = (scaled - noise.log_()).argmax(dim=-1)
        if not any(greedy):
            return sampled
        is_greedy = _to_device(greedy, device, torch.bool)
        return torch.where(is_greedy, logits.argmax(dim=-1), sampled)

    def _exponential_noise(
        self,
        requests: Sequence[Request],
        positions: Sequence[int],
        shape: torch.Size,
        device: torch.device,
    ) -> torch.Tensor:
        """Exp(1) draws [B, V], strictly positive and finite so that log E never yields inf."""
        seeded_rows = [
            i for i, r in enumerate(requests) if r.params.seed is not None and not r.params.greedy
        ]
        noise = torch.empty(shape, device=device)
        if len(seeded_rows) < len(requests):
            noise.exponential_(generator=self._generator(device))
            # exponential_ may round to exactly 0 on some builds: keep log E finite.
            noise.clamp_(min=torch.finfo(torch.float32).tiny)
        if seeded_rows:
            keys = [seed_key(requests[i].params.seed, positions[i]) for i in seeded_rows]
            uniform = seeded_uniform(_to_device(keys, device, torch.int64), shape[1])  # [S, V]
            rows = _to_device(seeded_rows, device, torch.int64)
            noise.index_copy_(0, rows, uniform.log_().neg_())  # U in (0, 1): E in (0, 17)
        return noise

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator


def apply_penalties(
    logits: torch.Tensor, requests: Sequence[Request], ahead: Sequence[int] | None = None
) -> torch.Tensor:
    """Return ``logits`` [B, V] with each row's penalties applied (vLLM / OpenAI definitions).

    Repetition r (HF/CTRL) over prompt + output tokens: a seen token's logit becomes logit / r if
    positive, else logit * r. Then, over output tokens only with c = the token's count:
    logit -= frequency_penalty * c + presence_penalty * (c > 0). ``ahead[i]``: row i counts
    all of its request's tokens but that many last ones.
    """
    params = [r.params for r in requests]
    cuts = [None] * len(requests) if ahead is None else [-n if n else None for n in ahead]
    if any(p.repetition_penalty != 1.0 for p in params):
        # Only penalised rows pay for listing their tokens; the others get an empty list.
        lists = [
            r.token_ids[:cut] if r.params.repetition_penalty != 1.0 else []
            for r, cut in zip(requests, cuts, strict=True)
        ]
        seen = _count_tokens(lists, logits) > 0  # [B, V]
        r = _to_device([p.repetition_penalty for p in params], logits.device)[:, None]  # [B, 1]
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
        # A penalty near 0 (5e-324 is 0 in float32) would push logits to +-inf, and two +inf
        # make the logprobs NaN: keep them finite (the order of the tokens is what counts).
        big = torch.finfo(logits.dtype).max
        logits = logits.clamp(-big, big)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        lists = [
            r.output_token_ids[:cut] if _has_output_penalty(r.params) else []
            for r, cut in zip(requests, cuts, strict=True)
        ]
        counts = _count_tokens(lists, logits)  # [B, V]
        frequency = _to_device([p.frequency_penalty for p in params], logits.device)[:, None]
        presence = _to_device([p.presence_penalty for p in params], logits.device)[:, None]
        logits = logits - frequency * counts - presence * (counts > 0).float()
    return logits


def apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Return ``logits`` [B, V] with each request's logit_bias added (OpenAI's definition: the
    bias is added to the token's logit; -100 or 100 all but bans or forces it)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    vocab = logits.shape[1]
    for row, request in enumerate(requests):
        for token, bias in request.params.logit_bias:
            if token < vocab:  # the engine refuses ids outside the vocabulary at admission
                rows.append(row)
                cols.append(token)
                values.append(bias)
    device = logits.device
    index = (_to_device(rows, device, torch.int64), _to_device(cols, device, torch.int64))
    return logits.index_put(index, _to_device(values, device), accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor,
    requests: Sequence[Request],
    eos_token_ids: Sequence[int],
    output_positions: Sequence[int] | None = None,
) -> torch.Tensor:
    """Return ``logits`` [B, V] with stop tokens at -inf for rows still short of min_tokens.

    Stop tokens are the request's stop_token_ids plus the EOS ids unless ignore_eos (an
    ignore_eos request does not stop on EOS, so EOS needs no blocking). ``output_positions``:
    which output each row draws (default: each request's next one).
    """
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, request in enumerate(requests):
        params = request.params
        position = request.num_output_tokens if output_positions is None else output_positions[i]
        if position >= params.min_tokens:
            continue
        blocked = (
            params.stop_token_ids if params.ignore_eos else (*eos_token_ids, *params.stop_token_ids)
        )
        for token in blocked:
            if 0 <= token < vocab:
                rows.append(i)
                cols.append(token)
    if not rows:
        return logits
    index = (
        _to_device(rows, logits.device, torch.int64),
        _to_device(cols, logits.device, torch.int64),
    )
    return logits.index_put(index, logits.new_full((), float("-inf")))


def _scale_by_temperature(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Divide each sampled row by its temperature; greedy rows may be scaled by any value."""
    temperatures = {p.temperature for p in params if not p.greedy}
    if len(temperatures) == 1:  # the common case: one scalar, no per-row tensor to copy over
        temperature = temperatures.pop()
        return logits if temperature == 1.0 else logits / temperature
    per_row = [1.0 if p.greedy else p.temperature for p in params]
    return logits / _to_device(per_row, logits.device)[:, None]


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Return ``logits`` [B, V] (already temperature-scaled) with filtered-out tokens at -inf.

    top-k keeps the k largest (exactly k: ties are broken by the sort); top-p then keeps the
    smallest prefix of the renormalised top-k distribution whose mass reaches p (at least one
    token); min-p then drops tokens whose probability is below min_p times the largest.
    Greedy rows are left unfiltered: their argmax is taken before this anyway.
    """
    vocab = logits.shape[1]
    device = logits.device
    top_k = [vocab if p.greedy or p.top_k <= 0 else min(p.top_k, vocab) for p in params]
    # p >= 1 must mean "off" even where the float cumulative sum reaches 1.0 before the tail.
    top_p = [2.0 if p.greedy or p.top_p >= 1.0 else p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        logits = _filter_sorted(
            logits, _to_device(top_k, device, torch.int64), _to_device(top_p, device)
        )
    elif any(k < vocab for k in top_k):
        logits = _filter_top_k(logits, top_k)
    min_p = [0.0 if p.greedy else min(p.min_p, 1.0) for p in params]
    if any(m > 0.0 for m in min_p):
        # p_i < m * p_max  <=>  logit_i < logit_max + log(m); log(0) = -inf keeps every token.
        floor = logits.amax(dim=-1, keepdim=True) + _to_device(min_p, device).log()[:, None]
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


def _filter_top_k(logits: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Top-k alone, through torch.topk of the largest k: a full sort costs far more."""
    vocab = logits.shape[1]
    k_max = max(k for k in top_k if k < vocab)
    order = logits.topk(k_max, dim=-1).indices  # [B, K] best first, ties broken by topk
    k = _to_device(top_k, logits.device, torch.int64)[:, None]  # [B, 1]; V means off
    rank = torch.arange(k_max, device=logits.device)  # [K]
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, rank[None, :] < k)
    return logits.masked_fill(~(keep | (k >= vocab)), float("-inf"))


def _filter_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p in sorted order; ``top_k`` [B] int64, ``top_p`` [B] float32."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V] each
    rank = torch.arange(logits.shape[1], device=logits.device)  # [V]
    drop = rank[None, :] >= top_k[:, None]  # [B, V]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [B, V] mass of the strictly better tokens
    # A token stays while the better ones have not yet reached p; rank 0 always stays.
    drop |= (mass_before >= top_p[:, None]) & (rank[None, :] > 0)
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def seed_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for the draw at output ``position`` of a request seeded with ``seed``."""
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return key & _MASK32, key >> 32


def seeded_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform(0, 1) draws [S, vocab] float32 from ``keys`` [S, 2] int64 (see ``seed_key``).

    Two rounds of a 32-bit integer mixer over (token id ^ key0) then (^ key1): a counter-based
    generator, so each row depends only on its own keys.
    """
    token = torch.arange(vocab, device=keys.device, dtype=torch.int64)  # [V]
    bits = _mix32(token[None, :] ^ keys[:, :1])  # [S, V] in [0, 2**32)
    bits = _mix32(bits ^ keys[:, 1:])
    # The top 23 bits plus the half fill a float32 mantissa exactly, so U lies strictly inside
    # (0, 1): with 24 bits, 2**24 - 0.5 would round up to 2**24 and give U = 1, G = +inf.
    return ((bits >> 9).float() + 0.5) * (2.0**-23)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The "lowbias32" integer hash (C. Wellons) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for x in [0, 2**32), without overflowing int64."""
    if constant < 2**31:
        return (x * constant) & _MASK32  # the product stays below 2**63
    # x * (c' + 2**31): the second term is (x & 1) * 2**31 mod 2**32, and adding 2**31 modulo
    # 2**32 only flips bit 31.
    return ((x * (constant - 2**31)) & _MASK32) ^ ((x & 1) << 31)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[Request]
) -> SamplerOutput:
    asked = [r.params.logprobs for r in requests if r.params.logprobs is not None]
    if not asked:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = logits.log_softmax(dim=-1)  # [B, V]
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [B]
    top_n = min(max(0, *asked), logits.shape[1])
    top_logprobs, top_token_ids = logprobs.topk(top_n, dim=-1)  # [B, N] each, sorted
    return SamplerOutput(token_ids, sampled, top_token_ids, top_logprobs)


def _has_output_penalty(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _count_tokens(token_lists: Sequence[list[int]], logits: torch.Tensor) -> torch.Tensor:
    """Counts [B, V] float32 (shaped like ``logits``) of each token id in each row's list."""
    num_rows, vocab = logits.shape
    # array.fromlist converts Python ints ~10x faster than torch.tensor(list); numpy builds the
    # flat index row * (V + 1) + token on the host so that one copy crosses to the device.
    flat = array.array("q")
    for row_tokens in token_lists:
        flat.fromlist(row_tokens)
    tokens = np.frombuffer(flat, dtype=np.int64) if flat else np.empty(0, dtype=np.int64)
    # Ids outside the vocabulary land in a spare column that is dropped.
    tokens = np.where((tokens >= 0) & (tokens < vocab), tokens, vocab)
    row_starts = np.arange(num_rows, dtype=np.int64) * (vocab + 1)
    index = np.repeat(row_starts, [len(t) for t in token_lists]) + tokens
    index_t = _to_device(torch.from_numpy(index), logits.device)
    counts = torch.zeros(num_rows * (vocab + 1), device=logits.device)
    counts.index_add_(0, index_t, torch.ones(index_t.shape, device=logits.device))
    return counts.view(num_rows, vocab + 1)[:, :vocab]


def _to_device(
    values: Sequence[float] | Sequence[int] | Sequence[tuple[int, int]] | torch.Tensor,
    device: torch.device,
    dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """A small per-step tensor on ``device``, copied without blocking the host on CUDA."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
