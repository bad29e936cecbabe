"""2,000 generated bodies against a real gateway (and the real worker behind it): the weirdest
valid requests and garbage alike get an answer in bounded time, never a 5xx, and the stack goes
on serving.

Hypothesis draws 2,000 bodies, sent as they are drawn, up to 64 at once: OpenAI-shaped objects
whose fields are sometimes valid, sometimes out of range, sometimes of the wrong type, plus raw
bytes, arbitrary JSON and deeply nested JSON. The gateway under test has a 48-token context
(``--max-model-len``) so that every valid body, whatever its defaults, generates little.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.stack import Gateway, Stack

BODIES = 2000
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CONCURRENCY = 64
TIMEOUT_S = 120.0  # one answer, streamed to its end: "no hang" means within this

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
small_ints = st.integers(-3, 8)
texts = st.text(max_size=40)
token_ids = st.lists(st.integers(-2, 300), min_size=0, max_size=20)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value, sometimes anything."""
    return st.one_of(valid, valid, valid, json_values)


def sampling(wild: bool) -> dict[str, st.SearchStrategy[Any]]:
    """The fields both endpoints share: plausible values (some still out of range), or with
    ``wild`` sometimes anything."""
    pick = maybe if wild else (lambda s: s)
    return {
        "model": pick(st.sampled_from(["tiny", "tiny", "tiny", "gpt-4"])),
        "n": pick(st.integers(1, 4) | small_ints),
        "best_of": pick(small_ints),
        "temperature": pick(st.floats(0, 2) | st.just(0.0)),
        "top_p": pick(st.floats(0.01, 1.0) | st.floats(-0.5, 1.5)),
        "top_k": pick(st.integers(-2, 300)),
        "seed": pick(st.integers(-(2**64), 2**64)),
        "stop": pick(texts | st.lists(texts, max_size=3)),
        "stream": pick(st.booleans()),
        "stream_options": pick(
            st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})
        ),
        "ignore_eos": pick(st.booleans()),
        "stop_token_ids": pick(st.lists(st.integers(0, 258), max_size=4) | token_ids),
        "use_beam_search": pick(st.booleans()),
        "beam_width": pick(st.integers(1, 4)),
        "length_penalty": pick(st.floats(-2, 2)),
        "cache_salt": pick(texts),
        "priority": pick(st.integers(-(2**33), 2**33)),
        "user": pick(texts),
        "frequency_penalty": pick(st.floats(-2, 2) | st.floats(-3, 3)),
        "presence_penalty": pick(st.floats(-2, 2)),
        "repetition_penalty": pick(st.floats(0.5, 2.0) | st.floats(-1, 101)),
        "min_tokens": pick(st.integers(0, 4) | st.integers(-1, 100)),
        "logit_bias": pick(
            st.dictionaries(st.integers(0, 258).map(str), st.floats(-100, 100), max_size=3)
        ),
        **(
            {
                "logit_bias": maybe(st.dictionaries(texts, st.floats(-100, 100), max_size=2)),
                "extra_unknown_field": json_values,
            }
            if wild
            else {}
        ),
    }


PROMPTS = texts | token_ids | st.lists(texts, max_size=3) | st.lists(token_ids, max_size=3)
VALID_IDS = st.lists(st.integers(0, 258), min_size=1, max_size=20)
VALID_PROMPTS = (
    st.text(min_size=1, max_size=40) | VALID_IDS | st.lists(VALID_IDS, min_size=1, max_size=3)
)
CONTENT = texts | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": texts}),
    max_size=3,
)
ROLES = st.sampled_from(["system", "user", "user", "assistant", "tool", "wizard"])


