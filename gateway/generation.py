"""One HTTP request's generation: submit to Redis, read the deltas back, hand out their text.

A request with several prompts becomes one ``RequestRecord`` per prompt (``{id}-{i}``; a single
prompt keeps ``{id}``); each prompt has ``n`` sequences and choice ``i * n + k`` is sequence ``k``
of prompt ``i``.

Text. The gateway does not detokenize: each ``OutputRecord`` carries the ``text`` its tokens
add, as the worker's stop checker released it (the worker decides where a stop string cuts, and
holds back the start of a possible stop string and incomplete UTF-8 characters), so what a
client sees is exactly what the worker stopped on. ``completion_tokens`` counts every token the
workers sampled, a stop token or the tokens of a stop string included.

Lifecycle. ``Generation.deltas()`` yields lists of ``Delta`` until every sequence has finished,
and an empty list whenever nothing came for ``keepalive_s`` (a stream sends a comment then);
``close()`` (always call it, e.g. in ``finally``) aborts the prompts whose final record has not
come, so a client that disconnects frees its blocks. ``GenerationError`` ends it early, with the
error the client is told: a final "error" record, an output that cannot be read, the
``deadline`` passed, or ``cancel`` (the server shutting down).

Records are idempotent: each carries the ``offset`` of its tokens in its sequence, and a record
whose tokens were already taken in is skipped (a worker rebuilding a request after a Redis
restart publishes again what the restart lost, which this gateway may have read before).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio

from contracts import queue_gateway
from contracts.records import REQUEST_ERRORS, OutputRecord, RequestRecord
from gateway.errors import APIError
from gateway.logprobs import Logprob, PromptLogprob
from gateway.metrics import Metrics
from gateway.model_info import ModelInfo
from gateway.prepare import Prepared
from gateway.router import OutputRouter
from gateway.routing import Placement

log = logging.getLogger("pagedserve.gateway")
_background: set[asyncio.Task[None]] = set()  # aborts that must outlive a cancelled handler


class GenerationError(Exception):
    """The generation cannot go on; ``error`` is what the client is told."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


def _error_of(record: OutputRecord) -> APIError:
    """What the client is told of a request a worker ended with an error: a 400 when the cause
    lies in the request (``records.REQUEST_ERRORS``), a 503 when nobody could serve it, else a
    500."""
    message = f"generation failed: {record.error or 'the worker failed the request'}"
    code = record.error_code
    if code in REQUEST_ERRORS:
        return APIError(400, message, code=code)
    if code == "unavailable":
        return APIError(503, message, code=code)
    return APIError(500, message, code="worker_error")


