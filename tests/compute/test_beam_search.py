"""compute.sampling.beam_search: beam-search scoring, against Hugging Face's generate (CPU, no
mocks)."""

from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from compute.model.models import EOS
from compute.sampling.beam_search import BeamSearch, BeamStep, EarlyStopping, top_continuations
from contracts.model_config import tiny_config
from tests.compute.driver import generate_beams


def test_top_continuations_hand_example() -> None:
    sums = torch.tensor([0.0, -1.0])
    logprobs = torch.tensor([[-0.1, -2.0, -3.0], [-0.2, -0.5, -4.0]])
    scores, parents, tokens = top_continuations(sums, logprobs, 3)
    assert list(zip(parents.tolist(), tokens.tolist(), strict=True)) == [(0, 0), (1, 0), (1, 1)]
    torch.testing.assert_close(scores, torch.tensor([-0.1, -1.2, -1.5]))


@settings(max_examples=60, deadline=None)
@given(
    beams=st.integers(1, 5),
    vocab=st.integers(1, 9),
    k=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    ties=st.booleans(),
)
def test_top_continuations_are_the_true_top_k(
    beams: int, vocab: int, k: int, seed: int, ties: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.randn(beams, vocab, generator=gen).log_softmax(-1)
    sums = -torch.rand(beams, generator=gen) * 5
    if ties:
        logprobs, sums = logprobs.round(decimals=0), sums.round(decimals=0)
    scores, parents, tokens = top_continuations(sums, logprobs, k)
    every = sorted(float(sums[b] + logprobs[b, t]) for b in range(beams) for t in range(vocab))
    assert scores.tolist() == every[::-1][: min(k, beams * vocab)]
    pairs = list(zip(parents.tolist(), tokens.tolist(), strict=True))
    assert len(set(pairs)) == len(pairs)
    for (b, t), s in zip(pairs, scores.tolist(), strict=True):
        assert float(sums[b] + logprobs[b, t]) == s


def log_row(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# tokens 0, 1, 2 and EOS 3; next-token distributions by the beam's tokens so far
TABLE = {
    (): log_row(0.5, 0.3, 0.15, 0.05),
    (0,): log_row(0.1, 0.1, 0.2, 0.6),
    (1,): log_row(0.7, 0.1, 0.1, 0.1),
    (1, 0): log_row(0.05, 0.05, 0.1, 0.8),
    (0, 2): log_row(0.4, 0.3, 0.2, 0.1),
}


def drive(search: BeamSearch, table: dict[tuple[int, ...], list[float]]) -> list[BeamStep]:
    steps: list[BeamStep] = []
    while not search.done:
        beams = [search.live_tokens(b) for b in range(search.num_live)]
        steps.append(search.step(torch.tensor([table[b] for b in beams])))
    return steps


@pytest.mark.parametrize(
    ("length_penalty", "best"), [(1.0, [(1, 0, 3), (0, 3)]), (0.0, [(0, 3), (1, 0, 3)])]
)
def test_beam_search_hand_example(length_penalty: float, best: list[tuple[int, ...]]) -> None:
    search = BeamSearch(2, max_tokens=3, stop_token_ids=[3], length_penalty=length_penalty)
    steps = drive(search, TABLE)
    assert [(s.parents, s.token_ids) for s in steps] == [
        ([0, 0], [0, 1]),
        ([1, 0], [0, 2]),  # beam (1,) continues first: the new beams are in score order
        ([], []),  # max_tokens: the two best continuations finish
    ]
    assert [h.token_ids for h in steps[1].finished] == [(0, 3)]
    assert [h.token_ids for h in search.best(2)] == best
    sums = {(0, 3): math.log(0.5 * 0.6), (1, 0, 3): math.log(0.3 * 0.7 * 0.8)}
    for h in search.best(2):
        assert h.sum_logprob == pytest.approx(sums[h.token_ids], rel=1e-5)
        assert h.score == pytest.approx(h.sum_logprob / len(h.token_ids) ** length_penalty)


@pytest.mark.parametrize(
    ("early_stopping", "length_penalty", "done"),
    [(True, 1.0, True), (False, 1.0, True), ("never", 1.0, False), ("never", 0.0, True)],
)
def test_early_stopping_rules(
    early_stopping: EarlyStopping, length_penalty: float, done: bool
) -> None:
    """Two stop tokens take the two best places at step 1; the live beams sum to log 0.2 and
    log 0.1, the worst finished score is log 0.3. Only the exact "never" rule with a positive
    length penalty sees that log 0.2 / 10 (max_tokens) could still beat it."""
    search = BeamSearch(2, 10, [2, 3], length_penalty, early_stopping)
    step = search.step(torch.tensor([log_row(0.2, 0.1, 0.4, 0.3)]))
    assert [h.token_ids for h in step.finished] == [(2,), (3,)]
    assert (step.parents, step.token_ids, step.done) == ([0, 0], [0, 1], done)


@functools.cache
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).eval()


def hf_beam(
    prompt: torch.Tensor, eos: int, lp: float, early: EarlyStopping
) -> tuple[list[list[int]], list[float]]:
    return generate_beams(tiny_llama(), prompt[0].tolist(), 4, 12, eos, lp, early)


def our_beam(prompt: torch.Tensor, eos: int, lp: float, early: EarlyStopping) -> BeamSearch:
    search = BeamSearch(4, 12, [eos], lp, early)
    while not search.done:
        live = [search.live_tokens(b) for b in range(search.num_live)]
        seqs = torch.stack(
            [torch.cat([prompt[0], torch.tensor(t, dtype=torch.int64)]) for t in live]
        )
        logits = tiny_llama()(seqs).logits[:, -1].float()  # [beams, vocab], full forward
        search.step(logits.log_softmax(-1))
    return search


@torch.no_grad()
def test_beam_search_equals_hugging_face_generate() -> None:
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    free_run, _ = hf_beam(prompt, EOS, 1.0, False)
    eos = Counter(t for s in free_run for t in s).most_common(1)[0][0]  # an "EOS" it emits
    results = {}
    cases: list[tuple[float, EarlyStopping]] = [
        (1.0, False),
        (1.0, "never"),
        (1.0, True),
        (0.0, "never"),
    ]
    for lp, early in cases:
        want, want_scores = hf_beam(prompt, eos, lp, early)
        ours = our_beam(prompt, eos, lp, early)
        assert [list(h.token_ids) for h in ours.finished] == want, (lp, early)
        got = [h.score for h in ours.finished]
        assert got == pytest.approx(want_scores, abs=1e-5)
        results[lp, early] = (ours.num_generated, want)
    # guards the comparison's power: hypotheses end at different lengths, some searches stop
    # early, and the three early-stopping rules do not all agree
    assert len({len(s) for s in results[1.0, False][1]}) > 1
    assert min(n for n, _ in results.values()) < 12
    assert len({str(results[1.0, e]) for e in (False, "never", True)}) == 3
