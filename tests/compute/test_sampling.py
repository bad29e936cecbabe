"""compute.sampling: sampling filters and seeds, stop conditions, beam search (CPU, no mocks)."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from compute.models import EOS, byte_tokenizer
from compute.sampling import (
    BeamSearch,
    BeamStep,
    RowState,
    StopChecker,
    StopUpdate,
    filter_logits,
    sample,
    top_continuations,
)
from gateway.queue import SamplingParams
from pagedserve.model_config import tiny_config
from tests.compute.driver import generate_beams

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
    expected = logits.log_softmax(-1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)


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


# ----------------------------------------------------------------------------- stop conditions


def toy_decode(vocab: list[str]) -> Callable[[Sequence[int]], str]:
    return lambda ids: "".join(vocab[i] for i in ids)


def feed(checker: StopChecker, ids: Sequence[int]) -> list[StopUpdate]:
    """Appends until finished; checks the streamed deltas add up to the final text."""
    updates: list[StopUpdate] = []
    for token in ids:
        updates.append(checker.append(token))
        if updates[-1].finish_reason is not None:
            break
    assert "".join(u.text for u in updates) == checker.text
    return updates


@functools.cache
def byte_decode() -> Callable[[Sequence[int]], str]:
    return byte_tokenizer().decode


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abé€", max_size=16),
    stops=st.lists(st.text(alphabet="abé€", min_size=1, max_size=4), max_size=3),
)
def test_incremental_stops_equal_a_whole_text_reference(text: str, stops: list[str]) -> None:
    """Byte tokens (multi-byte characters split across tokens) against the non-incremental rule:
    the stop occurrence ending first (then starting first) in the whole text cuts it."""
    data = list(text.encode())
    params = SamplingParams(max_tokens=max(1, len(data)), stop=stops)  # the last token ends it
    checker = StopChecker(params, [EOS], byte_decode())
    updates = feed(checker, data)
    hits = [(i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    want = text[: min(hits)[1]] if hits else text
    assert checker.text == want
    assert checker.finish_reason == ("stop" if hits else "length" if data else None)
    assert all("\ufffd" not in u.text for u in updates)


def test_stop_string_spanning_token_boundaries_is_never_streamed() -> None:
    vocab = ["Hel", "lo ", "wor", "ld", "!"]
    checker = StopChecker(SamplingParams(stop=["o w"]), [], toy_decode(vocab))
    updates = feed(checker, [0, 1, 2, 3, 4])
    assert [u.text for u in updates] == ["Hel", "l", ""]  # "o " held back: a possible stop
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("Hell", "stop", "o w")


@pytest.mark.parametrize(
    ("stops", "tokens", "text", "stop"),
    [
        (["bcd", "abce"], list("xabcdz"), "xa", "bcd"),  # held for "abce", stopped by "bcd"
        (["b", "abc"], ["xabcz"], "xa", "b"),  # both complete in one token: the first to end
        (["bc", "abc"], ["xabcz"], "x", "abc"),  # same end: the one starting first
        (["aab"], list("aaab"), "a", "aab"),  # self-overlapping stop string
        (["STOP"], ["STOPabc"], "", "STOP"),  # at the very start
        (["STOP"], ["ST", "OP"], "", "STOP"),
    ],
)
def test_overlapping_and_leading_stop_strings(
    stops: list[str], tokens: list[str], text: str, stop: str
) -> None:
    checker = StopChecker(SamplingParams(stop=stops), [], toy_decode(tokens))
    feed(checker, range(len(tokens)))
    assert (checker.text, checker.finish_reason, checker.stop_reason) == (text, "stop", stop)


def test_incomplete_utf8_is_held_back_and_never_matched() -> None:
    tok = byte_tokenizer()
    data = list("é€x".encode())  # c3 a9 | e2 82 ac | 78
    checker = StopChecker(SamplingParams(max_tokens=50, stop=["\ufffd"]), [EOS], tok.decode)
    updates = feed(checker, data)
    assert [u.text for u in updates] == ["", "é", "", "", "€", "x"]
    assert checker.finish_reason is None
    # max_tokens in the middle of a character: the tail is flushed as decoded
    checker = StopChecker(SamplingParams(max_tokens=3), [EOS], tok.decode)
    assert [u.text for u in feed(checker, data)] == ["", "é", "\ufffd"]
    assert checker.finish_reason == "length"


def test_invalid_utf8_is_emitted_after_a_bounded_wait() -> None:
    tok = byte_tokenizer()
    checker = StopChecker(SamplingParams(max_tokens=50), [EOS], tok.decode)
    updates = feed(checker, [0xFF] * 6 + [ord("a")])
    assert "".join(u.text for u in updates[:4]) == "\ufffd" * 4  # not held forever
    assert checker.text == "\ufffd" * 6 + "a"


def test_decode_window_stays_small_and_gives_context() -> None:
    calls: list[int] = []
    vocab = ["▁Hello", "▁world", "!", "é"]

    def decode(ids: Sequence[int]) -> str:  # sentencepiece-like: drops the leading space
        calls.append(len(ids))
        return "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    checker = StopChecker(SamplingParams(max_tokens=600, stop=["zz", "\n\n"]), [], decode)
    feed(checker, [0, 1, 2] * 200)
    assert checker.text == "Hello world!" + " Hello world!" * 199
    assert checker.finish_reason == "length"
    assert max(calls) <= 2  # per-token cost does not grow with the output
    in_context = StopChecker(SamplingParams(), [], decode, context_token_ids=[1])
    assert in_context.append(0).text == " Hello"


def test_stop_token_ids_eos_and_ignore_eos() -> None:
    vocab = ["a", "S", "t", "<eos>", "<end>"]
    decode = toy_decode(vocab)
    checker = StopChecker(SamplingParams(stop=["Stop"], stop_token_ids=[4]), [3], decode)
    updates = feed(checker, [0, 1, 2, 4, 0])
    assert [u.text for u in updates] == ["a", "", "", "St"]  # held "St" released at the end
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("aSt", "stop", 4)
    checker = StopChecker(SamplingParams(), [3], decode)
    feed(checker, [0, 3, 0])
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("a", "stop", 3)
    checker = StopChecker(SamplingParams(ignore_eos=True, max_tokens=4), [3], decode)
    feed(checker, [0, 3, 0, 3, 0])
    assert (checker.text, checker.finish_reason, checker.num_generated) == (
        "a<eos>a<eos>",
        "length",
        4,
    )
    with pytest.raises(RuntimeError):
        checker.append(0)


@pytest.mark.parametrize(
    ("tokens", "text", "reason"),
    [([0, 0, 0, 0], "aaa", "length"), ([0, 0, 3], "aa", "stop"), ([0, 0, 1], "aa", "stop")],
)
def test_max_tokens_and_stops_on_the_last_token(tokens: list[int], text: str, reason: str) -> None:
    checker = StopChecker(SamplingParams(max_tokens=3, stop=["b"]), [3], toy_decode(list("ab ")))
    feed(checker, tokens)
    assert (checker.text, checker.finish_reason, checker.num_generated) == (text, reason, 3)


# ----------------------------------------------------------------------------- beam search


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
    early_stopping: bool | str, length_penalty: float, done: bool
) -> None:
    """Two stop tokens take the two best places at step 1; the live beams sum to log 0.2 and
    log 0.1, the worst finished score is log 0.3. Only the exact "never" rule with a positive
    length penalty sees that log 0.2 / 10 (max_tokens) could still beat it."""
    search = BeamSearch(2, 10, [2, 3], length_penalty, early_stopping)  # type: ignore[arg-type]
    step = search.step(torch.tensor([log_row(0.2, 0.1, 0.4, 0.3)]))
    assert [h.token_ids for h in step.finished] == [(2,), (3,)]
    assert (step.parents, step.token_ids, step.done) == ([0, 0], [0, 1], done)


@functools.cache
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).eval()


def hf_beam(
    prompt: torch.Tensor, eos: int, lp: float, early: bool | str
) -> tuple[list[list[int]], list[float]]:
    return generate_beams(tiny_llama(), prompt[0].tolist(), 4, 12, eos, lp, early)


def our_beam(prompt: torch.Tensor, eos: int, lp: float, early: bool | str) -> BeamSearch:
    search = BeamSearch(4, 12, [eos], lp, early)  # type: ignore[arg-type]
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
    for lp, early in [(1.0, False), (1.0, "never"), (1.0, True), (0.0, "never")]:
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
