"""The batched sampler against hand computations and invariants (CPU; CUDA when present)."""

from __future__ import annotations

import math

import pytest
import torch

from engine_core.request import Request
from engine_core.sampler import Sampler, apply_penalties, seed_key, seeded_uniform
from protocol.messages import SamplingParams

VOCAB = 32
EOS = 0
NEG_INF = float("-inf")


def make_request(
    outputs: tuple[int, ...] = (), prompt: tuple[int, ...] = (5, 6, 7), **params: object
) -> Request:
    """A request whose prompt is ``prompt`` and which has already produced ``outputs``."""
    request = Request(
        request_id="r", prompt_token_ids=list(prompt), params=SamplingParams(**params)
    )
    request.token_ids.extend(outputs)
    return request


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(eos_token_ids=[EOS], vocab_size=VOCAB, seed=seed)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    """Logits [V] whose softmax is ``probs`` (zero probabilities become -inf)."""
    return torch.tensor([math.log(p) if p > 0 else NEG_INF for p in probs])


def draw_many(
    logits_row: torch.Tensor, n: int = 2000, sampler: Sampler | None = None, **params: object
) -> torch.Tensor:
    """Sample ``n`` unseeded rows of the same logits in one batch; returns the tokens [n]."""
    sampler = sampler or Sampler(eos_token_ids=[], vocab_size=logits_row.shape[0], seed=1)
    requests = [make_request(**params) for _ in range(n)]
    return sampler(logits_row.expand(n, -1).clone(), requests).token_ids


# --- greedy and seeds ---------------------------------------------------------------------------


