"""A fuzz of hostile-but-valid requests through the whole stack (`pagedserve up`), against three
kinds of tokenizer: the byte-level BPE of ``tiny``, a character-level ``WordLevel`` tokenizer
(which the grammar engine cannot read: structured output is refused) and a real BPE tokenizer.

Hypothesis draws random combinations of every parameter the API accepts: ``n``, ``best_of`` and
beam search, ``logprobs``/``top_logprobs``/``echo``, the penalties, ``logit_bias``,
``min_tokens``, stop strings and ids, ``response_format`` and ``guided_*``, ``max_tokens`` 0, 1
or at the context's limit, seeds, prompts of token ids with the special and the largest ids,
streaming or not, and clients that disconnect mid-answer; they are sent concurrently. Pass: no
process of the stack restarts, no answer is a 5xx, every request is answered in bounded time,
no block stays in use, and the stack serves afterwards.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import protocol as p
from kvstore.client import KVClient
from pagedserve.redis_server import free_port
from tests.checkpoints import save_bpe_checkpoint, save_char_level_checkpoint
from tests.pagedserve.test_up import up_command, up_env

REQUESTS = 160  # per tokenizer kind
CONCURRENCY = 24
TIMEOUT_S = 300.0  # one answer, streamed to its end (a loaded 2-core machine)
MAX_MODEL_LEN = 64
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    {"type": "object", "properties": {"s": {"enum": ["x", "yz"]}}},
]


NOT_WITH_BEAMS = {
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
}


@dataclass(frozen=True)
class Served:
    """A running `pagedserve up` and what the fuzz needs to know of its model."""

    kind: str
    url: str
    endpoint: str
    log: Path
    vocab: int
    special: list[int]  # BOS, EOS and the like


def start(kind: str, tmp: Path) -> tuple[subprocess.Popen[bytes], Served]:
    if kind == "bytes":
        model, vocab, special = "tiny", 259, [256, 257, 258]
    elif kind == "chars":
        model, vocab, special = str(save_char_level_checkpoint(tmp / "chars")), 103, [0, 1, 2]
    else:
        checkpoint, vocab, special = save_bpe_checkpoint(tmp / "bpe")
        model = str(checkpoint)
    port = free_port()
    endpoint = f"ipc:///tmp/pagedserve-fuzz-{uuid.uuid4().hex[:8]}.sock"
    cmd = up_command(port, endpoint, tmp / "redis")
    cmd[cmd.index("--model") + 1] = model
    cmd += ["--gateway-args", f"--max-model-len {MAX_MODEL_LEN} --max-n 4"]
    log = tmp / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(cmd, env=up_env(), stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while "pagedserve is up" not in log.read_text(errors="replace"):
        assert up.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    served = Served(kind, f"http://127.0.0.1:{port}", endpoint, log, vocab, special)
    return up, served


@pytest.fixture(scope="module", params=["bytes", "chars", "bpe"])
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    up, running = start(request.param, tmp_path_factory.mktemp(f"fuzz-{request.param}"))
    try:
        yield running
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)


def requests(model: Served) -> st.SearchStrategy[tuple[str, dict[str, Any], int | None]]:
    """(path, body, disconnect after this many bytes or None) of valid-looking requests."""
    ids = st.integers(0, model.vocab - 1) | st.sampled_from([*model.special, model.vocab - 1])
    id_prompt = st.lists(ids, min_size=1, max_size=24)
    text = st.text(min_size=1, max_size=20)
    guides = st.one_of(
        st.builds(lambda: {"response_format": {"type": "json_object"}}),
        st.sampled_from(SCHEMAS).map(
            lambda s: {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": s},
                }
            }
        ),
        st.sampled_from(SCHEMAS).map(lambda s: {"guided_json": s}),
        st.sampled_from(["[a-c]{1,4}", "(yes|no)", "[0-9]+"]).map(lambda r: {"guided_regex": r}),
        st.lists(text, min_size=1, max_size=3).map(lambda c: {"guided_choice": c}),
    )
    common = {
        "n": st.integers(1, 3),
        "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]),
        "top_p": st.floats(0.05, 1.0),
        "top_k": st.integers(-1, model.vocab + 5),
        "seed": st.integers(0, 2**63 - 1),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "stop_token_ids": st.lists(ids, max_size=3),
        "ignore_eos": st.booleans(),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2.0),
        "logit_bias": st.dictionaries(ids.map(str), st.floats(-100, 100), max_size=3),
        "min_tokens": st.integers(0, 3),
        "max_tokens": st.sampled_from([1, 2, 8, MAX_MODEL_LEN]),
        "stream": st.booleans(),
        "stream_options": st.just({"include_usage": True}),
        "cache_salt": st.sampled_from(["a", "b"]),
    }
    beam = st.integers(2, 3).flatmap(
        lambda width: st.fixed_dictionaries(
            {
                "use_beam_search": st.just(True),
                "best_of": st.just(width),
                "n": st.integers(1, width),
            }
        )
    )

    @st.composite
    def draw(data: st.DrawFn) -> tuple[str, dict[str, Any], int | None]:
        body: dict[str, Any] = data(st.fixed_dictionaries({}, optional=common))
        if data(st.integers(0, 3)) == 0:
            body.update(data(guides))
        chat = data(st.booleans())
        if chat:
            roles = st.sampled_from(["system", "user", "assistant"])
            message = st.fixed_dictionaries({"role": roles, "content": text})
            body["messages"] = data(st.lists(message, min_size=1, max_size=3))
            if data(st.booleans()):
                body |= {"logprobs": True, "top_logprobs": data(st.integers(0, 5))}
        else:
            prompt = data(id_prompt | text | st.lists(id_prompt, min_size=1, max_size=2))
            body["prompt"] = prompt
            if data(st.booleans()):
                body["logprobs"] = data(st.integers(0, 5))
            if data(st.booleans()):
                body["echo"] = True
                if data(st.booleans()):
                    body["max_tokens"] = 0
            ids_only = isinstance(prompt, list) and prompt and isinstance(prompt[0], int)
            if ids_only and data(st.booleans()):  # exactly at the context's limit
                body["max_tokens"] = MAX_MODEL_LEN - len(prompt)
        if data(st.integers(0, 5)) == 0:
            body.update(data(beam))
            if data(st.integers(0, 4)):  # mostly what beam search takes (else: a 400)
                body = {k: v for k, v in body.items() if k not in NOT_WITH_BEAMS}
        if body.get("min_tokens", 0) > body.get("max_tokens", 16):
            del body["min_tokens"]
        disconnect = data(st.none() | st.integers(0, 400))
        return ("/v1/chat/completions" if chat else "/v1/completions"), body, disconnect

    return draw()


async def send(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], cut: int | None
) -> int | str:
    """The status once the whole answer was read; "cut" when the client went away first."""
    body = {"model": "m"} | body
    async with session.post(f"{url}{path}", json=body) as response:
        if cut is not None and response.status == 200:
            await response.content.read(cut)
            return "cut"
        data = await response.read()
        if response.status == 400:  # which check: the fuzz should mostly pass them
            return f"400 {json.loads(data)['error']['param']}"
        return response.status


def test_hostile_but_valid_requests_never_break_the_stack(
    served: Served, capsys: pytest.CaptureFixture[str]
) -> None:
    drawn: list[tuple[str, dict[str, Any], int | None]] = []

    @settings(
        max_examples=REQUESTS,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(requests(served))
    def collect(request: tuple[str, dict[str, Any], int | None]) -> None:
        drawn.append(request)

    collect()

    async def run_all() -> list[int | str]:
        model_name = await served_name(served.url)
        slots = asyncio.Semaphore(CONCURRENCY)
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(path: str, body: dict[str, Any], cut: int | None) -> int | str:
                async with slots:
                    try:
                        return await send(
                            session, served.url, path, body | {"model": model_name}, cut
                        )
                    except (aiohttp.ClientError, TimeoutError) as err:
                        return repr(err)

            return await asyncio.gather(*(one(*request) for request in drawn))

    started = time.monotonic()
    answers = asyncio.run(run_all())
    elapsed = time.monotonic() - started
    bad = [
        (a, r)
        for a, r in zip(answers, drawn, strict=True)
        if not (a == "cut" or str(a).startswith("400 ") or (isinstance(a, int) and a < 500))
    ]
    assert not bad, bad[:10]
    statuses = Counter(answers)
    assert statuses[200] >= len(drawn) // 4, statuses  # most get past the checks: deep paths run
    assert_no_block_in_use(served.endpoint)
    assert asyncio.run(served_after(served.url)) == 200
    log = served.log.read_text(errors="replace")
    restarts = log.count("restarting in")
    assert restarts == 0, log
    combinations = {
        tuple(sorted(k for k in body if k not in ("prompt", "messages"))) for _, body, _ in drawn
    }
    with capsys.disabled():  # CI's log shows the counts (outside pytest's capture)
        print(
            f"\nfuzz {served.kind}: {len(drawn)} requests in {elapsed:.0f} s, "
            f"{len(combinations)} parameter combinations, answers {dict(statuses)}, "
            f"restarts {restarts}",
            flush=True,
        )


async def served_name(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as response:
        return str((await response.json())["data"][0]["id"])


async def served_after(url: str) -> int:
    name = await served_name(url)
    body = {"model": name, "prompt": "after the fuzz", "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/v1/completions", json=body) as response,
    ):
        await response.read()
        return response.status


def assert_no_block_in_use(endpoint: str, timeout_s: float = 60.0) -> None:
    """Every request ended (the cut ones abort within the workers' abort check): no block of
    the GPU pool is held."""
    deadline = time.monotonic() + timeout_s
    with KVClient(endpoint, timeout_s=10) as client:
        while True:
            stats = client.call(p.GetStats(0))
            assert isinstance(stats, p.Stats)
            if stats.gpu.used == 0 and not stats.requests:
                return
            assert time.monotonic() < deadline, (stats.gpu, stats.requests[:5])
            time.sleep(0.2)
