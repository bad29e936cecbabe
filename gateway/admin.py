"""The admin API, under ``/admin/``, behind its own bearer token (``PAGEDSERVE_ADMIN_TOKEN``).

``Authorization: Bearer <token>`` is required on every route (401 without it or with a wrong
one); when the gateway was started without a token the admin API is disabled (403). Everything
is read from the kvstore (``GetStats``) at the time of the call:

* ``GET /admin/cache``: blocks free / in use / cached (free but still holding a prefix) /
  swapped (in the CPU tier), prefix-cache lookups, queried and hit tokens, hit rate, miss reasons
  (why each lookup stopped), the CPU prefix tier (``cpu_tier``: on or off, demoted blocks, the
  hit tokens loaded back from it, its demote/drop/load/recompute counts), the top shared
  prefixes (``?top=N``, default 10) with their hit counts, length in tokens and tier;
* ``GET /admin/requests``: live requests (one row per sequence) with their blocks, cached tokens
  and preemptions, the workers, and how many requests the Redis stream holds;
* ``GET /admin/cost-model``: the swap calibration, the workers' measured prefill times (the
  recompute side), the recent swap/recompute decisions with predicted and actual cost, counts;
* ``POST /admin/cache/reset``: drops every cached prefix (blocks in use keep their contents).

The web page at ``/admin/`` and its routes (the block map, one block) are ``gateway.admin_page``.
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
from aiohttp import web

from gateway.errors import APIError
from gateway.kvclient import KVStoreError, KVStoreTimeout
from gateway.state import STATE, AppState
from kvstore import protocol as p

MAX_TOP = 1000


def routes() -> list[web.RouteDef]:
    return [
        web.get("/admin/cache", cache),
        web.get("/admin/requests", requests),
        web.get("/admin/cost-model", cost_model),
        web.post("/admin/cache/reset", reset_cache),
    ]


def authorized(request: web.Request) -> AppState:
    state = request.app[STATE]
    if not state.admin_token:
        raise APIError(
            403,
            "the admin API is disabled: start the gateway with PAGEDSERVE_ADMIN_TOKEN set",
            code="admin_disabled",
        )
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), state.admin_token.encode()
    ):
        raise APIError(401, "admin API: missing or wrong bearer token", code="invalid_token")
    return state


async def kv_stats(state: AppState, top: int = 10) -> p.Stats:
    try:
        return await state.kv.stats(top)
    except (KVStoreTimeout, KVStoreError) as err:
        raise APIError(
            503, f"the kvstore did not answer: {err}", code="kvstore_unavailable"
        ) from err


def as_dict(item: Any) -> dict[str, Any]:
    """A protocol struct as a JSON object (the wire form is an array), nested ones too."""
    return {
        name: as_dict(value) if isinstance(value, msgspec.Struct) else value
        for name in item.__struct_fields__
        for value in (getattr(item, name),)
    }


def json_response(body: dict[str, Any]) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def cache(request: web.Request) -> web.Response:
    state = authorized(request)
    try:
        top = int(request.query.get("top", "10"))
    except ValueError as err:
        raise APIError(400, "top must be an integer", param="top") from err
    return json_response(cache_body(await kv_stats(state, max(0, min(top, MAX_TOP)))))


def cache_body(stats: p.Stats) -> dict[str, Any]:
    """``/admin/cache``'s body (also part of ``/admin/overview``)."""
    gpu, cpu = stats.gpu, stats.cpu
    queried, hits = stats.prefix_queried_tokens, stats.prefix_hit_tokens
    return {
        "block_size": stats.block_size,
        "block_bytes": stats.block_bytes,
        "blocks": {
            "total": gpu.total,
            "free": gpu.free,
            "in_use": gpu.used,
            "cached": gpu.cached,
            "swapped": cpu.used,
        },
        "cpu_blocks": {"total": cpu.total, "free": cpu.free, "in_use": cpu.used},
        "prefix_cache": {
            "lookups": stats.prefix_lookups,
            "queried_tokens": queried,
            "hit_tokens": hits,
            "hit_rate": hits / queried if queried else 0.0,
            "miss_reasons": stats.prefix_stops,
        },
        "cpu_tier": {
            "prefix_cache": stats.cpu_prefix_cache,
            "demoted_blocks": cpu.cached,
            "hit_tokens": stats.prefix_hit_tokens_cpu,
            "counts": stats.tier_counts,
        },
        "top_prefixes": [as_dict(row) for row in stats.top_prefixes],
        "pools": [as_dict(row) for row in stats.pools],
        "kvstore_busy_s": stats.busy_s,
    }


async def requests(request: web.Request) -> web.Response:
    state = authorized(request)
    stats = await kv_stats(state, 0)
    return json_response(requests_body(stats, await state.queue_length(fresh=True)))


def requests_body(stats: p.Stats, queued: int) -> dict[str, Any]:
    """``/admin/requests``'s body; ``queued``: entries in the Redis request stream."""
    workers = [as_dict(w) for w in stats.workers]
    for worker in workers:
        del worker["prefill_profile"]
    return {
        "requests": [as_dict(row) for row in stats.requests],
        "workers": workers,
        "queued": queued,
    }


async def cost_model(request: web.Request) -> web.Response:
    state = authorized(request)
    return json_response(cost_model_body(await kv_stats(state, 0)))


def cost_model_body(stats: p.Stats) -> dict[str, Any]:
    """``/admin/cost-model``'s body."""
    calibration = None
    if stats.calibration is not None:
        cal = stats.calibration
        calibration = as_dict(cal) | {
            "swap_out_gbps": _gbps(cal.block_bytes, cal.swap_out_per_block_s),
            "swap_in_gbps": _gbps(cal.block_bytes, cal.swap_in_per_block_s),
        }
    return {
        "calibration": calibration,
        "prefill_profiles": {w.worker_id: w.prefill_profile for w in stats.workers},
        "recompute_profiles": {w.worker_id: w.recompute_profile for w in stats.workers},
        # which profile is in force: measured at start-up, from the worker's cache, or prior
        "profile_origins": {
            w.worker_id: as_dict(w.profile_origin) if w.profile_origin else None
            for w in stats.workers
        },
        "decisions": [as_dict(d) for d in stats.decisions],
        "preemptions": stats.preemptions,
    }


def _gbps(block_bytes: int, per_block_s: float) -> float | None:
    return block_bytes / per_block_s / 1e9 if per_block_s > 0 else None


async def reset_cache(request: web.Request) -> web.Response:
    state = authorized(request)
    try:
        reply = await state.kv.call(p.ResetCache())
    except (KVStoreTimeout, KVStoreError) as err:
        raise APIError(
            503, f"the kvstore did not answer: {err}", code="kvstore_unavailable"
        ) from err
    assert isinstance(reply, p.CacheReset)
    return json_response({"reset_blocks": reply.blocks})
