"""Placement across a host's pools: ``kvstore.placement.choose_pool`` with exact pools and prices
(1 s a token, copies 4 s + 2 s a block: every price below is a small whole number of seconds),
then ``Host.route`` over real ``KVCacheManager``s, through ``Host.handle``."""

from __future__ import annotations

import pytest

from kvstore import protocol as p
from kvstore.host import PRIOR_COPY, PRIOR_PREFILL_S_PER_TOKEN, Host
from kvstore.manager import KVCacheManager
from kvstore.placement import (
    RUNNING_TOKEN_WEIGHT,
    PoolView,
    Prices,
    bring,
    choose_pool,
    evicted_s,
    needed_blocks,
    wait_s,
)
from kvstore.service import KVService

BS = 16
PRICES = Prices(prefill_s_per_token=1.0, copy_fixed_s=4.0, copy_s_per_block=2.0)
ROOMY = 100  # free blocks of a pool with room for anything here


def view(
    pool: int, cached: int = 0, free: int = ROOMY, running: int = 0, queued: int = 0
) -> PoolView:
    return PoolView(pool, cached, free, running, queued)


# ---------------------------------------------------------------------- the pure policy
def test_prices_wait_and_copy() -> None:
    assert PRICES.prefill_s(40) == 40.0 and PRICES.prefill_s(-3) == 0.0
    assert PRICES.copy_s(0) == 0.0 and PRICES.copy_s(3) == 4.0 + 3 * 2.0
    assert RUNNING_TOKEN_WEIGHT == 16
    assert wait_s(view(0, running=2, queued=5), PRICES) == 5 + 2 * 16
    assert needed_blocks(40, BS, 2) == 3 and needed_blocks(30, BS, 2) == 2


def test_idle_host_sends_a_request_to_the_pool_caching_its_prefix() -> None:
    # 40 tokens, 32 of them cached on pool 1: pool 1 prefills 8; pool 0 would copy 2 blocks
    # (4 + 2 * 2) and prefill 8, or recompute all 40.
    placed = choose_pool([view(0), view(1, cached=2)], 40, BS, PRICES, "prefix", 0)
    assert (placed.pool, placed.cached_tokens, placed.bring) == (1, 32, "cached")
    assert placed.reason == "cheapest (cached)"
    assert placed.predicted_s == (16.0, 8.0)


def test_equal_pools_without_a_cached_prefix() -> None:
    idle = [view(0), view(1), view(2)]
    placed = choose_pool(idle, 40, BS, PRICES, "prefix", 0)
    assert (placed.pool, placed.cached_tokens, placed.bring) == (0, 0, "none")  # tie: lowest
    assert placed.predicted_s == (40.0, 40.0, 40.0)
    queued = [view(0, queued=100), view(1, queued=20), view(2, queued=50)]
    placed = choose_pool(queued, 40, BS, PRICES, "prefix", 0)
    assert placed.pool == 1 and placed.predicted_s == (140.0, 60.0, 90.0)
    running = [view(0, running=2), view(1, running=1), view(2, running=3)]
    placed = choose_pool(running, 40, BS, PRICES, "prefix", 0)
    assert placed.pool == 1 and placed.predicted_s == (72.0, 56.0, 88.0)
    # a running sequence weighs RUNNING_TOKEN_WEIGHT queued tokens: a tie, the lowest pool
    mixed = [view(0, running=1), view(1, queued=RUNNING_TOKEN_WEIGHT)]
    assert choose_pool(mixed, 40, BS, PRICES, "prefix", 0).pool == 0
    mixed = [view(0, running=1), view(1, queued=RUNNING_TOKEN_WEIGHT - 1)]
    assert choose_pool(mixed, 40, BS, PRICES, "prefix", 0).pool == 1