def completion(wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    pick = maybe if wild else (lambda s: s)
    extra = {"logprobs": maybe(small_ints), "suffix": maybe(texts)} if wild else {}
    return st.fixed_dictionaries(
        {"prompt": maybe(PROMPTS) if wild else VALID_PROMPTS},
        optional={
            **sampling(wild),
            "max_tokens": pick(st.integers(-2, 60)),
            "echo": pick(st.booleans()),
            **extra,
        },
    )


def chat(wild: bool) -> st.SearchStrategy[dict[str, Any]]:
    pick = maybe if wild else (lambda s: s)
    message = st.fixed_dictionaries(
        {"role": pick(ROLES), "content": pick(CONTENT)}, optional={"name": texts}
    )
    extra = {
        "logprobs": maybe(st.booleans()),
        "top_logprobs": maybe(small_ints),
        "tools": maybe(st.lists(json_values, max_size=2)),
        "response_format": maybe(st.just({"type": "json_object"})),
    }
    return st.fixed_dictionaries(
        {"messages": pick(st.lists(message, max_size=4))},
        optional={
            **sampling(wild),
            "max_tokens": pick(st.integers(-2, 60)),
            "max_completion_tokens": pick(st.integers(-2, 60)),
            **(extra if wild else {}),
        },
    )


nested = st.builds(
    lambda field, depth: b'{"%s": ' % field + b"[" * depth + b"]" * depth + b"}",
    st.sampled_from([b"prompt", b"messages", b"stop", b"x"]),
    st.integers(1, 100_000),
)
garbage = st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()) | nested


def encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


bodies = st.one_of(
    *[st.tuples(st.just(COMPLETIONS), completion(wild).map(encode)) for wild in (False, True)],
    *[st.tuples(st.just(CHAT), chat(wild).map(encode)) for wild in (False, True)],
    st.tuples(st.sampled_from([COMPLETIONS, CHAT]), garbage),
)


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> Iterator[Gateway]:
    with stack.gateway("--max-model-len", "48", "--max-n", "4") as running:
        yield running


class Sender:
    """Sends bodies from a loop of its own thread, at most ``CONCURRENCY`` at once, so the
    examples Hypothesis draws one by one are answered concurrently (as clients would send)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sent: list[tuple[str, bytes, concurrent.futures.Future[int | str]]] = []
        self._session = asyncio.run_coroutine_threadsafe(self._open(), self.loop).result()

    async def _open(self) -> aiohttp.ClientSession:
        self._slots = asyncio.Semaphore(CONCURRENCY)
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    def send(self, path: str, body: bytes) -> None:
        future = asyncio.run_coroutine_threadsafe(self._send(path, body), self.loop)
        self.sent.append((path, body, future))

    async def _send(self, path: str, body: bytes) -> int | str:
        """The status once the whole answer (a stream to its end) was read, or the error."""
        async with self._slots:
            headers = {"Content-Type": "application/json"}
            try:
                async with self._session.post(
                    f"{self.url}{path}", data=body, headers=headers
                ) as response:
                    await response.read()
                    return response.status
            except (aiohttp.ClientError, TimeoutError) as err:
                return repr(err)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._session.close(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def test_no_body_gets_a_5xx_or_hangs(gateway: Gateway) -> None:
    sender = Sender(gateway.url)

    @settings(
        max_examples=BODIES,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies)
    def send(request: tuple[str, bytes]) -> None:
        sender.send(*request)

    try:
        send()
        answers = [(future.result(), path, body) for path, body, future in sender.sent]
    finally:
        sender.close()
    bad = [(a, p, b[:300]) for a, p, b in answers if not (isinstance(a, int) and a < 500)]
    assert not bad, bad
    statuses = [a for a, _, _ in answers]
    assert len(statuses) >= BODIES
    assert statuses.count(200) >= 200, "too few valid bodies: the fuzz tests only the parser"
    print(f"\n{len(statuses)} bodies: {statuses.count(200)} served, the rest 4xx")
    after = Sender(gateway.url)
    try:
        body = {"model": "tiny", "prompt": "after the fuzz", "max_tokens": 3}
        after.send("/v1/completions", encode(body))
        assert after.sent[0][2].result() == 200
    finally:
        after.close()
