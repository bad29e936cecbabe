"""compute.sampling.stops: stop conditions and incremental detokenization (CPU, no mocks)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compute.model.models import EOS, byte_tokenizer
from compute.sampling.stops import StopChecker, StopUpdate
from contracts.records import SamplingParams


def toy_decode(vocab: list[str]) -> Callable[[Sequence[int]], str]:
    return lambda ids: "".join(vocab[i] for i in ids)


def feed(
    checker: StopChecker, ids: Sequence[int], max_tokens: int | None = None
) -> list[StopUpdate]:
    """Appends until finished, the ``max_tokens``-th token marked the last the length limit
    allows (as the worker's ``Sequence.last_allowed`` does); checks the streamed deltas add up
    to the final text."""
    updates: list[StopUpdate] = []
    for offset, token in enumerate(ids):
        updates.append(checker.append(token, last=offset + 1 == max_tokens))
        if updates[-1].finish_reason is not None:
            break
    assert "".join(u.text for u in updates) == checker.text
    return updates


@functools.cache
def byte_decode() -> Callable[[Sequence[int]], str]:
    tokenizer = byte_tokenizer()

    def decode(ids: Sequence[int]) -> str:
        text = tokenizer.decode(list(ids))
        assert isinstance(text, str)
        return text

    return decode


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abé€", max_size=16),
    stops=st.lists(st.text(alphabet="abé€", min_size=1, max_size=4), max_size=3),
)
def test_incremental_stops_equal_a_whole_text_reference(text: str, stops: list[str]) -> None:
    """Byte tokens (multi-byte characters split across tokens) against the non-incremental rule:
    the stop occurrence ending first (then starting first) in the whole text cuts it."""
    data = list(text.encode())
    checker = StopChecker(SamplingParams(stop=stops), [EOS], byte_decode())
    updates = feed(checker, data, max_tokens=max(1, len(data)))  # the last token ends it
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
    decode = byte_decode()
    data = list("é€x".encode())  # c3 a9 | e2 82 ac | 78
    checker = StopChecker(SamplingParams(stop=["\ufffd"]), [EOS], decode)
    updates = feed(checker, data, max_tokens=50)
    assert [u.text for u in updates] == ["", "é", "", "", "€", "x"]
    assert checker.finish_reason is None
    # max_tokens in the middle of a character: the tail is flushed as decoded
    checker = StopChecker(SamplingParams(), [EOS], decode)
    assert [u.text for u in feed(checker, data, max_tokens=3)] == ["", "é", "\ufffd"]
    assert checker.finish_reason == "length"


def test_invalid_utf8_is_emitted_after_a_bounded_wait() -> None:
    decode = byte_decode()
    checker = StopChecker(SamplingParams(), [EOS], decode)
    updates = feed(checker, [0xFF] * 6 + [ord("a")], max_tokens=50)
    assert "".join(u.text for u in updates[:4]) == "\ufffd" * 4  # not held forever
    assert checker.text == "\ufffd" * 6 + "a"


def test_decode_window_stays_small_and_gives_context() -> None:
    calls: list[int] = []
    vocab = ["▁Hello", "▁world", "!", "é"]

    def decode(ids: Sequence[int]) -> str:  # sentencepiece-like: drops the leading space
        calls.append(len(ids))
        return "".join(vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    checker = StopChecker(SamplingParams(stop=["zz", "\n\n"]), [], decode)
    feed(checker, [0, 1, 2] * 200, max_tokens=600)
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
    checker = StopChecker(SamplingParams(ignore_eos=True), [3], decode)
    updates = feed(checker, [0, 3, 0, 3, 0], max_tokens=4)
    assert (checker.text, checker.finish_reason, len(updates)) == ("a<eos>a<eos>", "length", 4)
    with pytest.raises(RuntimeError):
        checker.append(0)
    # a grammar's end token stops a guided sequence, ignore_eos or not; the model's EOS does not
    checker = StopChecker(SamplingParams(ignore_eos=True), [3], decode, grammar_eos=4)
    feed(checker, [0, 3, 4, 0])
    assert (checker.text, checker.finish_reason, checker.stop_reason) == ("a<eos>", "stop", 4)


@pytest.mark.parametrize(
    ("tokens", "text", "reason"),
    [([0, 0, 0, 0], "aaa", "length"), ([0, 0, 3], "aa", "stop"), ([0, 0, 1], "aa", "stop")],
)
def test_max_tokens_and_stops_on_the_last_token(tokens: list[int], text: str, reason: str) -> None:
    checker = StopChecker(SamplingParams(stop=["b"]), [3], toy_decode(list("ab ")))
    updates = feed(checker, tokens, max_tokens=3)
    assert (checker.text, checker.finish_reason, len(updates)) == (text, reason, 3)
