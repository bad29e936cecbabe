"""Copies of blocks between two pools of the host: GPU to GPU over NVLink, or between two
``/dev/shm`` pools (a CPU stack's pools, and GPUs without peer access).

Two routes, chosen by measurement when the daemon starts (``PeerCopier.calibrate``):

- ``direct`` (GPUs with peer access): one kernel, ``kernels.copy_blocks_between``, runs on one
  of the two GPUs and reads or writes the other's pool through NVLink, every block in one launch:
  ``push`` runs on the source and writes the peer, ``pull`` runs on the destination and reads it.
  No staging buffer, no per-block copy.
- ``staged`` (anything else): the source blocks gathered into the source's staging buffer, one
  transfer to the destination's staging buffer, a scatter there; rounds of half a buffer,
  double-buffered (the gather of a round runs while the round before crosses the link).

A block only a pool's CPU tier holds is loaded from that tier into the other pool, as its own
swap-in would be (``DevicePools.load_from``). Every copy is synchronised before it returns:
the daemon replies only once the blocks are in.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Literal

import torch

from kvstore.cost_model import LinearCost, fit_linear
from kvstore.device import DevicePools
from kvstore.protocol import Tier

log = logging.getLogger("pagedserve.kvstore")
CopyRoute = Literal["push", "pull", "staged"]


class PeerCopier:
    """Owns the copies between the host's pools: the route each takes, its calibrated price, and
    which GPUs have been given peer access to each other."""

    def __init__(self, pools: list[DevicePools]) -> None:
        self.pools = pools
        self.route: CopyRoute = "staged"
        self._peered: set[tuple[int, int]] = set()
        self._direct: dict[tuple[int, int], bool] = {}  # asked of CUDA once per pair
        self._ids = torch.empty(0, dtype=torch.int64)  # pinned: the ids' upload, reused

    def direct_possible(self, src: int, dst: int) -> bool:
        if (src, dst) not in self._direct:
            a, b = self.pools[src].pool.device, self.pools[dst].pool.device  # with indexes
            self._direct[src, dst] = (
                a.type == "cuda"
                and b.type == "cuda"
                and a != b
                and bool(torch.cuda.can_device_access_peer(a, b))
                and bool(torch.cuda.can_device_access_peer(b, a))
            )
        return self._direct[src, dst]

    def copy(
        self,
        src: int,
        dst: int,
        pairs: list[tuple[int, int]],
        route: CopyRoute | None = None,
        tier: Tier = "gpu",
    ) -> float:
        """Copies pool ``src``'s blocks of ``tier`` into pool ``dst``'s GPU blocks (``(src block,
        dst block)`` pairs), a GPU's by ``route`` (default: the calibrated one), a CPU tier's
        through ``dst``'s staging buffer; returns seconds, synchronised."""
        if tier == "cpu":
            return self.pools[dst].load_from(self.pools[src], pairs)
        route = route or self.route
        if route != "staged" and self.direct_possible(src, dst):
            self._open_peers(src, dst)
            if len(self._ids) < 2 * len(pairs):
                self._ids = torch.empty(max(2 * len(pairs), 4096), dtype=torch.int64).pin_memory()
            push = route == "push"
            return copy_direct(self.pools[src], self.pools[dst], pairs, push, self._ids)
        return copy_staged(self.pools[src], self.pools[dst], pairs)

    def calibrate(self, src: int = 0, dst: int = 1) -> LinearCost | None:
        """Times each possible route between two pools, keeps the faster at 64 blocks, and
        returns its ``fixed + n * per_block`` line (None if the pools are too small to try)."""
        routes: list[CopyRoute] = ["staged"]
        if self.direct_possible(src, dst):
            routes = ["push", "pull", "staged"]
        lines: dict[CopyRoute, LinearCost] = {}
        for route in routes:
            line = self._fit(src, dst, route)
            if line is not None:
                lines[route] = line
        if not lines:
            return None
        self.route = min(lines, key=lambda r: lines[r].seconds(64))
        log.info("peer copies go %s: %s", self.route, lines[self.route])
        return lines[self.route]

    def _fit(
        self,
        src: int,
        dst: int,
        route: CopyRoute,
        sizes: tuple[int, ...] = (1, 16, 64, 256),
        repeats: int = 3,
    ) -> LinearCost | None:
        """Times ``sizes`` scattered blocks by ``route`` (median of ``repeats``, after a
        warm-up) and fits ``fixed + n * per_block``."""
        a, b = self.pools[src], self.pools[dst]
        blocks = min(a.pool.shape[0], b.pool.shape[0])
        sizes = tuple(n for n in sizes if n <= blocks)
        if not sizes:
            return None
        gen = torch.Generator().manual_seed(1)
        samples: list[tuple[float, float]] = []
        for n in sizes:
            pairs = random_pairs(blocks, blocks, n, gen)
            self.copy(src, dst, pairs, route)
            seconds = sorted(self.copy(src, dst, pairs, route) for _ in range(repeats))
            samples.append((n, seconds[repeats // 2]))
            log.info(
                "calibrating copies %s -> %s (%s): %d blocks %.3f ms (%.1f GB/s)",
                a.device,
                b.device,
                route,
                n,
                samples[-1][1] * 1e3,
                n * a.block_bytes / samples[-1][1] / 1e9,
            )
        return fit_linear(samples)

    def _open_peers(self, src: int, dst: int) -> None:
        """Peer access both ways (a first peer ``copy_`` each way enables it in torch)."""
        key = (min(src, dst), max(src, dst))
        if key in self._peered:
            return
        a, b = self.pools[src].device, self.pools[dst].device
        torch.ones(1, device=a).copy_(torch.ones(1, device=b))
        torch.ones(1, device=b).copy_(torch.ones(1, device=a))
        torch.cuda.synchronize(a)
        torch.cuda.synchronize(b)
        self._peered.add(key)


def random_pairs(
    src_blocks: int, dst_blocks: int, n: int, gen: torch.Generator
) -> list[tuple[int, int]]:
    """``n`` distinct scattered source ids paired with ``n`` distinct scattered destination ids
    (as a pool's allocator hands them out after a while)."""
    return list(
        zip(
            torch.randperm(src_blocks, generator=gen)[:n].tolist(),
            torch.randperm(dst_blocks, generator=gen)[:n].tolist(),
            strict=True,
        )
    )


def copy_direct(
    src: DevicePools,
    dst: DevicePools,
    pairs: list[tuple[int, int]],
    push: bool,
    pinned: torch.Tensor | None = None,
) -> float:
    """One ``copy_blocks_between`` launch on the source's stream (``push``) or the
    destination's, after the work queued on the other's; returns seconds, synchronised.
    ``pinned``: a pinned int64 buffer of at least 2 x len(pairs) ids for the ids' upload (free
    again once this returns), else a pageable upload."""
    from kernels import copy_blocks_between

    start = time.perf_counter()
    if not pairs:
        return 0.0
    n = len(pairs)
    flat = torch.tensor([s for s, _ in pairs] + [d for _, d in pairs], dtype=torch.int64)
    host = flat if pinned is None else pinned[: 2 * n].copy_(flat)
    runner, other = (src, dst) if push else (dst, src)
    with torch.cuda.device(runner.device), torch.cuda.stream(runner.stream):
        runner.stream.wait_stream(other.stream)
        ids = host.to(runner.device, non_blocking=pinned is not None)
        copy_blocks_between(src.pool, dst.pool, ids[:n], ids[n:])
    runner.stream.synchronize()
    return time.perf_counter() - start


def copy_staged(src: DevicePools, dst: DevicePools, pairs: list[tuple[int, int]]) -> float:
    """Copies ``src``'s blocks into ``dst``'s (``(src block, dst block)`` pairs); returns
    seconds, synchronised. Both pools have the same geometry (CPU or CUDA). Rounds of half a
    staging buffer, double-buffered: the gather of a round runs while the round before crosses
    the link."""
    start = time.perf_counter()
    if not pairs:
        return 0.0
    cuda = src.device.type == "cuda"
    src_rows, dst_rows = block_rows(src.pool), block_rows(dst.pool)
    src_halves = (
        block_rows(src.staging).chunk(2) if len(src.staging) > 1 else [block_rows(src.staging)]
    )
    dst_halves = (
        block_rows(dst.staging).chunk(2) if len(dst.staging) > 1 else [block_rows(dst.staging)]
    )
    chunk = min(len(src_halves[-1]), len(dst_halves[-1]))
    read: list[torch.cuda.Event | None] = [None] * len(src_halves)  # a half's last peer copy
    for k, lo in enumerate(range(0, len(pairs), chunk)):
        part, half = pairs[lo : lo + chunk], k % len(src_halves)
        gathered, received = src_halves[half][: len(part)], dst_halves[half][: len(part)]
        with torch.cuda.stream(src.stream) if cuda else nullcontext():  # ids made on it too
            src_ids = torch.tensor([s for s, _ in part], device=src.device)
            last_read = read[half]
            if last_read is not None:
                src.stream.wait_event(last_read)
            torch.index_select(src_rows, 0, src_ids, out=gathered)
            done = torch.cuda.Event() if cuda else None
            if done is not None:
                done.record(src.stream)
        with torch.cuda.stream(dst.stream) if cuda else nullcontext():
            dst_ids = torch.tensor([d for _, d in part], device=dst.device)
            if done is not None:
                dst.stream.wait_event(done)
            received.copy_(gathered, non_blocking=True)
            if cuda:
                read[half] = event = torch.cuda.Event()
                event.record(dst.stream)
            dst_rows.index_copy_(0, dst_ids, received)
    if cuda:
        dst.stream.synchronize()
    return time.perf_counter() - start


def block_rows(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as one row of 8-byte words per block (a block's bytes are a multiple of 8):
    gathers and scatters move 4x fewer elements than in bf16."""
    return pool.view(pool.shape[0], -1).view(torch.int64)
