"""compute.sampling.sampling: sampling filters and seeds (CPU, no mocks)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from compute.sampling.sampling import RowState, filter_logits, sample
from contracts.records import SamplingParams

NEG = float("-inf")


def kept(logits: Sequence[float], top_k: int = 0, top_p: float = 1.0) -> set[int]:
    out = filter_logits(
        torch.tensor([logits]), torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float32)
    )
    return {i for i, v in enumerate(out[0].tolist()) if v > NEG}


def rows_of(*params: SamplingParams) -> list[RowState]:
    return [RowState(p) for p in params]


# ----------------------------------------------------------------------------- filters


def test_greedy_is_argmax_whatever_the_filters() -> None:
    torch.manual_seed(0)
    logits = torch.randn(12, 50)
    logits[3, 7] = logits[3, 20] = logits[3].max() + 1  # a tie: first index, as torch.argmax/HF
    params = [SamplingParams(temperature=0, top_k=i % 3, top_p=0.5, seed=i) for i in range(12)]
    out = sample(logits, rows_of(*params))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 7


@pytest.mark.parametrize(
    ("top_k", "want"),
    [
        *[(1, {1}), (2, {1, 2, 4}), (3, {1, 2, 4}), (4, {0, 1, 2, 4})],
        *[(0, set(range(6))), (6, set(range(6))), (1000, set(range(6)))],
    ],
)
def test_top_k_keeps_exactly_the_k_largest_and_boundary_ties(top_k: int, want: set[int]) -> None:
    assert kept([1.0, 5.0, 4.0, 0.5, 4.0, -2.0], top_k=top_k) == want


PROBS = [0.05, 0.5, 0.15, 0.3]  # ranks: 1, 3, 2, 0


@pytest.mark.parametrize(
    ("probs", "top_p", "want"),
    [
        (PROBS, 0.4, {1}),
        (PROBS, 0.6, {1, 3}),
        (PROBS, 0.9, {1, 3, 2}),
        (PROBS, 0.97, {0, 1, 2, 3}),
        (PROBS, 1.0, {0, 1, 2, 3}),
        (PROBS, 1e-6, {1}),  # always at least one token
        ([0.3, 0.3, 0.2, 0.2], 0.5, {0, 1}),  # tie inside the nucleus
        ([0.4, 0.2, 0.2, 0.2], 0.5, {0, 1, 2, 3}),  # tie at the boundary: all kept
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(
    probs: list[float], top_p: float, want: set[int]
) -> None:
    assert kept([math.log(p) for p in probs], top_p=top_p) == want


def test_top_p_one_keeps_tokens_of_negligible_probability() -> None:
    logits = [0.0] * 10 + [-80.0, -90.0]  # cumsum rounding must not drop the tail at top_p=1
    assert kept(logits, top_p=1.0) == set(range(12))
    assert kept(logits, top_k=11, top_p=1.0) == set(range(11))


def test_top_p_applies_to_the_top_k_renormalized_distribution() -> None:
    logits = [math.log(p) for p in PROBS]
    assert kept(logits, top_p=0.7) == {1, 3}
    assert kept(logits, top_k=2, top_p=0.6) == {1}  # 0.5 / 0.8 = 0.625 >= 0.6


@pytest.mark.parametrize("seed", range(5))
def test_filters_match_hugging_face_warpers_on_random_logits(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 300, generator=gen) * 3
    for temperature, top_k, top_p in [
        (0.7, 40, 0.9),
        (1.3, 0, 0.5),
        (1.0, 7, 1.0),
        (0.5, 300, 0.3),
    ]:
        ref = TemperatureLogitsWarper(temperature)(None, logits)
        ref = TopKLogitsWarper(top_k)(None, ref) if top_k else ref
        ref = TopPLogitsWarper(top_p)(None, ref) if top_p < 1 else ref
        ours = filter_logits(
            logits / temperature, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float32)
        )
        assert torch.equal(ours.isinf(), ref.isinf()), (temperature, top_k, top_p)


# ----------------------------------------------------------------------------- sampling


def test_temperature_to_zero_approaches_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 100)
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4  # the limit is sharp for these rows
    cold = sample(logits, rows_of(*(SamplingParams(temperature=1e-6, seed=i) for i in range(64))))
    greedy = sample(logits, rows_of(*(SamplingParams(temperature=0) for _ in range(64))))
    assert cold.token_ids.tolist() == greedy.token_ids.tolist()
    warm = sample(logits, rows_of(*(SamplingParams(temperature=1.0, seed=i) for i in range(64))))
    assert warm.token_ids.tolist() != greedy.token_ids.tolist()  # guards the test's power


def reference_distribution(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> list[float]:
    """softmax(logits / T) restricted to top-k, renormalized, restricted to top-p (pure Python)."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])[: top_k or len(logits)]
    weights = {i: math.exp(logits[i] / temperature) for i in order}
    total = sum(weights.values())
    keep, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        keep.append(i)
        mass += weights[i] / total
    norm = sum(weights[i] for i in keep)
    return [weights[i] / norm if i in keep else 0.0 for i in range(len(logits))]


