"""``bench/multi_gpu.py``'s split of a run by serving pool (on a result as ``pagedserve bench``
writes it) and its start of several stacks side by side."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from bench.multi_gpu import enter_together, per_pool


def request(pool: str, start: float, end: float, prompt: int, output: int) -> dict[str, object]:
    return {"server_pool": pool, "start_s": start, "end_s": end, "prompt_tokens": prompt,
            "output_tokens": output, "error": None}  # fmt: skip


def test_each_pool_gets_its_requests_tokens_and_last_end() -> None:
    failed = {**request("1", 10.0, 99.0, 5, 0), "error": "timeout"}
    result = {
        "requests": [
            request("0", 10.0, 12.5, 100, 30),
            request("1", 10.5, 19.0, 200, 60),
            request("0", 11.0, 14.0, 50, 20),
            failed,
        ]
    }
    assert per_pool(result) == (
        "pool 0: 2 requests, 150 prompt and 50 output tokens, last end 4.0 s; "
        "pool 1: 1 requests, 200 prompt and 60 output tokens, last end 9.0 s"
    )
    assert per_pool({"requests": [failed]}) == "no request completed"


def test_stacks_entered_together_are_all_left_even_when_one_fails() -> None:
    """``enter_together``: every manager whose start succeeded is exited with the stack, the
    first failure raised once all tried (no stack left running)."""
    events: list[str] = []

    @contextlib.contextmanager
    def stack(name: str, fails: bool = False) -> Iterator[str]:
        if fails:
            raise RuntimeError(f"{name} did not start")
        events.append(f"up {name}")
        try:
            yield f"url-{name}"
        finally:
            events.append(f"down {name}")

    with contextlib.ExitStack() as outer:
        assert enter_together(outer, [stack("a"), stack("b")]) == ["url-a", "url-b"]
    assert sorted(events) == ["down a", "down b", "up a", "up b"]
    events.clear()
    with pytest.raises(RuntimeError, match="b did not start"), contextlib.ExitStack() as outer:
        enter_together(outer, [stack("a"), stack("b", fails=True), stack("c")])
    assert sorted(events) == ["down a", "down c", "up a", "up c"]
