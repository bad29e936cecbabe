"""The multi-GPU baseline as users build it today: N independent one-GPU servers (e.g. N
``pagedserve up`` stacks) behind a round-robin HTTP proxy, which knows nothing of their prefix
caches. ``pagedserve bench --base-url`` pointed at this proxy measures that setup.

Every request (any method and path, its body and headers) goes to the next upstream in turn;
``GET /v1/models`` always goes to the first one (and does not advance the turn), so every client
sees the same model list. Responses stream back chunk by chunk as they arrive (SSE included), not
buffered; a client that goes away closes its upstream connection, so the upstream can abort the
request. An upstream that cannot be reached answers 502 with an OpenAI-style error naming it.

    python bench/round_robin_proxy.py --port 8000 \\
        --upstream http://127.0.0.1:8001 --upstream http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import signal
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

log = logging.getLogger("round_robin_proxy")

# hop-by-hop headers (RFC 9110 7.6.1) and those aiohttp sets itself from the body it sends
_HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)


def _forwardable(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    """``headers`` less the hop-by-hop ones and those named in ``Connection``."""
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",")}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP_BY_HOP | named)


class RoundRobin:
    """The next upstream for each request; ``GET /v1/models``: the first."""

    def __init__(self, upstreams: Sequence[str]) -> None:
        if not upstreams:
            raise ValueError("round-robin proxy: no upstreams (--upstream URL, repeatable)")
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self._turn = itertools.cycle(self.upstreams)

    def pick(self, method: str, path: str) -> str:
        if method == "GET" and path.rstrip("/") == "/v1/models":
            return self.upstreams[0]
        return next(self._turn)


ROUND_ROBIN: web.AppKey[RoundRobin] = web.AppKey("round_robin", RoundRobin)
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


def _bad_gateway(upstream: str, err: BaseException) -> web.Response:
    message = f"round-robin proxy: upstream {upstream} failed: {type(err).__name__}: {err}"
    log.warning("%s", message)
    error = {"message": message, "type": "bad_gateway", "param": None, "code": 502}
    return web.json_response({"error": error}, status=502)


async def forward(request: web.Request) -> web.StreamResponse:
    """Sends ``request`` to the next upstream and streams its response back as it arrives."""
    upstream = request.app[ROUND_ROBIN].pick(request.method, request.path)
    url = URL(upstream + request.raw_path, encoded=True)
    body = await request.read()
    session = request.app[SESSION]
    try:
        async with session.request(
            request.method,
            url,
            headers=_forwardable(request.headers),
            data=body or None,
            allow_redirects=False,
        ) as answer:
            response = web.StreamResponse(status=answer.status, reason=answer.reason)
            response.headers.extend(_forwardable(answer.headers))
            if answer.content_length is not None:  # else chunked, as the upstream streams
                response.content_length = answer.content_length
            await response.prepare(request)
            try:
                async for chunk in answer.content.iter_any():  # as it arrives, unbuffered
                    try:
                        await response.write(chunk)
                    except ConnectionResetError:  # the client went away: closing aborts upstream
                        return response
            except (aiohttp.ClientError, TimeoutError) as err:  # the upstream broke off
                log.warning("upstream %s broke off %s: %s", upstream, request.path, err)
                return response  # the status is sent; the client sees a short body
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            return response
    except (aiohttp.ClientError, TimeoutError) as err:
        return _bad_gateway(upstream, err)


def make_app(upstreams: Sequence[str], connect_timeout_s: float = 10.0) -> web.Application:
    """The proxy over ``upstreams`` (base URLs, e.g. ``http://127.0.0.1:8001``), no time limit
    on a response but ``connect_timeout_s`` to connect."""
    app = web.Application(client_max_size=1 << 30)
    app[ROUND_ROBIN] = RoundRobin(upstreams)

    async def session(app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=0)  # a benchmark's concurrency, not a pool's
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False
        ) as client:
            app[SESSION] = client
            yield

    app.cleanup_ctx.append(session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def serve(app: web.Application, host: str, port: int) -> None:
    """Serves ``app`` until SIGINT or SIGTERM, then closes its connections."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)  # no line a request
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info(
            "listening on http://%s:%d, round-robin over %d upstreams: %s",
            host,
            port,
            len(app[ROUND_ROBIN].upstreams),
            ", ".join(app[ROUND_ROBIN].upstreams),
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument(
        "--upstream",
        action="append",
        required=True,
        metavar="URL",
        help="an upstream server's base URL, without /v1 (e.g. http://127.0.0.1:8001); "
        "repeat it for each, in the order the turns take them",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=10.0,
        help="limit on connecting to an upstream (then 502); a response itself has none",
    )
    p.add_argument("--log-level", default="INFO", help="logging level")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = make_app(args.upstream, args.connect_timeout_s)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(app, args.host, args.port))


if __name__ == "__main__":
    main()
