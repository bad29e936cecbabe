"""``bench/multi_gpu.py``'s split of a run by serving pool, on a result as ``pagedserve bench``
writes it."""

from __future__ import annotations

from bench.multi_gpu import per_pool


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
