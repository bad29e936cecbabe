"""Copies between a host's pools, exactly: pools of 4-token blocks over the shadow bytes of
``test_host_machine``, one worker per pool, copies run at once. The first three reproduce the
defects that machine found in ``Host._bring`` (kvstore/host.py); the last loads a prefix from
another pool's CPU tier."""

from __future__ import annotations

import pytest

from kvstore import protocol as p
from kvstore.host import Host, PeerCopyMode
from kvstore.manager import KVCacheManager
from kvstore.service import KVService
from tests.kvstore.test_host_machine import Shadow, ShadowMover, chain, slot


class ShadowHost:
    """Pools of 4-token blocks over shadow bytes, one worker per pool, copies run at once."""

    BS = 4

    def __init__(self, gpu: list[int], cpu: int, tier: bool, mode: PeerCopyMode) -> None:
        self.shadow = Shadow(len(gpu), max(gpu), cpu, self.BS)
        services = [
            KVService(
                KVCacheManager(n, cpu, self.BS, cpu_prefix_cache=tier),
                ShadowMover(self.shadow, i, self.BS),
                60,
                60,
            )
            for i, n in enumerate(gpu)
        ]
        self.copies: list[tuple[int, int, list[tuple[int, int]], p.Tier]] = []
        self.host = Host(services, [f"cpu:{i}" for i in range(len(gpu))], self.copy, None, mode)
        for i in range(len(gpu)):
            assert isinstance(self.host.handle(p.Register(f"w{i}", pool=i)), p.Registered)

    def copy(self, src: int, dst: int, pairs: list[tuple[int, int]], tier: p.Tier) -> float:
        self.copies.append((src, dst, list(pairs), tier))
        source = self.shadow.gpu[src] if tier == "gpu" else self.shadow.cpu[src]
        for s, d in pairs:
            self.shadow.gpu[dst][d] = list(source[s])
        return 1e-5

    def step(self, pool: int, body: p.Step) -> p.StepReply:
        reply = self.host.handle(body)
        assert isinstance(reply, p.StepReply)
        for m in self.host.managers:
            m.check_integrity()
        return reply

    def admit(self, pool: int, req_id: str, tokens: list[int]) -> p.StepReply:
        return self.step(pool, p.Step(f"w{pool}", admits=[p.AdmitItem(req_id, tokens)]))

    def serve(self, pool: int, req_id: str, tokens: list[int], keep: bool = False) -> None:
        """Admitted, every token written into its slot and reported (ended, unless ``keep``)."""
        assert not self.admit(pool, req_id, tokens).errors
        r = self.host.managers[pool].requests[req_id]
        for pos in range(r.num_computed, len(tokens)):
            self.shadow.gpu[pool][r.block_ids[pos // self.BS]][pos % self.BS] = slot(
                None, tokens, pos
            )
        final = [p.AppendItem(req_id, [], len(tokens))]
        body = p.Step(f"w{pool}", appends=final)
        if not keep:
            body = p.Step(f"w{pool}", finals=final, frees=[req_id])
        assert not self.step(pool, body).errors


def test_a_demotion_saves_a_block_evicted_by_a_peer_copy() -> None:
    """Pool 1 (3 blocks, a CPU tier): [9] * 8 cached in blocks 0 and 1, block 2 held. A copy of
    [1] * 4 from pool 0 evicts block 0, demoted at eviction: the CPU tier must get [9] * 4."""
    h = ShadowHost([8, 3], cpu=2, tier=True, mode="always")
    h.serve(1, "x", [9] * 8)
    h.serve(1, "hold", [5], keep=True)
    h.serve(0, "a", [1] * 5)
    m = h.host.managers[1]
    assert (m.pool.lru_order(), m.pool.num_free) == ([0, 1], 0)
    [placed] = h.admit(1, "b", [1] * 5).admitted
    assert h.copies == [(0, 1, [(0, 0)], "gpu")] and placed.num_computed == 4
    nines = [9] * 8
    demoted = {m.index.key_of_cpu_block(c): c for c in m.index.demoted_blocks()}
    keys, _ = chain(nines, None, 4)
    assert set(demoted) == set(keys)  # both blocks of [9] * 8 live on in the CPU tier
    assert h.shadow.cpu[1][demoted[keys[1]]] == [slot(None, nines, i) for i in range(4, 8)]
    saved = h.shadow.cpu[1][demoted[keys[0]]]
    assert saved == [slot(None, nines, i) for i in range(4)]


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_peer_copy_keeps_the_destinations_own_prefix(mode: PeerCopyMode) -> None:
    """Pool 1 (6 blocks): [1] * 4 cached in block 0, the oldest of its LRU, no block free.
    Without a copy b hits block 0; a copy of the rest of [1] * 8 from pool 0 must not evict it
    (room: 3 blocks, b needs 2 beyond block 0)."""
    h = ShadowHost([8, 6], cpu=0, tier=False, mode=mode)
    h.serve(1, "p1", [1] * 4 + [5])
    h.serve(0, "a", [1] * 9)
    h.serve(1, "z", [7] * 9)
    h.serve(1, "hold", [3] * 9, keep=True)
    m = h.host.managers[1]
    assert (m.pool.lru_order(), m.pool.num_free) == ([0, 2, 3], 0)
    h.copies.clear()
    reply = h.admit(1, "b", [1] * 9)
    if mode == "never":
        assert not h.copies and [a.num_computed for a in reply.admitted] == [4]
        return
    assert [(src, dst, len(pairs)) for src, dst, pairs, _ in h.copies] == [(0, 1, 1)]
    assert m.index.key_of_block(0) == chain([1] * 4, None, 4)[0][0]  # not evicted
    assert [a.num_computed for a in reply.admitted] == [8]


def test_a_peer_copy_of_a_chain_whose_later_blocks_the_destination_holds() -> None:
    """Pool 1 holds block 1 of x's chain (block 0 was evicted): its lookup of x stops at
    position 0, yet a copy of x's 2 blocks from pool 0 must not receive position 1 again."""
    h = ShadowHost([8, 6], cpu=0, tier=False, mode="always")
    x = [1] * 4 + [2] * 4 + [0]
    h.serve(1, "x", x)
    assert not h.admit(1, "hold", [5] * 9).errors  # the last free blocks ...
    assert not h.admit(1, "y", [6] * 5).errors  # ... and x's block 0, the oldest cached
    h.step(1, p.Step("w1", frees=["hold", "y"]))
    m = h.host.managers[1]
    keys, _ = chain(x, None, 4)
    assert m.index.key_of_block(1) == keys[1] and keys[0] not in m.index
    h.serve(0, "a", x)
    h.copies.clear()
    reply = h.admit(1, "b", x)
    assert [(src, dst, len(pairs)) for src, dst, pairs, _ in h.copies] == [(0, 1, 1)]
    assert [a.num_computed for a in reply.admitted] == [8]


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_prefix_only_another_pools_cpu_tier_holds_is_loaded_from_it(mode: PeerCopyMode) -> None:
    """Pool 0 (3 blocks, a CPU tier): x = [1] * 8 + [0] served, then y = [2] * 9 evicts x's two
    cached blocks, demoted at eviction into CPU blocks 0 and 1. Pool 1 admits x: with copies
    allowed, both blocks are loaded from pool 0's CPU tier, with x's bytes, and hit."""
    h = ShadowHost([3, 8], cpu=4, tier=True, mode=mode)
    x = [1] * 8 + [0]
    h.serve(0, "x", x)
    h.serve(0, "y", [2] * 9)
    m0, m1 = h.host.managers
    keys, _ = chain(x, None, 4)
    assert [m0.index.key_of_cpu_block(c) for c in (0, 1)] == keys[:2]
    assert all(m0.index.entry(k).block is None for k in keys[:2])  # type: ignore[union-attr]
    reply = h.admit(1, "b", x)
    if mode == "never":
        assert not h.copies and [a.num_computed for a in reply.admitted] == [0]
        return
    [placed] = reply.admitted
    assert placed.num_computed == 8
    [(src, dst, pairs, tier)] = h.copies
    assert (src, dst, tier) == (0, 1, "cpu") and [c for c, _ in pairs] == [0, 1]
    blocks = m1.requests["b"].block_ids[:2]
    assert [d for _, d in pairs] == blocks
    assert [m1.index.key_of_block(b) for b in blocks] == keys[:2]
    assert h.shadow.gpu[1][blocks[1]] == [slot(None, x, i) for i in range(4, 8)]
    stats = h.host.handle(p.GetStats())
    assert isinstance(stats, p.Stats)
    assert (stats.pools[1].copied_in_blocks, stats.pools[1].loaded_in_blocks) == (2, 2)
    # the daemon's busy seconds: each copy as its mover timed it (1e-5 a call), in its kind
    busy = stats.busy_s
    assert busy["peer_copies"] == pytest.approx(1e-5)  # the one load from pool 0's CPU tier
    assert busy["tier_copies"] == pytest.approx(1e-5)  # y's step demoted x's blocks, one call
    assert "swaps" not in busy and "write_back" not in busy and "between_calls" not in busy
    assert {"Register", "Step", "GetStats"} - set(busy) == {"GetStats"}  # counted once done
    assert busy["Step"] >= busy["peer_copies"] + busy["tier_copies"]
