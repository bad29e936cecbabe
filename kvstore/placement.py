"""Placement: which of the host's pools serves a request. Pure Python, no I/O.

The daemon knows exactly, at the time of the call, what each pool holds and runs (``PoolView``):
the request's prefix cached there (GPU tier, and how far its CPU tier carries it on), its room,
its running requests and the requests routed to it that no worker admitted yet. The ``prefix``
policy prices each pool as

    wait (the prefill owed by the requests queued there, and a share of a step per running one)
    + the request's own prefill there, after what that pool has cached
      or, where another pool caches more: copying the difference over + the rest's prefill,
      or, where a CPU tier (this pool's or another's) carries the chain further: loading the
      difference + the rest's prefill, whichever is cheapest
    + what the blocks it allocates there displace: each block beyond the pool's empty ones
      evicts a cached block, priced as recomputing it (``EVICTED_BLOCK_WEIGHT``)

and takes the cheapest pool; a pool without room for the request is taken only when no pool has
room, a pool no live worker serves only when none has one. A prefix hot on a saturated pool
therefore goes elsewhere once waiting there costs more than a copy and what the copy evicts: on
pools full of cached prefixes, a prefix stays on one pool until its wait there exceeds about its
own prefill, so the pools hold different prefixes (together up to the sum of their sizes) instead
of the same hot ones twice. ``least_loaded`` prices the wait alone (the request's own prefill at
full length); ``round_robin`` takes pools in turn (all of them: the baseline knows nothing).
The prices (``Prices``) come from the workers' measured prefill profiles, the daemon's measured
peer copies and its calibrated CPU-tier loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.protocol import Bring, RoutingPolicy

# A running sequence's share of the steps a new request waits through, in prefill tokens: a
# decode costs its pool about what prefilling this many tokens does (one token of compute, but
# the read of its context).
RUNNING_TOKEN_WEIGHT = 16
# What evicting a cached block costs, in recomputes of it: the LRU victim is the block least
# likely to be asked for again, but a pool full of prefixes holds the working set, and a copy of
# a prefix another pool holds takes room from one nobody else does.
EVICTED_BLOCK_WEIGHT = 1.0


@dataclass(frozen=True)
class PoolView:
    """One pool as the daemon sees it now, for one request. ``cached_blocks``: the leading full
    blocks of the request's prompt cached in this pool's GPU tier; ``held_blocks``: those its
    GPU and CPU tiers hold together (None: ``cached_blocks``). ``free_blocks``: what an
    admission may take (free and evictable, above the watermark). ``queued_tokens``: the prompt
    tokens that requests routed here and not yet admitted will prefill."""

    pool: int
    cached_blocks: int
    free_blocks: int
    running: int
    queued_tokens: int
    serving: bool = True  # a worker of the pool holds a live lease
    empty_blocks: int | None = None  # of free_blocks, those holding no cached KV (None: all)
    held_blocks: int | None = None

    @property
    def held(self) -> int:
        return max(self.held_blocks or 0, self.cached_blocks)


@dataclass(frozen=True)
class Prices:
    """``prefill_s_per_token``: a pool's prefill cost per token; ``copy_fixed_s`` and
    ``copy_s_per_block``: a batched copy of blocks from one pool's GPU to another's;
    ``load_fixed_s`` and ``load_s_per_block``: a batched load of CPU-tier blocks into a GPU
    (unpriced: infinite, so never chosen)."""

    prefill_s_per_token: float
    copy_fixed_s: float
    copy_s_per_block: float
    load_fixed_s: float = math.inf
    load_s_per_block: float = 0.0

    def prefill_s(self, tokens: int) -> float:
        return max(tokens, 0) * self.prefill_s_per_token

    def copy_s(self, blocks: int) -> float:
        return self.copy_fixed_s + blocks * self.copy_s_per_block if blocks > 0 else 0.0

    def load_s(self, blocks: int) -> float:
        return self.load_fixed_s + blocks * self.load_s_per_block if blocks > 0 else 0.0


@dataclass(frozen=True)
class Placed:
    """The chosen ``pool``, the prefix tokens it will hold (``cached_tokens``), how (``bring``),
    why, and every pool's predicted seconds (bringing the prefix, prefilling, waiting)."""

    pool: int
    cached_tokens: int
    bring: Bring
    reason: str
    predicted_s: tuple[float, ...]