@pytest.mark.parametrize(("queued", "running"), [(0, 0), (7, 0), (8, 0), (9, 0), (0, 1)])
def test_a_prefix_on_a_busy_pool_is_copied_to_an_idle_one_once_waiting_costs_more(
    queued: int, running: int
) -> None:
    """Pool 0 caches 2 of the 40 tokens' blocks and waits ``queued`` + 16 x ``running``; idle
    pool 1 can copy them (4 + 2 x 2 = 8 s): it wins once the wait exceeds the copy's cost,
    a tie staying on the lowest pool."""
    views = [view(0, cached=2, running=running, queued=queued), view(1)]
    placed = choose_pool(views, 40, BS, PRICES, "prefix", 0)
    wait = wait_s(views[0], PRICES)
    assert wait == queued + RUNNING_TOKEN_WEIGHT * running
    threshold = PRICES.copy_s(2)
    assert threshold == 8.0
    assert placed.predicted_s == (wait + 8.0, threshold + 8.0)
    if wait > threshold:
        assert (placed.pool, placed.cached_tokens, placed.bring) == (1, 32, "copy")
        assert placed.reason == "cheapest (copy)"
    else:
        assert (placed.pool, placed.cached_tokens, placed.bring) == (0, 32, "cached")


@pytest.mark.parametrize("queued", [0, 11, 12, 13, 75, 76, 77])
def test_on_full_pools_a_prefix_is_copied_only_once_waiting_costs_what_the_copy_evicts(
    queued: int,
) -> None:
    """Both pools are full of cached blocks (none empty). 72 tokens, 4 blocks cached on pool 0,
    need 5 blocks (2 lookahead slots). Pool 0: its wait + 8 tokens' prefill + 1 block evicted
    (16 s). Pool 1: a copy of 4 blocks (4 + 4 x 2 = 12 s) + 8 + 5 blocks evicted (80 s). So
    the prefix moves once pool 0's wait exceeds 12 + 80 - 16 = 76 s, not 12 s as on empty
    pools: full pools keep different prefixes instead of the same ones twice."""
    assert needed_blocks(72, BS, 2) == 5
    assert evicted_s(view(0, free=10), 5, BS, PRICES) == 0.0  # empty_blocks None: all empty
    full = [
        PoolView(0, 4, ROOMY, 0, queued, empty_blocks=0),
        PoolView(1, 0, ROOMY, 0, 0, empty_blocks=0),
    ]
    assert evicted_s(full[1], 5, BS, PRICES) == 80.0
    placed = choose_pool(full, 72, BS, PRICES, "prefix", 0)
    assert placed.predicted_s == (queued + 8.0 + 16.0, 12.0 + 8.0 + 80.0)
    assert placed.pool == (1 if queued > 76 else 0)
    assert placed.bring == ("copy" if queued > 76 else "cached")
    # with 5 empty blocks on pool 1, nothing is evicted there, while pool 0 evicts a block for
    # the question's: the copy (20 s) beats even an idle pool 0 (24 s)
    roomy = [full[0], PoolView(1, 0, ROOMY, 0, 0, empty_blocks=5)]
    placed = choose_pool(roomy, 72, BS, PRICES, "prefix", 0)
    assert placed.predicted_s == (queued + 8.0 + 16.0, 12.0 + 8.0)
    assert (placed.pool, placed.bring) == (1, "copy")
    # two empty blocks there: 3 evicted (48 s)
    assert evicted_s(PoolView(1, 0, ROOMY, 0, 0, empty_blocks=2), 5, BS, PRICES) == 48.0
    # least loaded and round robin price no eviction
    assert choose_pool(full, 72, BS, PRICES, "least_loaded", 0).predicted_s == (
        queued + 72.0,
        72.0,
    )


def test_bring_copies_when_cheaper_than_recomputing() -> None:
    idle = view(1)
    assert bring(idle, 2, 2, 40, BS, PRICES) == (16.0, "copy", 32)  # 4 + 2 x 2 + 8 < 40
    dear = Prices(1.0, 100.0, 2.0)
    assert bring(idle, 2, 2, 40, BS, dear) == (40.0, "recompute", 0)  # 100 + 4 + 8 > 40
    equal = Prices(1.0, 28.0, 2.0)  # 28 + 4 + 8 == 40: the copy must be strictly cheaper
    assert bring(idle, 2, 2, 40, BS, equal) == (40.0, "recompute", 0)
    # a pool holding part of the prefix copies the difference only
    assert bring(view(1, cached=1), 2, 2, 40, BS, PRICES) == (4.0 + 2.0 + 8.0, "copy", 32)
    assert bring(view(1, cached=2), 2, 2, 40, BS, PRICES) == (8.0, "cached", 32)
    assert bring(view(1), 0, 0, 40, BS, PRICES) == (40.0, "none", 0)