LOGITS6 = [1.0, -1.0, 2.0, 0.2, 1.5, 0.6]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 4, 0.9), (0.7, 3, 0.8)])
@pytest.mark.parametrize("seeded", [True, False])
def test_empirical_distribution_matches_filtered_softmax(
    temperature: float, top_k: int, top_p: float, seeded: bool
) -> None:
    n = 20_000
    torch.manual_seed(1234)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=99)
    if not seeded:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    rows = [RowState(params, num_generated=t) for t in range(n)]  # seeded: n positions' streams
    out = sample(torch.tensor([LOGITS6]).expand(n, -1).contiguous(), rows)
    counts = Counter(out.token_ids.tolist())
    want = reference_distribution(LOGITS6, temperature, top_k, top_p)
    assert {t for t in counts} == {i for i, p in enumerate(want) if p > 0}
    tv = 0.5 * sum(abs(counts[i] / n - p) for i, p in enumerate(want))
    assert tv < 0.015, (tv, counts, want)
    # guards the test's power: a wrong order or a missing temperature is further than the bound
    for wrong in (reference_distribution(LOGITS6, 1.0, top_k, top_p), [*want[1:], want[0]]):
        assert 0.5 * sum(abs(a - b) for a, b in zip(want, wrong, strict=True)) > 0.04


def seeded_run(
    logit_steps: Sequence[torch.Tensor], row: int, others: list[SamplingParams]
) -> list[int]:
    """Samples request (seed 7) at batch row ``row`` among ``others`` for every step."""
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
    tokens: list[int] = []
    for t, logits in enumerate(logit_steps):  # logits: [vocab] of our request at step t
        batch = torch.randn(len(others) + 1, logits.shape[0])
        batch[row] = logits
        params = [*others[:row], mine, *others[row:]]
        rows = [RowState(p, num_generated=t) for p in params]
        tokens.append(int(sample(batch, rows).token_ids[row]))
    return tokens


def test_seeded_request_is_independent_of_batch_and_row() -> None:
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(259, generator=gen) for _ in range(30)]
    alone = seeded_run(steps, 0, [])
    others = [SamplingParams(), SamplingParams(seed=8), SamplingParams(temperature=0)]
    others += [SamplingParams(top_p=0.5, seed=7, temperature=2.0)]
    assert seeded_run(steps, 3, others) == alone
    assert seeded_run(steps, 1, others[::-1]) == alone
    assert len(set(alone)) > 10  # real sampling, not a degenerate argmax


def test_n_sequences_of_a_seeded_request_differ_yet_reproduce() -> None:
    logits = torch.zeros(4, 259)  # uniform: every difference comes from the streams

    def run(seed: int) -> list[list[int]]:
        params = SamplingParams(seed=seed, n=4)
        steps = [
            sample(logits, [RowState(params, i, t) for i in range(4)]).token_ids.tolist()
            for t in range(12)
        ]
        return [list(seq) for seq in zip(*steps, strict=True)]

    first = run(42)
    assert first == run(42)
    assert len({tuple(s) for s in first}) == 4
    assert run(43) != first