def wait_s(view: PoolView, prices: Prices) -> float:
    """What a request placed on ``view``'s pool waits for: the queued prefills there and a share
    of the steps of every running sequence."""
    return prices.prefill_s(view.queued_tokens + RUNNING_TOKEN_WEIGHT * view.running)


def evicted_s(view: PoolView, new_blocks: int, block_size: int, prices: Prices) -> float:
    """What allocating ``new_blocks`` on ``view``'s pool displaces: the cached blocks it evicts
    once the empty ones are taken, priced as recomputing them."""
    empty = view.free_blocks if view.empty_blocks is None else view.empty_blocks
    evicted = max(new_blocks - max(empty, 0), 0)
    return EVICTED_BLOCK_WEIGHT * prices.prefill_s(evicted * block_size)


def bring(
    view: PoolView,
    best_blocks: int,
    best_held: int,
    num_tokens: int,
    block_size: int,
    prices: Prices,
) -> tuple[float, Bring, int]:
    """The cost of the request's own prefill on ``view``'s pool, how its prefix gets there and
    the tokens it holds: what the pool caches, or (``best_blocks`` cached on another GPU,
    ``best_held`` in some pool's two tiers) a copy or a load of the difference, whichever of the
    three is cheapest (a tie: the first)."""
    here = view.cached_blocks
    options: list[tuple[float, Bring, int]] = [
        (prices.prefill_s(num_tokens - here * block_size), "recompute", here)
    ]
    if best_blocks > here:
        rest = prices.prefill_s(num_tokens - best_blocks * block_size)
        options.append((prices.copy_s(best_blocks - here) + rest, "copy", best_blocks))
    if best_held > max(best_blocks, here):
        rest = prices.prefill_s(num_tokens - best_held * block_size)
        options.append((prices.load_s(best_held - here) + rest, "load", best_held))
    seconds, how, blocks = min(options, key=lambda option: option[0])
    if best_held <= here:  # nothing better anywhere
        how = "cached" if here else "none"
    return seconds, how, blocks * block_size


def needed_blocks(num_tokens: int, block_size: int, lookahead: int) -> int:
    return -(-(num_tokens + lookahead) // block_size)


def choose_pool(
    views: list[PoolView],
    num_tokens: int,
    block_size: int,
    prices: Prices,
    policy: RoutingPolicy,
    turn: int,
    lookahead: int = 2,
) -> Placed:
    """The pool for a request of ``num_tokens`` prompt tokens (``views`` in pool order; ``turn``:
    how many requests were routed before, for ``round_robin``). Ties go to the lowest pool."""
    if not views:
        raise ValueError("no pools to choose from")
    best_blocks = max(v.cached_blocks for v in views)
    best_held = max(v.held for v in views)
    brought = [bring(v, best_blocks, best_held, num_tokens, block_size, prices) for v in views]
    if policy == "round_robin":
        i = turn % len(views)
        _, how, cached = brought[i]
        return Placed(views[i].pool, cached, how, "round robin", ())
    need = needed_blocks(num_tokens, block_size, lookahead)
    if policy == "least_loaded":
        costs = [wait_s(v, prices) + prices.prefill_s(num_tokens) for v in views]
    else:
        costs = [
            wait_s(v, prices) + own + evicted_s(v, need - v.cached_blocks, block_size, prices)
            for v, (own, _, _) in zip(views, brought, strict=True)
        ]
    serving = [i for i, v in enumerate(views) if v.serving] or list(range(len(views)))
    roomy = [i for i in serving if views[i].free_blocks >= need - views[i].cached_blocks]
    i = min(roomy or serving, key=lambda j: (costs[j], j))
    _, how, cached = brought[i]
    reason = "least loaded" if policy == "least_loaded" else f"cheapest ({how})"
    if not roomy:
        reason += "; no pool has room now"
    if len(serving) < len(views):
        reason += f"; {len(views) - len(serving)} pool(s) without a live worker left out"
    return Placed(views[i].pool, cached, how, reason, tuple(costs))
