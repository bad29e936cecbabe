"""Ordinary requests that used to take the stack down or hang it, through a real stack whose
KV pool is small (65 blocks of 16 tokens: 1,040 tokens, a quarter of the context): each is
answered correctly and the stack keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.stack import Stack, running_stack

POOL_TOKENS = 65 * 16


@pytest.fixture(scope="module")
def small(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("small-pool-stack")
    with running_stack(redis_url, logs, 4, "0.0005GiB") as stack:
        yield stack


def post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{stack.url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


def test_n2_with_max_tokens_1(small: Stack) -> None:
    """The request that killed the worker: both branches end on their first token."""
    out = client(small).completions.create(model="tiny", prompt="hi", max_tokens=1, n=2, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_n4_whose_first_token_is_eos(small: Stack) -> None:
    """Greedy n=4 after "L": the tiny model's first token is its EOS, in every branch."""
    out = client(small).completions.create(
        model="tiny", prompt="L", max_tokens=8, n=4, temperature=0
    )
    assert [c.finish_reason for c in out.choices] == ["stop"] * 4
    assert [c.text for c in out.choices] == [""] * 4


def test_a_prompt_longer_than_the_pool_is_refused_naming_the_capacity(small: Stack) -> None:
    """Within the context (4,096) but past what the KV pool can hold for one request: a 400
    that names the KV capacity, for the prompt alone and for prompt + max_tokens; a default
    max_tokens is capped to fit instead."""
    status, answer = post(small, "/v1/completions", {"prompt": [65] * 1500, "max_tokens": 4})
    assert status == 400, answer
    error = answer["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert (
        f"KV cache holds at most 65 blocks of 16 tokens ({POOL_TOKENS} tokens)" in error["message"]
    )
    status, answer = post(small, "/v1/completions", {"prompt": [65] * 1000, "max_tokens": 100})
    assert status == 400 and answer["error"]["param"] == "max_tokens", answer
    assert "at most 38 fit" in answer["error"]["message"]  # 65 blocks less 2 lookahead slots
    status, answer = post(
        small,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "c" * 1000}], "temperature": 0},
    )
    assert status == 200, answer  # max_tokens defaults to what fits, not to the context
    assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] <= POOL_TOKENS


def test_the_largest_request_that_fits_is_served_beside_others(small: Stack) -> None:
    """A request needing the whole pool and small ones at once: the large one is never starved
    (placements are first come, first served) and everything finishes."""
    import concurrent.futures

    def big() -> Any:
        return client(small).completions.create(
            model="tiny",
            prompt=[66] * 1000,
            max_tokens=38,  # 1,038 tokens and the 2 lookahead slots: the whole 65 blocks
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    def little(i: int) -> Any:
        return client(small).completions.create(
            model="tiny", prompt=f"little {i}", max_tokens=30, extra_body={"ignore_eos": True}
        )

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        smalls = [pool.submit(little, i) for i in range(4)]
        large = pool.submit(big)
        smalls += [pool.submit(little, i) for i in range(4, 8)]
        assert large.result(timeout=300).usage.completion_tokens == 38
        assert all(f.result(timeout=300).usage.completion_tokens == 30 for f in smalls)
    small.wait_blocks_released()


def test_the_stack_still_serves(small: Stack) -> None:
    """Sampled (temperature 1) without a seed: ignore_eos, or a drawn EOS would end it early."""
    out = client(small).completions.create(
        model="tiny", prompt="still", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 3
