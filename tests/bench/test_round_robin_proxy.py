"""``bench/round_robin_proxy.py`` (the multi-GPU baseline's proxy) in front of two real aiohttp
servers started here: requests take the upstreams in turn, ``GET /v1/models`` the first; a POST
body arrives intact; an SSE response reaches the client event by event, before the upstream has
finished; an upstream that is down answers 502 naming it. And the script as a user runs it:
its start line, a request through it, Ctrl-C."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from bench.round_robin_proxy import make_app
from tests.conftest import ROOT

Test = Callable[[str, list[str], asyncio.Event], Awaitable[None]]


def upstream(name: str, release: asyncio.Event) -> web.Application:
    """A server answering who it is: ``/v1/models``, ``/echo`` (the body's length and digest and
    a header), ``/v1/completions`` (SSE: one event, then the next once ``release`` is set)."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": name}]})

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        digest = hashlib.sha256(body).hexdigest()
        seen = {"name": name, "length": len(body), "sha256": digest, "path": request.path_qs}
        return web.json_response({**seen, "x_test": request.headers.get("X-Test")})

    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f'data: {{"from": "{name}", "n": 1}}\n\n'.encode())
        await asyncio.wait_for(release.wait(), 10)
        await response.write(f'data: {{"from": "{name}", "n": 2}}\n\ndata: [DONE]\n\n'.encode())
        await response.write_eof()
        return response

    app = web.Application(client_max_size=1 << 26)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/echo", echo)
    app.router.add_post("/v1/completions", completions)
    return app


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free port of 127.0.0.1; its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(test: Test, down: bool = False) -> None:
    """``test(proxy URL, upstream names, release)`` against the proxy in front of ``a`` and
    ``b`` (and, with ``down``, a third upstream where nothing listens)."""

    async def main() -> None:
        release = asyncio.Event()
        async with serving(upstream("a", release)) as a, serving(upstream("b", release)) as b:
            upstreams = [a, b] + ([f"http://127.0.0.1:{closed_port()}"] if down else [])
            async with serving(make_app(upstreams, connect_timeout_s=5)) as proxy:
                await asyncio.wait_for(test(proxy, upstreams, release), 30)

    asyncio.run(main())


def test_requests_take_the_upstreams_in_turn_and_bodies_arrive_intact() -> None:
    async def test(proxy: str, upstreams: list[str], release: asyncio.Event) -> None:
        body = os.urandom(3 << 20) + b"\x00\r\n\r\n"
        async with aiohttp.ClientSession() as session:
            seen = []
            for i in range(5):
                async with session.post(
                    f"{proxy}/echo?i={i}", data=body, headers={"X-Test": str(i)}
                ) as response:
                    assert response.status == 200
                    seen.append(await response.json())
                async with session.get(f"{proxy}/v1/models") as response:
                    assert (await response.json())["data"][0]["id"] == "a"  # always the first
        assert [s["name"] for s in seen] == ["a", "b", "a", "b", "a"]
        assert all(s["length"] == len(body) for s in seen)
        assert {s["sha256"] for s in seen} == {hashlib.sha256(body).hexdigest()}
        assert [s["path"] for s in seen] == [f"/echo?i={i}" for i in range(5)]
        assert [s["x_test"] for s in seen] == [str(i) for i in range(5)]

    run(test)


def test_a_streamed_response_reaches_the_client_as_it_arrives() -> None:
    """The upstream sends its second event only once the client has read the first through the
    proxy: a proxy that buffered the response would never deliver it (the test's limit)."""

    async def test(proxy: str, upstreams: list[str], release: asyncio.Event) -> None:
        body = {"model": "m", "prompt": "hi", "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{proxy}/v1/completions", json=body) as response,
        ):
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(response.content.readline(), 5)
            assert first == b'data: {"from": "a", "n": 1}\n'
            release.set()
            rest = await asyncio.wait_for(response.content.read(), 5)
        assert rest == b'\ndata: {"from": "a", "n": 2}\n\ndata: [DONE]\n\n'

    run(test)


def test_an_upstream_that_is_down_gives_a_502_naming_it() -> None:
    async def test(proxy: str, upstreams: list[str], release: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            statuses, errors = [], []
            for _ in range(4):
                async with session.post(f"{proxy}/echo", data=b"x") as response:
                    statuses.append(response.status)
                    if response.status != 200:
                        errors.append((await response.json())["error"])
        assert statuses == [200, 200, 502, 200]  # a, b, the down one, a again
        assert errors[0]["code"] == 502
        assert f"upstream {upstreams[2]} failed" in errors[0]["message"]
        assert "round-robin proxy" in errors[0]["message"]

    run(test, down=True)


def test_the_script_starts_naming_its_upstreams_serves_and_stops_on_ctrl_c() -> None:
    script = str(ROOT / "bench" / "round_robin_proxy.py")
    helped = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    for option in ("--host", "--port", "--upstream", "--connect-timeout-s", "--log-level"):
        assert option in helped.stdout
    missing = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert missing.returncode == 2 and "--upstream" in missing.stderr

    async def main() -> None:
        release = asyncio.Event()
        async with serving(upstream("a", release)) as a, serving(upstream("b", release)) as b:
            port = closed_port()
            command = [sys.executable, script, "--port", str(port), "--upstream", a]
            proxy = await asyncio.create_subprocess_exec(
                *command, "--upstream", b, stderr=subprocess.PIPE, cwd=ROOT
            )
            assert proxy.stderr is not None
            line = await asyncio.wait_for(proxy.stderr.readline(), 30)
            assert f"round-robin over 2 upstreams: {a}, {b}" in line.decode()
            async with aiohttp.ClientSession() as session:
                names = []
                for _ in range(2):
                    async with session.post(f"http://127.0.0.1:{port}/echo", data=b"x") as r:
                        names.append((await r.json())["name"])
            assert names == ["a", "b"]
            proxy.send_signal(signal.SIGINT)
            started = time.monotonic()
            rest = await asyncio.wait_for(proxy.stderr.read(), 10)
            assert await proxy.wait() == 0 and time.monotonic() - started < 10
            assert b"Traceback" not in rest

    asyncio.run(main())