def test_bring_loads_what_a_cpu_tier_holds_beyond_every_gpu() -> None:
    # loads: 1 s + 3 s a block. 40 tokens; the best GPU run elsewhere 1 block, a CPU tier
    # carries the chain to 2 blocks
    loads = Prices(1.0, 4.0, 2.0, load_fixed_s=1.0, load_s_per_block=3.0)
    idle = view(1)
    assert bring(idle, 1, 2, 40, BS, loads) == (1.0 + 2 * 3.0 + 8.0, "load", 32)  # < 6 + 24
    # from a pool caching block 0, only block 1 is loaded
    assert bring(view(1, cached=1), 1, 2, 40, BS, loads) == (1.0 + 3.0 + 8.0, "load", 32)
    dear = Prices(1.0, 4.0, 2.0, load_fixed_s=20.0, load_s_per_block=3.0)
    assert bring(idle, 1, 2, 40, BS, dear) == (6.0 + 24.0, "copy", 16)  # 26 + 8 > 30
    # no load price (infinite): never loaded; something better was there, so it is a recompute
    assert bring(view(1, cached=1), 1, 2, 40, BS, PRICES) == (24.0, "recompute", 16)
    # the pool's own CPU tier carries its chain on: a load too
    own = PoolView(0, 1, ROOMY, 0, 0, held_blocks=2)
    assert own.held == 2 and view(0, cached=1).held == 1
    placed = choose_pool([own, view(1)], 40, BS, loads, "prefix", 0)
    assert (placed.pool, placed.bring, placed.cached_tokens) == (0, "load", 32)
    assert placed.predicted_s == (1.0 + 3.0 + 8.0, 1.0 + 2 * 3.0 + 8.0)


def test_a_pool_without_room_is_avoided_unless_no_pool_has_room() -> None:
    # 40 tokens + 2 lookahead slots: 3 blocks. Pool 1 caches 2 (needs 1 more), pool 0 none.
    assert needed_blocks(40, BS, 2) == 3
    views = [view(0, free=3), view(1, cached=2, free=0)]
    placed = choose_pool(views, 40, BS, PRICES, "prefix", 0)
    assert (placed.pool, placed.bring, placed.cached_tokens) == (0, "copy", 32)
    assert placed.reason == "cheapest (copy)"
    # pool 1 is cheaper (8 s, + 16 s for the block it would evict), but has no room
    assert placed.predicted_s == (16.0, 24.0)
    views = [view(0, free=3), view(1, cached=2, free=1)]  # exactly the block it needs
    assert choose_pool(views, 40, BS, PRICES, "prefix", 0).pool == 1
    views = [view(0, free=2), view(1, cached=2, free=0)]  # neither: the cheapest anyway
    placed = choose_pool(views, 40, BS, PRICES, "prefix", 0)
    assert (placed.pool, placed.bring) == (1, "cached")
    assert placed.reason == "cheapest (cached); no pool has room now"
    placed = choose_pool(views, 40, BS, PRICES, "least_loaded", 0)
    assert placed.reason == "least loaded; no pool has room now"


def test_least_loaded_ignores_the_cache() -> None:
    views = [view(0, cached=2, queued=1), view(1)]
    placed = choose_pool(views, 40, BS, PRICES, "least_loaded", 0)
    assert placed.pool == 1 and placed.reason == "least loaded"
    assert placed.predicted_s == (41.0, 40.0)  # the wait and the full prompt, cache or not
    assert (placed.bring, placed.cached_tokens) == ("copy", 32)  # pool 1 still copies it
    assert choose_pool(views, 40, BS, PRICES, "prefix", 0).pool == 0  # 1 + 8 < 16


