"""``pagedserve bench``: a serving benchmark over HTTP, for any OpenAI-compatible server.

Streams requests (``stream: true``) to ``/v1/completions`` or ``/v1/chat/completions`` as a client
would, all at once (``--request-rate inf``, a burst) or arriving as a Poisson process, up to
``--max-concurrency`` in flight; the requests (``pagedserve.bench_workloads``) are seeded, so two
servers get the same ones. Measured per request, on the client: time to first token (TTFT),
time per output token after the first (TPOT), the gaps between chunks (ITL), end to end; in all,
output and input tokens per second (the usage the server reports with
``stream_options.include_usage``, else one token per chunk) and goodput (requests per second
meeting ``--slo-ttft-ms`` and ``--slo-tpot-ms``). A progress line on stderr; the report on stdout;
every figure in ``--result-json``.

``--workload multi-turn`` holds conversations: each turn's prompt is the previous turn's prompt,
the answer as this client received it and a new user message, sent once that answer is complete
(``--think-time-s`` later); the report adds TTFT per turn, since only the first turn of a
conversation finds nothing of it in the prefix cache.

``ignore_eos`` (a vLLM extension) makes outputs exactly ``max_tokens`` long; a server that rejects
it (``transformers serve``) needs ``--no-ignore-eos`` and a model that does not stop early.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pagedserve.bench_config import BenchConfig
from pagedserve.bench_report import Result
from pagedserve.bench_workloads import (
    WORKLOADS,
    TextMaker,
    Turn,
    Workload,
    build,
    parse_lengths,
    parse_popularity,
    parse_range,
    with_schemas,
)


class Client:
    """Streams requests and times them; one aiohttp session, ``max_concurrency`` at once."""

    def __init__(self, config: BenchConfig, session: aiohttp.ClientSession, model: str) -> None:
        self.config, self.session, self.model = config, session, model
        self.t0 = time.perf_counter()
        limit = config.max_concurrency or 1 << 30
        self.slots = asyncio.Semaphore(limit)
        key = config.api_key or os.environ.get("OPENAI_API_KEY", "")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def body(self, history: list[tuple[str, str]], turn: Turn) -> dict[str, Any]:
        """The request of ``turn`` after ``history`` ((user, assistant) pairs)."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": turn.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if self.config.priority:
            body["priority"] = self.config.priority
        if turn.schema is not None:
            schema = {"name": "bench", "schema": turn.schema}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.config.endpoint == "chat":
            messages = []
            for user, assistant in history:
                messages += [{"role": "user", "content": user}]
                messages += [{"role": "assistant", "content": assistant}]
            body["messages"] = [*messages, {"role": "user", "content": turn.text}]
        else:
            past = "".join(f"{user}\n{assistant}\n" for user, assistant in history)
            body["prompt"] = past + turn.text
        return body

    async def send(self, body: dict[str, Any]) -> Result:
        path = "chat/completions" if self.config.endpoint == "chat" else "completions"
        url = f"{self.config.base_url.rstrip('/')}/v1/{path}"
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_s)
        async with self.slots:
            result = Result(self.now())
            try:
                async with self.session.post(
                    url, json=body, headers=self.headers, timeout=timeout
                ) as response:
                    if response.status != 200:
                        result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                        return result
                    result.server_pool = response.headers.get("X-PagedServe-Pool", "")
                    await self._read(response, result)
            except (aiohttp.ClientError, TimeoutError) as err:
                result.error = f"{type(err).__name__}: {err}"
            result.end = self.now()
            return result

    async def _read(self, response: aiohttp.ClientResponse, result: Result) -> None:
        chat = self.config.endpoint == "chat"
        counted = 0
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue  # blank lines and SSE comments (keep-alives)
            if line == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                result.error = f"error event: {event['error']}"
                return
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    now = self.now()
                    result.first = result.first if result.first is not None else now
                    result.chunks.append(now)
                    result.text += text
                    counted += 1
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
            usage = event.get("usage")
            if usage:
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = int(details.get("cached_tokens") or 0)
        result.output_tokens = result.output_tokens or counted

    async def conversation(self, turns: list[Turn], done: Callable[[Result], None]) -> list[Result]:
        history: list[tuple[str, str]] = []
        results = []
        for turn in turns:
            result = await self.send(self.body(history, turn))
            result.conversation, result.turn = turn.conversation, turn.turn
            result.guided = turn.schema is not None
            done(result)
            results.append(result)
            if not result.ok:
                break  # a conversation does not go on past a failed turn
            history.append((turn.text, result.text))
            if self.config.think_time_s > 0 and len(results) < len(turns):
                await asyncio.sleep(self.config.think_time_s)
        return results


