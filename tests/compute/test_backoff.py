"""``compute.loop.backoff.retry_with_backoff``: the delays between attempts, the errors that wait no
more, and stopping."""

from __future__ import annotations

import pytest

from compute.loop import backoff


def test_retries_with_doubled_delays_until_an_attempt_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(backoff.time, "sleep", slept.append)
    failures = iter([ConnectionError("down"), TimeoutError("waited"), *[OSError()] * 4])

    def attempt() -> str:
        for failure in failures:
            raise failure
        return "up"

    errors = (ConnectionError, TimeoutError, OSError)
    assert (
        backoff.retry_with_backoff(attempt, lambda: False, errors, 1.0, "x", (TimeoutError,))
        == "up"
    )
    assert slept == [0.25, 0.0, 1.0, 1.0, 1.0, 1.0]


def test_stops_before_an_attempt_and_lets_other_errors_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backoff.time, "sleep", lambda _s: None)
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise ConnectionError

    stop = lambda: len(calls) == 3  # noqa: E731
    assert backoff.retry_with_backoff(failing, stop, (ConnectionError,), 5, "") is None
    assert len(calls) == 3
    with pytest.raises(ValueError):
        backoff.retry_with_backoff(lambda: int("x"), lambda: False, (ConnectionError,), 5, "")
