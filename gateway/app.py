"""The gateway's aiohttp app (``create_app``) and server (``run``: ``pagedserve gateway``).

Routes: the OpenAI API (``gateway.openai_api``), ``GET /v1/models[/{id}]``, ``GET /health``,
``GET /metrics``, the admin API (``gateway.admin``) and its web page (``gateway.admin_page``).
``/v1/*`` needs the API key when one is set (``--api-key`` or ``PAGEDSERVE_API_KEY``). Requests
go to Redis (``contracts.queue_gateway``), the kvstore is asked only for health, capacity,
metrics and the admin API. The server runs with aiohttp's handler cancellation on, so a client
that disconnects cancels its handler, which aborts its request (``Generation.close``). On
SIGINT/SIGTERM it closes its listening socket, answers new requests on open connections with 503,
lets requests in flight finish for exactly ``--shutdown-timeout-s``, then cuts the rest (error
event and [DONE], or 503) and exits.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import os
import signal

import redis
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from contracts import options
from contracts.heap import tune_gc_for_serving
from gateway import admin, admin_page, openai_api
from gateway.config import ADMIN_TOKEN_ENV, GatewayConfig
from gateway.errors import APIError, Handler, error_middleware
from gateway.kvclient import KVStoreError, KVStoreTimeout
from gateway.metrics import Metrics, Snapshot
from gateway.model_info import ModelInfo
from gateway.state import STATE, AppState
from kvstore import protocol as p

log = logging.getLogger("pagedserve.gateway")
HEALTH_TIMEOUT_S = 1.0


def create_app(
    config: GatewayConfig, model: ModelInfo, admin_token: str | None, api_key: str | None = None
) -> web.Application:
    """The app; Redis and kvstore clients are opened when it starts (its cleanup context)."""
    middlewares = [error_middleware, api_key_middleware]
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    state = AppState(config, model, admin_token or None, Metrics(model.name), api_key or None)
    app[STATE] = state
    app.cleanup_ctx.append(state.connections)
    app.add_routes(
        [
            *openai_api.routes(),
            web.get("/v1/models", models),
            web.get("/v1/models/{model}", model_info),
            web.get("/health", health),
            web.get("/metrics", metrics),
            *admin.routes(),
            *admin_page.routes(),
        ]
    )
    return app


@web.middleware
async def api_key_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """``/v1/*`` needs ``Authorization: Bearer <key>`` when the gateway has an API key."""
    key = request.app[STATE].api_key
    if key is not None and request.path.startswith("/v1/"):
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme != "Bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                type="invalid_request_error",
            )
    return await handler(request)


def _model_card(state: AppState) -> dict[str, object]:
    """The served model, by its name only: never its filesystem path."""
    return {
        "id": state.model.name,
        "object": "model",
        "created": state.model.created,
        "owned_by": "pagedserve",
        "root": state.model.name,
        "max_model_len": state.model.context_len,
        "chat_template": state.model.chat_template,
        "unsupported": state.model.unsupported,  # what requests cannot ask of it, and why
    }


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    openai_api.check_model(state, name)
    return web.json_response(_model_card(state))


async def health(request: web.Request) -> web.Response:
    """200 ("ok") when Redis and the kvstore answer and a worker was heard from within
    ``--worker-idle-s``; else 503: "degraded" saying what is down (components reconnect by
    themselves; requests wait), or "draining" while the gateway shuts down."""
    state = request.app[STATE]
    if state.draining:
        body = {"status": "draining", "in_flight": state.num_in_flight}
        return web.json_response(body, status=503)
    down: list[str] = []
    body = {}
    try:
        await state.kv.call(p.Ping(), timeout_s=HEALTH_TIMEOUT_S)
        stats = await state.kv.call(p.GetStats(0), timeout_s=HEALTH_TIMEOUT_S)
        assert isinstance(stats, p.Stats)
        alive = [w.worker_id for w in stats.workers if w.idle_s <= state.config.worker_idle_s]
        body["kvstore"] = "up"
        body["workers"] = {"alive": len(alive), "registered": len(stats.workers)}
        if not alive:
            down.append(
                f"workers: none alive ({len(stats.workers)} registered, none heard from in "
                f"{state.config.worker_idle_s} s)"
            )
    except (KVStoreTimeout, KVStoreError) as err:
        body["kvstore"] = "down"
        down.append(f"kvstore at {state.config.kvstore}: {err}")
    try:
        await state.redis.ping()
        body["redis"] = "up"
    except redis.RedisError as err:
        body["redis"] = "down"
        down.append(f"redis: {err}")
    body = {"status": "degraded" if down else "ok", **body, "down": down}
    if state.model.unsupported:
        body["unsupported"] = state.model.unsupported
    return web.json_response(body, status=503 if down else 200)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = None
    try:
        stats = await state.kv.stats(0)
    except (KVStoreTimeout, KVStoreError) as err:
        log.warning("metrics without the kvstore's part: %s", err)
    try:
        queued = await state.queue_length(fresh=True)
    except redis.RedisError as err:
        raise APIError(503, f"redis: {err}", code="redis_unavailable") from err
    body = state.metrics.render(Snapshot(stats, queued))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def run(config: GatewayConfig) -> None:
    """``pagedserve gateway``: loads the tokenizer and serves until SIGINT/SIGTERM."""
    options.configure_logging(config.log_level)
    admin_token = os.environ.get(ADMIN_TOKEN_ENV) or None
    if admin_token is None:
        log.warning("%s is not set: the admin API is disabled (403)", ADMIN_TOKEN_ENV)
    api_key = config.resolved_api_key(dict(os.environ))
    log.info("/v1 API key: %s", "required" if api_key else "none (anyone may send requests)")
    model = ModelInfo.load(config)
    log.info(
        "model %s (%s): context %d tokens, chat template: %s",
        model.name,
        config.model,
        model.context_len,
        "the tokenizer's" if getattr(model.tokenizer, "chat_template", None) else "plain",
    )
    app = create_app(config, model, admin_token, api_key)
    tune_gc_for_serving()
    try:
        asyncio.run(serve(app, config))
    except PortInUse as err:
        raise SystemExit(f"pagedserve gateway: {err}") from None


class PortInUse(Exception):
    """The gateway's address is taken."""


async def serve(app: web.Application, config: GatewayConfig) -> None:
    """Serves until SIGINT/SIGTERM, then drains: the listening socket closes, requests in flight
    get ``--shutdown-timeout-s`` (once, exactly), the rest are cut with an error."""
    # aiohttp's keep-alive timer runs from a connection's opening and from the end of each
    # response until a request's headers are complete: a header-read deadline
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=1.0,
        keepalive_timeout=config.header_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(
        runner, config.host, config.port, backlog=2048, reuse_port=config.reuse_port or None
    )
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        if err.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {config.port} on {config.host} is in use; pass --port") from None
        raise
    log.info(
        "gateway listening on http://%s:%d%s (pid %d)",
        config.host,
        config.port,
        " with SO_REUSEPORT" if config.reuse_port else "",
        os.getpid(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    state = app[STATE]
    log.info(
        "stopping: no new requests; %d in flight get %.0f s to finish",
        state.num_in_flight,
        config.shutdown_timeout_s,
    )
    await site.stop()
    cut = await state.drain(config.shutdown_timeout_s)
    if cut:
        log.warning("cut %d requests still in flight after %.0f s", cut, config.shutdown_timeout_s)
    await runner.cleanup()
    log.info("gateway stopped")