def test_round_robin_follows_turn() -> None:
    views = [view(0), view(1, cached=2, queued=1000), view(2)]
    chosen = [choose_pool(views, 40, BS, PRICES, "round_robin", turn) for turn in range(5)]
    assert [c.pool for c in chosen] == [0, 1, 2, 0, 1]
    assert all(c.reason == "round robin" and c.predicted_s == () for c in chosen)
    assert [(c.bring, c.cached_tokens) for c in chosen[:3]] == [
        ("copy", 32),
        ("cached", 32),
        ("copy", 32),
    ]


def test_pools_without_a_live_worker_are_left_out_unless_all_are() -> None:
    views = [view(0, cached=2, queued=0), PoolView(1, 2, ROOMY, 0, 0, serving=False), view(2)]
    placed = choose_pool(views, 40, BS, PRICES, "prefix", 0)
    assert (placed.pool, placed.bring) == (0, "cached")
    views = [PoolView(0, 2, ROOMY, 0, 0, serving=False), view(1, queued=100)]
    placed = choose_pool(views, 40, BS, PRICES, "prefix", 0)
    assert (placed.pool, placed.bring) == (1, "copy")  # 100 + 16, and pool 0 is cheaper
    assert placed.predicted_s == (8.0, 116.0)
    assert placed.reason == "cheapest (copy); 1 pool(s) without a live worker left out"
    nobody = [PoolView(i, 0, ROOMY, 0, 10 * i, serving=False) for i in range(2)]
    placed = choose_pool(nobody, 40, BS, PRICES, "least_loaded", 0)
    assert (placed.pool, placed.reason) == (0, "least loaded")


def test_no_pools() -> None:
    with pytest.raises(ValueError, match="no pools"):
        choose_pool([], 40, BS, PRICES, "prefix", 0)


# ---------------------------------------------------------------------- Host.route
class NoMoves:
    block_bytes = 1

    def swap_out(self, pairs: list[tuple[int, int]]) -> float:
        raise AssertionError("no swap expected")

    swap_in = swap_out

    def export(self) -> p.PoolInfo:
        return p.PoolInfo("shm", [1], "float32", BS)


