"""The admin web page at ``/admin/`` and the JSON routes it polls (once a second).

The page is plain HTML, CSS and JavaScript checked in under ``gateway/static/admin/`` (no build
step, nothing fetched from elsewhere). Its files are served without authentication: they
hold no data, only a login form. The token typed there stays in the tab's ``sessionStorage`` and
goes out as ``Authorization: Bearer`` on each of the page's requests, never in a URL. The data
routes need that header, as the rest of the admin API (``gateway.admin``):

* ``GET /admin/overview``: ``/admin/cache`` (``?top=N``, default 20), ``/admin/requests`` and
  ``/admin/cost-model`` in one body, from one ``GetStats`` call (each worker's row carries the
  last running totals its engine sent, ``timeline``, which the page turns into its step
  timeline, ``static/admin/steptimeline.js``);
* ``GET /admin/blocks``: the block map of both tiers, one byte per block (an index into
  ``states``), base64 in JSON, with the counts per state; ``?pool=N``: of the host's pool N
  (GPU N; default 0), which the page's pool select (``static/admin/poolchoice.js``) picks;
* ``GET /admin/blocks/{tier}/{block}``: one block (``gpu`` or ``cpu``, ``?pool=N``): its state,
  the requests that hold it, the prefix it caches (key, tokens, hits), its copy in the other
  tier.
"""

from __future__ import annotations

import base64
import functools
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway import admin
from gateway.errors import APIError
from gateway.kvclient import KVStoreError, KVStoreTimeout
from kvstore import protocol as p

STATIC = Path(__file__).resolve().parent / "static" / "admin"
ASSETS = {  # route file -> content type
    "index.html": "text/html",
    "admin.js": "text/javascript",
    "blockmap.js": "text/javascript",
    "steptimeline.js": "text/javascript",
    "poolchoice.js": "text/javascript",
    "admin.css": "text/css",
}
DEFAULT_TOP = 20
# The page runs only its own script and style and talks only to this origin.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def routes() -> list[web.RouteDef]:
    return [
        web.get("/admin", redirect),
        web.get("/admin/", page),
        web.get("/admin/admin.js", asset),
        web.get("/admin/blockmap.js", asset),
        web.get("/admin/steptimeline.js", asset),
        web.get("/admin/poolchoice.js", asset),
        web.get("/admin/admin.css", asset),
        web.get("/admin/overview", overview),
        web.get("/admin/blocks", blocks),
        web.get("/admin/blocks/{tier}/{block}", block_info),
    ]


@functools.cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def _asset(name: str) -> web.Response:
    return web.Response(body=_read(name), content_type=ASSETS[name], headers=HEADERS)


async def redirect(request: web.Request) -> web.Response:
    raise web.HTTPFound("/admin/")


async def page(request: web.Request) -> web.Response:
    return _asset("index.html")


async def asset(request: web.Request) -> web.Response:
    return _asset(request.path.rsplit("/", 1)[1])


def _json(body: dict[str, Any]) -> web.Response:
    response = admin.json_response(body)
    response.headers["Cache-Control"] = "no-store"
    return response


async def overview(request: web.Request) -> web.Response:
    state = admin.authorized(request)
    try:
        top = int(request.query.get("top", str(DEFAULT_TOP)))
    except ValueError as err:
        raise APIError(400, "top must be an integer", param="top") from err
    stats = await admin.kv_stats(state, max(0, min(top, admin.MAX_TOP)))
    queued = await state.queue_length(fresh=True)
    return _json(
        {
            "cache": admin.cache_body(stats),
            "requests": admin.requests_body(stats, queued),
            "cost_model": admin.cost_model_body(stats),
        }
    )


def tier_map(states: bytes) -> dict[str, Any]:
    """One pool's map as JSON: its size, the blocks in each state, the bytes in base64."""
    return {
        "blocks": len(states),
        "counts": {name: states.count(i) for i, name in enumerate(p.BLOCK_STATES)},
        "map": base64.b64encode(states).decode("ascii"),
    }


def pool_of(request: web.Request) -> int:
    """The ``?pool=N`` of a block request (default 0: the first GPU's pool)."""
    try:
        pool = int(request.query.get("pool", "0"))
    except ValueError as err:
        raise APIError(400, "pool must be an integer", param="pool") from err
    if pool < 0:
        raise APIError(404, f"no pool {pool}", param="pool", code="not_found")
    return pool


async def blocks(request: web.Request) -> web.Response:
    state = admin.authorized(request)
    pool = pool_of(request)
    try:
        reply = await state.kv.call(p.GetBlockMap(pool))
    except KVStoreError as err:
        if err.code == "bad_message":  # a pool the host does not have
            raise APIError(404, str(err), param="pool", code="not_found") from err
        raise _unavailable(err) from err
    except KVStoreTimeout as err:
        raise _unavailable(err) from err
    body = {"states": list(p.BLOCK_STATES), "gpu": tier_map(reply.gpu), "cpu": tier_map(reply.cpu)}
    return _json({"pool": pool, **body})


async def block_info(request: web.Request) -> web.Response:
    state = admin.authorized(request)
    tier = request.match_info["tier"]
    if tier not in ("gpu", "cpu"):
        raise APIError(404, f"no tier {tier!r}: gpu or cpu", param="tier", code="not_found")
    try:
        block = int(request.match_info["block"])
    except ValueError as err:
        raise APIError(400, "block must be an integer", param="block") from err
    if block < 0:
        raise _no_block(tier, block)
    pool = pool_of(request)
    try:
        reply = await state.kv.call(p.GetBlockInfo("gpu" if tier == "gpu" else "cpu", block, pool))
    except KVStoreError as err:
        if err.code == "bad_message":  # the kvstore's answer to a block past the pool's end
            raise _no_block(tier, block) from err
        raise _unavailable(err) from err
    except KVStoreTimeout as err:
        raise _unavailable(err) from err
    return _json(admin.as_dict(reply))


def _no_block(tier: str, block: int) -> APIError:
    return APIError(404, f"no {tier} block {block}", param="block", code="not_found")


def _unavailable(err: Exception) -> APIError:
    return APIError(503, f"the kvstore did not answer: {err}", code="kvstore_unavailable")
