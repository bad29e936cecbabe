"""``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE) and not.

A stream is ``data: {json}\\n\\n`` events, one choice per event, ending with ``data: [DONE]``.
Chat streams open with one ``{"role": "assistant", "content": ""}`` delta per choice; each
choice's last event carries its ``finish_reason``. With ``stream_options.include_usage`` every
chunk has ``"usage": null`` and a last chunk with no choices carries the usage. A stream with
nothing to send for ``--sse-keepalive-s`` gets an SSE comment (``: keep-alive``). A request that
cannot finish (a worker failure, Redis gone too long, its ``--request-timeout-s`` deadline, the
server shutting down) ends a started stream with ``data: {"error": {...}}`` and ``[DONE]``, and a
non-streaming request with that error's status (500, 503, 504).
``usage.prompt_tokens_details.cached_tokens`` (the prefix-cache hit) is on every response that
has a usage.

Parsing and tokenizing run in the app's thread pool, never on the event loop: one huge prompt
does not stall every other stream (and a prompt longer in characters than the context could
hold in tokens is refused before it is tokenized).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import msgspec
import redis
from aiohttp import web

from gateway.errors import APIError
from gateway.generation import Delta, Generation, GenerationError
from gateway.logprobs import (
    Decode,
    Logprob,
    PromptLogprob,
    chat_logprobs,
    completion_logprobs,
)
from gateway.prepare import Prepared, prepare_chat, prepare_completion
from gateway.schemas import ChatRequest, CompletionRequest, decode_body
from gateway.state import STATE, AppState

log = logging.getLogger("pagedserve.gateway")

_encode = msgspec.json.Encoder().encode
POOL_HEADER = "X-PagedServe-Pool"
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see bytes
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer the stream
}


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/completions", completions), web.post("/v1/chat/completions", chat)]


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _body(request, state)
    prepared = await state.off_loop(_prepare_completion, state, body)
    return await _serve(request, state, prepared, _Format(False, _token_text(state, prepared)))


async def chat(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _body(request, state)
    prepared = await state.off_loop(_prepare_chat, state, body)
    return await _serve(request, state, prepared, _Format(True, _token_text(state, prepared)))


def _token_text(state: AppState, prepared: Prepared) -> Decode:
    """How a logprob names its token: its text, or ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``: a token that is part of a UTF-8 character has no text)."""
    if prepared.tokens_as_ids:
        return lambda ids: "".join(f"token_id:{t}" for t in ids)
    return state.model.decode


def _prepare_completion(state: AppState, body: bytes) -> Prepared:
    req = decode_body(body, CompletionRequest)
    check_model(state, req.model)
    return prepare_completion(req, state.model, state.config.max_n, state.kv_capacity)


def _prepare_chat(state: AppState, body: bytes) -> Prepared:
    req = decode_body(body, ChatRequest)
    check_model(state, req.model)
    return prepare_chat(req, state.model, state.config.max_n, state.kv_capacity)


async def _body(request: web.Request, state: AppState) -> bytes:
    limit = state.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise APIError(
            413,
            f"request body of {request.content_length} bytes exceeds the limit of {limit}",
            code="request_too_large",
        )
    return await request.read()  # HTTPRequestEntityTooLarge (413) past client_max_size


def check_model(state: AppState, model: str | None) -> None:
    """404 unless ``model`` is the served model (its name or its --model); None is fine."""
    if model is not None and model not in (state.model.name, state.config.model):
        raise APIError(404, f"the model `{model}` does not exist", "model", "model_not_found")


async def _serve(
    request: web.Request, state: AppState, prepared: Prepared, fmt: _Format
) -> web.StreamResponse:
    if state.draining:
        raise APIError(503, "the server is shutting down", code="server_shutdown")
    try:
        queued = await state.queue_length()
    except redis.RedisError as err:
        raise APIError(503, f"cannot queue the request: {err}", code="redis_unavailable") from err
    if queued >= state.config.max_queued:
        raise APIError(503, f"server busy: {queued} requests queued", code="overloaded")
    config = state.config
    keepalive_s = config.sse_keepalive_s if prepared.stream and config.sse_keepalive_s else None
    timeout_s = config.request_timeout_s
    gen = Generation(
        state.redis,
        state.router,
        state.model,
        prepared,
        f"{fmt.prefix}-{uuid.uuid4().hex}",
        state.metrics,
        gateway_id=state.gateway_id,
        deadline=time.monotonic() + timeout_s if timeout_s else None,
        keepalive_s=keepalive_s,
        pool_for=state.routes.pool_for,
    )
    try:
        with state.in_flight(gen):
            try:
                await gen.submit()
            except redis.RedisError as err:
                message = f"cannot queue the request: {err}"
                raise APIError(503, message, code="redis_unavailable") from err
            if prepared.stream:
                return await _stream(request, gen, fmt)
            return await _complete(gen, fmt)
    finally:
        await gen.close()


async def _complete(gen: Generation, fmt: _Format) -> web.Response:
    n = len(gen.request.prompts) * gen.request.params.n
    texts: list[list[str]] = [[] for _ in range(n)]
    if gen.request.echo_texts is not None:
        for i in range(n):
            texts[i].append(gen.request.echo_texts[i // gen.request.params.n])
    finish: list[str | None] = [None] * n
    logprobs: list[list[PromptLogprob]] = [[] for _ in range(n)]
    try:
        async for deltas in gen.deltas():
            for delta in deltas:
                texts[delta.index].append(delta.text)
                finish[delta.index] = delta.finish_reason or finish[delta.index]
                logprobs[delta.index] += [*(delta.prompt_logprobs or []), *(delta.logprobs or [])]
    except GenerationError as err:
        raise err.error from err
    choices = [fmt.choice(i, "".join(texts[i]), finish[i]) for i in range(n)]
    if gen.request.params.logprobs is not None:
        for i, choice in enumerate(choices):
            choice["logprobs"] = fmt.logprobs(i, logprobs[i])
    body = fmt.envelope(gen.request_id, gen.model.name, choices, stream=False)
    body["usage"] = gen.usage().as_dict()
    return web.Response(
        body=_encode(body), content_type="application/json", headers=_pool_header(gen)
    )


def _pool_header(gen: Generation) -> dict[str, str]:
    """Which pool (GPU) serves each prompt (``node:pool`` on another host): for operators and
    benchmarks."""
    return {POOL_HEADER: ",".join(str(placement) for placement in gen.placements)}


async def _stream(request: web.Request, gen: Generation, fmt: _Format) -> web.StreamResponse:
    response = web.StreamResponse(headers={**SSE_HEADERS, **_pool_header(gen)})
    await response.prepare(request)
    include_usage = gen.request.include_usage
    created = int(time.time())

    def event(choices: list[dict[str, Any]]) -> bytes:
        body = fmt.envelope(gen.request_id, gen.model.name, choices, True, created)
        if include_usage:
            body["usage"] = None
        return b"data: " + _encode(body) + b"\n\n"

    n = len(gen.request.prompts) * gen.request.params.n
    opening = [fmt.opening(i, gen.request) for i in range(n)]
    try:
        await response.write(b"".join(event([c]) for c in opening if c is not None))
        try:
            async for deltas in gen.deltas():
                if not deltas:
                    await response.write(KEEPALIVE)
                    continue
                chunks = [fmt.chunk(d, _echo(gen.request, d)) for d in deltas]
                await response.write(b"".join(event([c]) for c in chunks))
        except GenerationError as err:
            await response.write(b"data: " + _encode(err.error.body()) + b"\n\n")
        if include_usage:
            body = fmt.envelope(gen.request_id, gen.model.name, [], True, created)
            body["usage"] = gen.usage().as_dict()
            await response.write(b"data: " + _encode(body) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left: the caller's ``gen.close()`` aborts it
        log.info("request %s: the client closed the stream; aborting it", gen.request_id)
    return response


def _echo(request: Prepared, delta: Delta) -> str:
    """The prompt text a streamed completion choice's first delta carries when it carries the
    prompt's logprobs (else the choice's opening chunk carried it)."""
    if delta.prompt_logprobs is None or request.echo_texts is None:
        return ""
    return request.echo_texts[delta.index // request.params.n]


class _Format:
    """The shapes of one endpoint's responses."""

    def __init__(self, chat: bool, decode: Decode) -> None:
        self.chat = chat
        self.prefix = "chatcmpl" if chat else "cmpl"
        self.decode = decode  # one token's text, for logprobs
        self._offsets: dict[int, int] = {}  # completions: each choice's text so far, in chars

    def logprobs(self, index: int, entries: list[PromptLogprob]) -> dict[str, Any]:
        """Choice ``index``'s logprobs object for these tokens (the next ones of its text)."""
        if self.chat:
            return chat_logprobs(_sampled(entries), self.decode)
        body, self._offsets[index] = completion_logprobs(
            entries, self.decode, self._offsets.get(index, 0)
        )
        return body

    def envelope(
        self,
        request_id: str,
        model: str,
        choices: list[dict[str, Any]],
        stream: bool,
        created: int | None = None,
    ) -> dict[str, Any]:
        obj = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if stream and self.chat else ""
        )
        return {
            "id": request_id,
            "object": obj,
            "created": created or int(time.time()),
            "model": model,
            "choices": choices,
        }

    def choice(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def chunk(self, delta: Delta, echo: str = "") -> dict[str, Any]:
        """A streamed delta's choice; ``echo``: prompt text to put before its text."""
        logprobs = None
        if delta.logprobs is not None or delta.prompt_logprobs is not None:
            entries = [*(delta.prompt_logprobs or []), *(delta.logprobs or [])]
            logprobs = self.logprobs(delta.index, entries)
        if not self.chat:
            return self.choice(delta.index, echo + delta.text, delta.finish_reason) | {
                "logprobs": logprobs
            }
        content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
        return {
            "index": delta.index,
            "delta": content,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }

    def opening(self, index: int, request: Prepared) -> dict[str, Any] | None:
        """The chunk a choice's stream starts with: the role (chat), the echoed prompt."""
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        if request.echo_texts is not None and request.params.prompt_logprobs is None:
            text = request.echo_texts[index // request.params.n]
            return self.choice(index, text, None)
        return None  # with the prompt's logprobs, the echo comes with them (``_echo``)


def _sampled(entries: list[PromptLogprob]) -> list[Logprob]:
    """Chat entries: sampled tokens only, each with its logprobs."""
    return [(token, entry) for token, entry in entries if entry is not None]