class Copies:
    """A copier that records what it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, list[tuple[int, int]]]] = []

    def __call__(self, src: int, dst: int, pairs: list[tuple[int, int]], tier: p.Tier) -> float:
        assert tier == "gpu", "these pools have no CPU tier"
        self.calls.append((src, dst, list(pairs)))
        return 1e-6


def host(gpu: list[int], bs: int = BS, copier: Copies | None = None) -> Host:
    services = [KVService(KVCacheManager(n, 0, bs), NoMoves(), 60, 60) for n in gpu]
    h = Host(services, [f"cpu:{i}" for i in range(len(gpu))], copier, None, "auto")
    for i in range(len(gpu)):
        assert isinstance(h.handle(p.Register(f"w{i}", pool=i)), p.Registered)
    return h


def route(h: Host, *items: tuple[str, list[int]]) -> list[p.RoutedItem]:
    reply = h.handle(p.Route([p.RouteItem(req_id, tokens) for req_id, tokens in items]))
    assert isinstance(reply, p.Routed)
    return reply.items


def step(h: Host, body: p.Step) -> p.StepReply:
    reply = h.handle(body)
    assert isinstance(reply, p.StepReply), reply
    for m in h.managers:
        m.check_integrity()
    return reply


def queues(h: Host) -> list[tuple[int, int]]:
    stats = h.handle(p.GetStats())
    assert isinstance(stats, p.Stats)
    return [(row.queued, row.queued_tokens) for row in stats.pools]


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_host_spreads_one_batch_over_idle_pools_by_queued_tokens() -> None:
    h = host([64, 64])
    routed = route(
        h,
        ("a", tokens(1000, 100)),  # tie: pool 0, which then owes 100
        ("b", tokens(2000, 20)),  # pool 1 (0 < 100), owes 20
        ("c", tokens(3000, 20)),  # pool 1 (20 < 100)
        ("d", tokens(4000, 20)),  # pool 1 (40 < 100)
        ("e", tokens(5000, 80)),  # pool 1 (60 < 100)
        ("f", tokens(6000, 10)),  # pool 0 (100 < 140)
    )
    assert [r.pool for r in routed] == [0, 1, 1, 1, 1, 0]
    assert all((r.cached_tokens, r.bring) == (0, "none") for r in routed)
    per_token = PRIOR_PREFILL_S_PER_TOKEN
    assert routed[5].predicted_s == [pytest.approx(110 * per_token), pytest.approx(150 * per_token)]
    assert queues(h) == [(2, 110), (4, 140)]
    assert h.handle(p.Route([p.RouteItem("x", [1])], "round_robin")) == p.Routed(
        [p.RoutedItem(0, 0, "none", "round robin", [])]
    )
    assert route(h, ("y", [1]))[0].pool == 0  # "x" is queued on pool 0 now: 111 < 140


def test_a_quote_places_as_a_route_would_and_books_nothing() -> None:
    """``Route(book=False)``: the answer a booking would get, and nothing counted queued (a
    gateway routing across hosts quotes each host, then books one)."""
    h = host([64, 64])
    route(h, ("a", tokens(1000, 100)))  # pool 0, which owes 100
    items = [p.RouteItem("b", tokens(2000, 20)), p.RouteItem("c", tokens(3000, 20))]
    quote = h.handle(p.Route(items, book=False))
    assert isinstance(quote, p.Routed)
    assert [r.pool for r in quote.items] == [1, 1]
    assert queues(h) == [(1, 100), (0, 0)]
    for policy in ("round_robin", "round_robin"):  # a quote does not take a turn either
        quoted = h.handle(p.Route(items[:1], policy, book=False))
        assert isinstance(quoted, p.Routed) and quoted.items[0].pool == 0
    assert h.handle(p.Route(items)) == quote  # booked: the same places
    assert queues(h) == [(1, 100), (2, 40)]


def test_a_prefix_computed_on_pool_1_routes_to_pool_1() -> None:
    copier = Copies()
    h = host([64, 64], copier=copier)
    prefix = tokens(100, 32)  # 2 blocks
    step(h, p.Step("w1", admits=[p.AdmitItem("a", [*prefix, 1, 2, 3])]))
    step(h, p.Step("w1", finals=[p.AppendItem("a", [], 35)], frees=["a"]))
    assert h.managers[1].pool.num_cached_free == 2 and not copier.calls
    lookups = [m.index.lookups for m in h.managers]
    [routed] = route(h, ("b", [*prefix, *tokens(900, 8)]))
    assert (routed.pool, routed.cached_tokens, routed.bring) == (1, 32, "cached")
    assert routed.reason == "cheapest (cached)"
    per_token, copy = PRIOR_PREFILL_S_PER_TOKEN, PRIOR_COPY
    assert routed.predicted_s == [
        pytest.approx(copy.fixed_s + 2 * copy.per_unit_s + 8 * per_token),  # pool 0 copies
        pytest.approx(8 * per_token),
    ]
    assert [m.index.lookups for m in h.managers] == lookups  # routing counts no lookup
    assert queues(h) == [(0, 0), (1, 8)]  # it owes pool 1 only what it does not cache
    reply = step(h, p.Step("w1", admits=[p.AdmitItem("b", [*prefix, *tokens(900, 8)])]))
    assert [(a.num_computed, a.num_cached_tokens) for a in reply.admitted] == [(32, 32)]
    assert queues(h) == [(0, 0), (0, 0)] and not copier.calls


def test_queued_counts_drop_when_the_request_is_admitted() -> None:
    h = host([64, 4])
    route(h, ("a", tokens(0, 40)), ("b", tokens(100, 40)), ("c", tokens(200, 40)))
    assert queues(h) == [(2, 80), (1, 40)]
    step(h, p.Step("w0", admits=[p.AdmitItem("a", tokens(0, 40))]))
    assert queues(h) == [(1, 40), (1, 40)]
    # b, routed to pool 1, is admitted on pool 0: pool 1's queue drops
    step(h, p.Step("w0", admits=[p.AdmitItem("b", tokens(100, 40))]))
    assert queues(h) == [(1, 40), (0, 0)]
    # routed again (a retry): counted once, where it goes now
    assert route(h, ("c", tokens(200, 40)))[0].pool == 1
    assert queues(h) == [(0, 0), (1, 40)]
    # refused for space (3 blocks needed, 4 in the pool, 2 held): still queued
    step(h, p.Step("w1", admits=[p.AdmitItem("z", tokens(500, 20))]))
    reply = step(h, p.Step("w1", admits=[p.AdmitItem("c", tokens(200, 40))]))
    assert [(e.req_id, e.code) for e in reply.errors] == [("c", "no_space")]
    assert queues(h) == [(0, 0), (1, 40)]
    step(h, p.Step("w1", frees=["z"], admits=[p.AdmitItem("c", tokens(200, 40))]))
    assert queues(h) == [(0, 0), (0, 0)]


def test_a_pool_whose_worker_left_is_not_routed_to() -> None:
    h = host([64, 64])
    assert h.handle(p.Unregister("w0")) == p.Ack()
    [routed] = route(h, ("a", tokens(0, 40)))
    assert routed.pool == 1 and routed.reason.endswith("1 pool(s) without a live worker left out")
    h.handle(p.Register("w0", pool=0))
    [routed] = route(h, ("b", tokens(100, 40)))
    assert (routed.pool, routed.reason) == (0, "cheapest (none)")


def test_routing_prices_the_workers_prefill_profile() -> None:
    """Once a worker sent a prefill profile, a token costs what its largest point says."""
    h = host([64, 64])
    h.handle(p.Register("w1", prefill_profile=[(100, 0.5), (1000, 2.0)], pool=1))
    [routed] = route(h, ("a", tokens(0, 10)))
    assert routed.pool == 0 and routed.predicted_s == [pytest.approx(10 * 2.0 / 1000)] * 2


def occupied_pool_with_an_idle_prefix(h: Host) -> None:
    """Pool 0 (4 blocks of 4): a 2-block prefix cached with ref 0 (blocks 0 and 1), one
    block held by a running request, one free."""
    step(h, p.Step("w0", admits=[p.AdmitItem("a", [1] * 8 + [2])]))
    step(h, p.Step("w0", finals=[p.AppendItem("a", [], 9)], frees=["a"]))
    step(h, p.Step("w0", admits=[p.AdmitItem("hold", [5])]))
    step(h, p.Step("w1", admits=[p.AdmitItem("busy", [6])]))  # pool 1: one running too
    m = h.managers[0]
    assert m.pool.lru_order() == [0, 1] and m.pool.num_free == 1


PROMPT_C = [1] * 8 + [3] * 4  # 12 tokens: 4 blocks with the lookahead, 2 of them cached on 0


def test_a_pool_whose_free_blocks_are_its_cached_prefix_cannot_admit() -> None:
    """The precondition of the next test: pool 0 refuses c for space (its 2 hit blocks are
    also 2 of its 3 available ones: 2 more needed, 1 left), pool 1 admits it."""
    h = host([4, 8], bs=4)
    occupied_pool_with_an_idle_prefix(h)
    reply = step(h, p.Step("w0", admits=[p.AdmitItem("c", PROMPT_C)]))
    assert [(e.req_id, e.code) for e in reply.errors] == [("c", "no_space")]
    reply = step(h, p.Step("w1", admits=[p.AdmitItem("c", PROMPT_C)]))
    assert [a.req_id for a in reply.admitted] == ["c"]


def test_routing_sees_that_a_pool_whose_free_blocks_are_its_cached_prefix_has_no_room() -> None:
    h = host([4, 8], bs=4)
    occupied_pool_with_an_idle_prefix(h)
    [routed] = route(h, ("c", PROMPT_C))
    assert routed.pool == 1  # pool 0 cannot admit it (previous test); pool 1 can