async def first_model(session: aiohttp.ClientSession, config: BenchConfig) -> str:
    async with session.get(f"{config.base_url.rstrip('/')}/v1/models") as response:
        response.raise_for_status()
        return str((await response.json())["data"][0]["id"])


async def run_requests(config: BenchConfig, groups: list[list[Turn]]) -> tuple[list[Result], float]:
    """Sends every group (a conversation, or one request) at its arrival time; the results and
    the duration from the first send to the last answer."""
    total, finished = sum(len(g) for g in groups), []
    rng = random.Random(config.seed + 1)
    progress = Progress(total, config.progress)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = config.model or await first_model(session, config)
        client = Client(config, session, model)

        def done(result: Result) -> None:
            finished.append(result)
            progress.update(len(finished), sum(r.output_tokens for r in finished), client.now())

        tasks = []
        for group in groups:
            tasks.append(asyncio.create_task(client.conversation(group, done)))
            if math.isfinite(config.request_rate):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = [r for group in await asyncio.gather(*tasks) for r in group]
        duration = max(r.end for r in results) if results else 0.0
    progress.close()
    return results, duration


class Progress:
    """``done/total, elapsed, output tok/s`` on stderr: redrawn on a terminal, else every 10%."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self._next = 0.1

    def update(self, done: int, tokens: int, elapsed: float) -> None:
        """``done`` requests finished, ``tokens`` output tokens, ``elapsed`` seconds in."""
        if not self.enabled:
            return
        rate = tokens / max(elapsed, 1e-9)
        line = f"{done}/{self.total} requests, {elapsed:.1f} s, {rate:.0f} out tok/s"
        if self.tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        elif done / self.total >= self._next or done == self.total:
            print(line, file=sys.stderr, flush=True)
            self._next = done / self.total + 0.1

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def requests_of(config: BenchConfig) -> list[list[Turn]]:
    """The requests ``config`` asks for, grouped as ``build`` does. Raises ValueError (a bad
    flag) or OSError (the tokenizer)."""
    decode, vocab = tokenizer_of(config.tokenizer)
    groups = build(
        _workload(config.workload),
        config.num_requests,
        parse_lengths(config.input_len),
        parse_lengths(config.output_len),
        config.seed,
        lambda rng: TextMaker(rng, decode, vocab),
        parse_range(config.prefix_len),
        config.num_prefixes,
        config.turns,
        config.conversations,
        parse_lengths(config.first_prompt_len) if config.first_prompt_len else None,
        parse_lengths(config.turn_prompt_len) if config.turn_prompt_len else None,
        prefix_zipf=parse_popularity(config.prefix_popularity),
    )
    return with_schemas(groups, config.guided_fraction, config.seed)


def _workload(name: str) -> Workload:
    for workload in WORKLOADS:
        if workload == name:
            return workload
    raise ValueError(f"workload {name!r}: one of {', '.join(WORKLOADS)}")


def tokenizer_of(name: str) -> tuple[Callable[[list[int]], str] | None, int]:
    """``name``'s decode (special tokens left out) and vocabulary size; (None, 0) for none."""
    if not name:
        return None, 0
    from contracts.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(name)
    special = set(tokenizer.all_special_ids)
    vocab = len(tokenizer)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode([i for i in ids if i not in special]))

    return decode, vocab