def test_greedy_equals_argmax_in_mixed_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, VOCAB)
    requests = [make_request(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(8)]
    out = make_sampler()(logits, requests)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (8,)
    expected = logits.argmax(dim=-1)
    assert torch.equal(out.token_ids[0::2], expected[0::2])
    assert out.logprobs is None and out.top_token_ids is None


def test_all_greedy_equals_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, VOCAB)
    out = make_sampler()(logits, [make_request(temperature=0.0) for _ in range(5)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bf16_logits_pick_the_float32_argmax_with_ties_and_padding(device: str) -> None:
    """The runner hands the sampler the LM head's bf16 logits; an all-greedy batch takes the
    argmax without widening them. It must pick what the float32 argmax picks (the first of
    tied maxima, never a padded column); a mixed batch widens and samples as before."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.manual_seed(2)
    logits = torch.randn(64, VOCAB + 8).to(torch.bfloat16)
    logits[:, VOCAB:] = 100.0  # padding columns beyond the real vocabulary
    logits[::3, 5] = logits[::3, 17] = 50.0  # tied maxima: the first index wins
    logits = logits.to(device)
    expected = logits[:, :VOCAB].float().argmax(dim=-1)
    assert bool((expected[::3] == 5).all())
    greedy = make_sampler()(logits, [make_request(temperature=0.0) for _ in range(64)])
    assert torch.equal(greedy.token_ids, expected)
    mixed = [make_request(temperature=0.0 if i % 2 else 1.0) for i in range(64)]
    out = make_sampler()(logits, mixed)
    assert torch.equal(out.token_ids[1::2], expected[1::2])
    assert bool((out.token_ids < VOCAB).all())


def test_padded_vocab_columns_never_sampled() -> None:
    logits = torch.zeros(4, VOCAB + 8)
    logits[:, VOCAB:] = 100.0  # padding columns of the embedding, beyond the real vocabulary
    requests = [make_request(temperature=t) for t in (0.0, 1.0, 1.0, 0.0)]
    out = make_sampler()(logits, requests)
    assert bool((out.token_ids < VOCAB).all())


def _seeded_sequence(
    sampler: Sampler, seed: int, steps: int, batch_mates: int, first: bool
) -> list[int]:
    """Decode ``steps`` tokens of one seeded request among other rows; returns its tokens."""
    logits_row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(batch_mates)  # the other rows' logits differ between calls
    target = make_request(seed=seed, temperature=0.9, top_k=20)
    tokens = []
    for _ in range(steps):
        others = [make_request(temperature=1.0, seed=None) for _ in range(batch_mates)]
        others += [make_request(temperature=0.7, seed=seed + 1)]
        requests = [target, *others] if first else [*others, target]
        logits = torch.randn(len(requests), VOCAB)
        row = 0 if first else len(requests) - 1
        logits[row] = logits_row
        token = int(sampler(logits, requests).token_ids[row])
        target.token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_request_reproduces_across_batches_orders_and_samplers() -> None:
    runs = [
        _seeded_sequence(make_sampler(seed=0), seed=1234, steps=12, batch_mates=0, first=True),
        _seeded_sequence(make_sampler(seed=7), seed=1234, steps=12, batch_mates=5, first=False),
        _seeded_sequence(make_sampler(seed=9), seed=1234, steps=12, batch_mates=2, first=True),
    ]
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 1  # the draws did vary between positions


def test_seeded_request_reproduces_after_recompute() -> None:
    """A preempted request recomputed from prompt + outputs draws the same next token."""
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB)
    before = make_request(outputs=(4, 9, 2), seed=42)
    after = make_request(outputs=(4, 9, 2), seed=42)  # a fresh object, as after preemption
    after.num_preemptions = 1
    for sampler_seed in range(5):
        a = make_sampler(sampler_seed)(logits, [before]).token_ids
        b = make_sampler(sampler_seed + 100)(logits, [after]).token_ids
        assert torch.equal(a, b)


def test_different_seeds_differ_on_flat_distribution() -> None:
    logits = torch.zeros(1, VOCAB)
    sampler = make_sampler()

    def draws(seed: int) -> list[int]:
        return [
            int(sampler(logits, [make_request(outputs=(1,) * pos, seed=seed)]).token_ids[0])
            for pos in range(8)
        ]

    assert draws(1) != draws(2)
    assert draws(1) == draws(1)


def test_seeded_draws_follow_the_distribution() -> None:
    """Over 4000 seeds, token frequencies match the probabilities (within 5 sigma)."""
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    logits = logits_from_probs(probs).expand(n, -1).clone()
    requests = [make_request(seed=s) for s in range(n)]
    tokens = Sampler(eos_token_ids=[], vocab_size=4)(logits, requests).token_ids
    counts = torch.bincount(tokens, minlength=4).tolist()
    for count, p in zip(counts, probs, strict=True):
        assert abs(count - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_seeded_uniform_matches_python_hash() -> None:
    """The tensor hash equals lowbias32 computed with Python integers (no int64 overflow)."""

    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    keys = [seed_key(2**40 + 3, 17), seed_key(-5, 0), (0xFFFFFFFF, 0xFFFFFFFF)]
    uniform = seeded_uniform(torch.tensor(keys, dtype=torch.int64), 50)
    assert bool((uniform > 0).all() and (uniform < 1).all())
    for row, (k0, k1) in enumerate(keys):
        for token in (0, 1, 31, 49):
            bits = lowbias32(lowbias32(token ^ k0) ^ k1)
            assert uniform[row, token].item() == ((bits >> 9) + 0.5) / 2**23


# --- filtering ----------------------------------------------------------------------------------


def test_top_k_never_leaves_the_k_largest() -> None:
    torch.manual_seed(4)
    logits_row = torch.randn(VOCAB) * 0.3  # flat enough that the tail would show up
    allowed = set(sorted(range(VOCAB), key=lambda t: -logits_row[t].item())[:5])
    tokens = set(draw_many(logits_row, top_k=5).tolist())
    assert tokens == allowed  # inside the set, and every member was drawn


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = [0.05, 0.4, 0.02, 0.3, 0.2, 0.03]
    # Sorted: 0.4, 0.3 (0.7 < 0.75), 0.2 (0.9 >= 0.75) -> {1, 3, 4}.
    tokens = set(draw_many(logits_from_probs(probs), top_p=0.75).tolist())
    assert tokens == {1, 3, 4}


def test_top_p_always_keeps_one_token() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    tokens = draw_many(logits_from_probs(probs), n=500, top_p=0.01)
    assert bool((tokens == 3).all())


def test_top_k_then_top_p_renormalises() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    # top-k 3 leaves 0.4/0.9, 0.3/0.9, 0.2/0.9: cumulative 0.44, 0.78 >= 0.75 -> {3, 2}.
    # Without renormalising, 0.4 + 0.3 = 0.7 < 0.75 would let token 1 in as well.
    tokens = set(draw_many(logits_from_probs(probs), top_k=3, top_p=0.75).tolist())
    assert tokens == {2, 3}


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = [0.3, 0.05, 0.5, 0.1, 0.05]
    # Threshold 0.25 * 0.5 = 0.125 -> {0, 2}.
    tokens = set(draw_many(logits_from_probs(probs), min_p=0.25).tolist())
    assert tokens == {0, 2}


def test_temperature_scales_before_filtering() -> None:
    """min-p on the temperature-scaled distribution: at T=0.5, 0.3 vs 0.5 becomes 0.36 : 1."""
    probs = [0.3, 0.2, 0.5]
    # Scaled probabilities are proportional to p**2: 0.09, 0.04, 0.25 -> ratios 0.36, 0.16, 1.
    tokens = set(draw_many(logits_from_probs(probs), temperature=0.5, min_p=0.3).tolist())
    assert tokens == {0, 2}


def test_per_row_temperature_and_top_k_in_one_batch() -> None:
    """Rows with different temperatures and top-k (some off) are filtered row by row."""
    probs = [0.3, 0.2, 0.5, 0.0]
    n = 1000
    logits = logits_from_probs(probs).expand(4 * n, -1).clone()
    requests = (
        [make_request(temperature=0.5, min_p=0.3) for _ in range(n)]  # p**2 ratios: {0, 2}
        + [make_request(temperature=1.0, min_p=0.3) for _ in range(n)]  # ratios 0.6, 0.4, 1
        + [make_request(temperature=2.0, top_k=1) for _ in range(n)]  # argmax only
        + [make_request(temperature=0.7, top_k=0) for _ in range(n)]  # off: every p > 0
    )
    tokens = Sampler(eos_token_ids=[], vocab_size=4, seed=2)(logits, requests).token_ids
    assert [set(tokens[i * n : (i + 1) * n].tolist()) for i in range(4)] == [
        {0, 2},
        {0, 1, 2},
        {2},
        {0, 1, 2},
    ]


def test_top_k_keeps_exactly_k_among_ties() -> None:
    tokens = draw_many(torch.zeros(VOCAB), top_k=3)
    assert len(set(tokens.tolist())) == 3


def test_unseeded_sampling_is_not_degenerate() -> None:
    tokens = draw_many(torch.zeros(VOCAB), n=2000)
    assert set(tokens.tolist()) == set(range(VOCAB))


# --- penalties and min_tokens -------------------------------------------------------------------


def test_apply_penalties_matches_hand_computation() -> None:
    logits = torch.tensor(
        [
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],
        ]
    )
    requests = [
        # prompt {1, 2}, outputs 2, 3, 3: repetition hits 1, 2, 3; output counts: 2 -> 1, 3 -> 2.
        make_request(
            prompt=(1, 2),
            outputs=(2, 3, 3),
            repetition_penalty=2.0,
            presence_penalty=0.5,
            frequency_penalty=0.25,
        ),
        make_request(prompt=(1, 2), outputs=(2, 3, 3)),  # no penalties: untouched
        make_request(prompt=(0,), outputs=(5, 5, 5), frequency_penalty=-1.0),
    ]
    expected = torch.tensor(
        [
            [1.0, -1.0 * 2.0, 2.0 / 2.0 - 0.5 - 0.25, -2.0 * 2.0 - 0.5 - 0.5, 0.5, 3.0],
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0],
            [1.0, -1.0, 2.0, -2.0, 0.5, 3.0 + 3.0],
        ]
    )
    assert torch.allclose(apply_penalties(logits, requests), expected)
    assert logits[0, 2].item() == 2.0  # the input was not modified


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.9] + [-5.0] * (VOCAB - 3)])
    plain = make_request(outputs=(1,), temperature=0.0)
    penalised = make_request(outputs=(1,), temperature=0.0, presence_penalty=0.5)
    out = make_sampler()(logits.expand(2, -1).clone(), [plain, penalised])
    assert out.token_ids.tolist() == [1, 2]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.full((1, VOCAB), -3.0)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0  # a stop id
    logits[0, 4] = 1.0
    sampler = make_sampler()
    for num_outputs, expected in [(0, 4), (2, 4), (3, EOS)]:
        request = make_request(
            outputs=(4,) * num_outputs, temperature=0.0, min_tokens=3, stop_token_ids=(7,)
        )
        assert sampler(logits, [request]).token_ids.item() == expected
    # ignore_eos: EOS is not blocked (it does not stop the request), stop ids still are.
    request = make_request(temperature=0.0, min_tokens=3, stop_token_ids=(7,), ignore_eos=True)
    assert sampler(logits, [request]).token_ids.item() == EOS
    logits[0, EOS] = -3.0
    assert sampler(logits, [request]).token_ids.item() == 4


def test_min_tokens_holds_under_sampling() -> None:
    logits_row = torch.zeros(VOCAB)
    logits_row[EOS] = 5.0
    tokens = draw_many(logits_row, sampler=make_sampler(), min_tokens=1, temperature=1.5)
    assert EOS not in set(tokens.tolist())


# --- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_pre_temperature_and_top_n_sorted() -> None:
    torch.manual_seed(5)
    logits = torch.randn(4, VOCAB)
    requests = [
        make_request(temperature=0.5, logprobs=3, seed=1),
        make_request(temperature=0.0, logprobs=0),
        make_request(temperature=2.0, top_k=4, logprobs=5),
        make_request(temperature=1.0),  # asked for none: still gets values the caller ignores
    ]
    out = make_sampler()(logits, requests)
    assert out.logprobs is not None and out.top_token_ids is not None
    assert out.top_logprobs is not None
    assert out.top_token_ids.shape == (4, 5) and out.top_logprobs.shape == (4, 5)
    for i in range(4):
        row = logits[i].tolist()
        log_z = math.log(sum(math.exp(x) for x in row))
        token = int(out.token_ids[i])
        assert out.logprobs[i].item() == pytest.approx(row[token] - log_z, abs=1e-5)
        expected_top = sorted(range(VOCAB), key=lambda t: -row[t])[:5]
        assert out.top_token_ids[i].tolist() == expected_top
        for j, t in enumerate(expected_top):
            assert out.top_logprobs[i, j].item() == pytest.approx(row[t] - log_z, abs=1e-5)
        assert bool((out.top_logprobs[i, :-1] >= out.top_logprobs[i, 1:]).all())


def test_logprobs_zero_gives_empty_top_n() -> None:
    logits = torch.randn(3, VOCAB)
    out = make_sampler()(logits, [make_request(temperature=0.0, logprobs=0) for _ in range(3)])
    assert out.logprobs is not None and out.top_token_ids is not None
    assert out.top_token_ids.shape == (3, 0)
    assert torch.allclose(out.logprobs, logits.log_softmax(-1).max(dim=-1).values)


def test_logprobs_see_penalties_and_min_tokens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    request = make_request(
        outputs=(1,), temperature=0.0, logprobs=1, min_tokens=2, frequency_penalty=1.0
    )
    out = Sampler(eos_token_ids=[0], vocab_size=4)(logits, [request])
    # EOS (0) is blocked, token 1 loses 1.0: the model's distribution is over [-inf, 0, 0, 0].
    assert out.token_ids.item() == 1
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.logprobs.item() == pytest.approx(math.log(1 / 3), abs=1e-6)
    assert out.top_logprobs[0, 0].item() == pytest.approx(math.log(1 / 3), abs=1e-6)


# --- device -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_for_seeded_and_greedy_rows() -> None:
    torch.manual_seed(6)
    logits = torch.randn(6, VOCAB)
    requests = [
        make_request(temperature=0.0, logprobs=2),
        make_request(seed=11, top_p=0.9, presence_penalty=0.3, outputs=(3, 3)),
        make_request(seed=12, top_k=5, min_p=0.1, repetition_penalty=1.3),
        make_request(temperature=0.8, min_tokens=4),
        make_request(seed=13, min_tokens=2, stop_token_ids=(9,)),
        make_request(temperature=0.0, frequency_penalty=0.5, outputs=(1, 2)),
    ]
    cpu = make_sampler()(logits, requests)
    cuda = make_sampler()(logits.cuda(), requests)
    assert cuda.token_ids.device.type == "cuda"
    seeded_or_greedy = [0, 1, 2, 4, 5]
    assert (
        cuda.token_ids.cpu()[seeded_or_greedy].tolist() == cpu.token_ids[seeded_or_greedy].tolist()
    )
    assert cuda.logprobs is not None and cpu.logprobs is not None
    rows = torch.tensor(seeded_or_greedy)
    assert torch.allclose(cuda.logprobs.cpu()[rows], cpu.logprobs[rows], atol=1e-5)


# --- extreme values that the API admits ---------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 5e-324, "temperature": 0.0},  # 0 in float32: logit / 0
        {"repetition_penalty": 1e300, "temperature": 0.7},  # inf in float32
        {"temperature": 1e-45},  # the scaled logits would overflow
    ],
)
def test_extreme_parameters_give_finite_logprobs_and_a_real_token(params: dict) -> None:
    """The schemathesis fuzz sent repetition_penalty 5e-324: the logprobs came out NaN, the
    frontend had to drop the step's frame, and the request never finished."""
    torch.manual_seed(3)
    logits = torch.randn(4, VOCAB) * 5
    requests = [make_request(outputs=(9, 10, 11), logprobs=3, **params) for _ in range(4)]
    out = make_sampler()(logits, requests)
    assert out.logprobs is not None and out.top_logprobs is not None
    assert not torch.isnan(out.logprobs).any() and not torch.isposinf(out.logprobs).any()
    assert not torch.isnan(out.top_logprobs).any() and not torch.isposinf(out.top_logprobs).any()
    assert ((out.token_ids >= 0) & (out.token_ids < VOCAB)).all()


def test_a_temperature_below_the_greedy_threshold_is_greedy() -> None:
    torch.manual_seed(4)
    logits = torch.randn(6, VOCAB)
    out = make_sampler()(logits, [make_request(temperature=1e-6) for _ in range(6)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_an_argmax_given_is_the_tokens_of_an_argmax_only_batch_and_unused_otherwise() -> None:
    """The decode graphs' argmax (engine_core/cuda_graph.py) is taken as it is for a batch of
    argmax-only rows; a batch with any other row samples from the logits as without it."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 2.0]])
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    given = torch.tensor([1, 0])
    requests = [Request(f"g{i}", [1], greedy) for i in range(2)]
    out = Sampler(eos_token_ids=[], vocab_size=4)(logits, requests, argmax=given)
    assert out.token_ids is given
    # min_tokens with EOS 1: the first row may not end yet, so its token is 3, not the argmax 1.
    holding = SamplingParams(temperature=0.0, min_tokens=2)
    requests = [Request("m", [1], holding), Request("g", [1], greedy)]
    stale = torch.tensor([2, 2])  # an argmax the sampler must not take for this batch
    out = Sampler(eos_token_ids=[1], vocab_size=4)(logits, requests, argmax=stale)
    assert out.token_ids.tolist() == [3, 0]