@dataclass
class Delta:
    """New text of one choice; ``finish_reason`` set on its last delta; the sampled tokens'
    logprobs when the request asked for them."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # on a choice's first delta, if asked


@dataclass
class _Sequence:
    index: int  # choice index
    tokens: int = 0
    finish_reason: str | None = None
    last_at: float | None = None
    started: bool = False  # a delta went out


@dataclass
class _Prompt:
    req_id: str
    token_ids: list[int]
    sequences: list[_Sequence]
    cached_tokens: int = 0
    final: bool = False  # the worker sent the final record
    prompt_logprobs: list[PromptLogprob] | None = None  # from the first record, if asked


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(eq=False)  # compared and hashed by identity: a set of those in flight
class Generation:
    r: redis.asyncio.Redis
    router: OutputRouter
    model: ModelInfo
    request: Prepared
    request_id: str
    metrics: Metrics
    gateway_id: str = ""  # whose liveness key the workers check (RequestRecord.gateway)
    deadline: float | None = None  # time.monotonic() past which it ends (GenerationError)
    keepalive_s: float | None = None  # deltas() yields [] after this long without a record
    # where each record goes (``gateway.routing``); None: pool 0 of this host
    pool_for: Callable[[RequestRecord], Awaitable[Placement]] | None = None
    arrival: float = field(default_factory=time.monotonic)
    prompts: list[_Prompt] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)  # each prompt's, once submitted
    _first_token: bool = False
    _closed: bool = False
    _inbox: asyncio.Queue[tuple[int, OutputRecord | Exception]] = field(
        default_factory=asyncio.Queue
    )

    def __post_init__(self) -> None:
        n = self.request.params.n
        single = len(self.request.prompts) == 1
        for i, ids in enumerate(self.request.prompts):
            req_id = self.request_id if single else f"{self.request_id}-{i}"
            self.prompts.append(_Prompt(req_id, ids, [_Sequence(i * n + k) for k in range(n)]))

    async def submit(self) -> None:
        """Subscribes to every prompt's output and queues it (concurrently: the router's XREAD
        takes the new streams in while the request travels to a worker)."""
        inbox = self._inbox
        for i, prompt in enumerate(self.prompts):
            sink = functools.partial(lambda i, item: inbox.put_nowait((i, item)), i)
            self.router.add(prompt.req_id, sink)
        records = [
            RequestRecord(
                prompt.req_id,
                prompt.token_ids,
                self.request.params,
                self.model.name,
                salt=self.request.salt,
                gateway=self.gateway_id,
                priority=self.request.priority,
            )
            for prompt in self.prompts
        ]
        if self.pool_for is not None:
            self.placements = [await self.pool_for(rec) for rec in records]
        else:
            self.placements = [Placement("", 0)] * len(records)
        streams = [placement.stream for placement in self.placements]
        submits = [
            queue_gateway.submit(self.r, rec, stream)
            for rec, stream in zip(records, streams, strict=True)
        ]
        _, entry_ids = await asyncio.gather(self.router.wake(), asyncio.gather(*submits))
        for prompt, stream, entry_id in zip(self.prompts, streams, entry_ids, strict=True):
            self.router.submitted(prompt.req_id, stream, entry_id)

    def cancel(self, error: APIError) -> None:
        """Ends ``deltas()`` with ``GenerationError(error)`` (the server is shutting down)."""
        self._inbox.put_nowait((-1, GenerationError(error)))

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """The text deltas until every sequence finished: those of every record already
        waiting together (a gateway that fell behind catches up in one write per request, not
        one per record); [] after each ``keepalive_s`` without any."""
        pending: list[Delta] = []
        try:
            async for i, record in self._records():
                if record is None:
                    yield []
                    continue
                pending += self._apply(self.prompts[i], record)
                if pending and not self._inbox.qsize():
                    yield pending
                    pending = []
            if pending:
                yield pending
        except GenerationError:
            if pending:  # what came before the error reaches the client first
                yield pending
            self.metrics.finished("error", self.usage().prompt_tokens, self.elapsed())
            raise
        self.metrics.finished(self.finish_reason(), self.usage().prompt_tokens, self.elapsed())

    def usage(self) -> Usage:
        return Usage(
            sum(len(p.token_ids) for p in self.prompts),
            sum(s.tokens for p in self.prompts for s in p.sequences),
            sum(p.cached_tokens for p in self.prompts),
        )

    def finish_reason(self) -> str:
        return self.prompts[0].sequences[0].finish_reason or "abort"

    def elapsed(self) -> float:
        return time.monotonic() - self.arrival

    async def close(self) -> None:
        """Aborts the prompts whose worker has not sent its final record. Safe to call from a
        cancelled task (the abort runs in a task of its own)."""
        if self._closed:
            return
        self._closed = True
        for prompt in self.prompts:
            self.router.unsubscribe(prompt.req_id)
        unfinished = [p.req_id for p in self.prompts if not p.final]
        if not unfinished:
            return
        task = asyncio.get_running_loop().create_task(self._abort(unfinished))
        _background.add(task)
        task.add_done_callback(_background.discard)
        await asyncio.shield(task)

    async def _abort(self, req_ids: list[str]) -> None:
        try:
            for req_id in req_ids:
                await queue_gateway.abort(self.r, req_id)
        except redis.asyncio.RedisError as err:  # its gateway's liveness ends it at worst
            log.warning("could not abort %s: %s", req_ids, err)

    async def _records(self) -> AsyncIterator[tuple[int, OutputRecord | None]]:
        """(prompt index, record) from every prompt's output stream (``submit`` subscribed),
        merged as they come, until each prompt's final record; (-1, None) after each
        ``keepalive_s`` without a record."""
        while not all(prompt.final for prompt in self.prompts):
            wait = self.keepalive_s
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise GenerationError(
                        APIError(504, "the request passed its deadline", code="request_timeout")
                    )
                wait = left if wait is None else min(wait, left)
            try:  # a timer only when there is nothing to take now (a task per record costs)
                inbox = self._inbox
                i, item = (
                    inbox.get_nowait()
                    if inbox.qsize()
                    else await asyncio.wait_for(inbox.get(), wait)
                )
            except TimeoutError:
                yield -1, None
                continue
            if isinstance(item, GenerationError):
                raise item
            if isinstance(item, Exception):
                message = f"reading the output failed: {item}"
                raise GenerationError(APIError(503, message, code="redis_unavailable")) from item
            yield i, item

    def _apply(self, prompt: _Prompt, record: OutputRecord) -> list[Delta]:
        prompt.cached_tokens = record.cached_tokens
        prompt.final = prompt.final or record.final
        if record.finish_reason == "error":
            raise GenerationError(_error_of(record))
        if record.prompt_logprobs is not None:
            prompt.prompt_logprobs = list(
                zip(prompt.token_ids, record.prompt_logprobs, strict=True)
            )
        deltas = []
        if 0 <= record.index < len(prompt.sequences):
            seq = prompt.sequences[record.index]
            if record.token_ids and record.offset < seq.tokens:  # had it before a restart
                return []
            score_only = self.request.score_only  # the drawn token is not the client's
            if record.token_ids and not score_only:
                self._observe(seq, len(record.token_ids))
            text, logprobs = ("" if score_only else record.text), None
            if record.logprobs is not None and not score_only:
                logprobs = list(zip(record.token_ids, record.logprobs, strict=True))
            first = None if seq.started else prompt.prompt_logprobs
            if seq.finish_reason is None and (text or record.finish_reason or logprobs or first):
                seq.finish_reason, seq.started = record.finish_reason, True
                deltas.append(Delta(seq.index, text, record.finish_reason, logprobs, first))
        if record.final:
            deltas += self._end_all(prompt, record)
        return deltas

    @staticmethod
    def _end_all(prompt: _Prompt, record: OutputRecord) -> list[Delta]:
        """A final record (an abort of the whole request) ends every sequence still going."""
        deltas = []
        for seq in prompt.sequences:
            if seq.finish_reason is None:
                seq.finish_reason = record.finish_reason or "abort"
                deltas.append(Delta(seq.index, "", seq.finish_reason))
        return deltas

    def _observe(self, seq: _Sequence, tokens: int) -> None:
        now = time.monotonic()
        if not self._first_token:
            self._first_token = True
            self.metrics.ttft.observe(now - self.arrival)
        elif seq.last_at is not None:
            self.metrics.itl.observe(now - seq.last_at)
        seq.last_at = now
        seq.tokens += tokens
        self.metrics.generation_tokens.inc(tokens)
