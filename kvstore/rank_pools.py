"""One pool split over the ranks of a tensor-parallel worker group (``--tensor-parallel-size``):
a ``DevicePools`` per rank, each holding its ranks' KV heads (``contracts.model_config
.heads_per_rank``) for the same block ids, so one block table (the manager's) serves the group.
A swap moves a block in every rank; the export names every rank's pool, rank 0's first."""

from __future__ import annotations

import time

import msgspec

from kvstore.cost_model import SwapCalibration
from kvstore.device import DevicePools, calibrate_swaps
from kvstore.protocol import PoolInfo


class RankPools:
    def __init__(self, ranks: list[DevicePools]) -> None:
        if len({r.pool.shape[0] for r in ranks}) != 1:
            raise ValueError("the rank pools of one pool must hold the same block ids")
        self.ranks = ranks
        self.device = ranks[0].device
        self.block_bytes = sum(r.block_bytes for r in ranks)  # a block, every rank's heads

    def export(self) -> PoolInfo:
        infos = [r.export() for r in self.ranks]
        return msgspec.structs.replace(infos[0], ranks=infos)

    def swap_out(self, pairs: list[tuple[int, int]]) -> float:
        """GPU blocks to CPU blocks in every rank, the ranks' copies at once; returns seconds,
        synchronised."""
        return self._move(pairs, to_cpu=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> float:
        """CPU blocks to GPU blocks in every rank, the ranks' copies at once; returns seconds,
        synchronised."""
        return self._move([(g, c) for c, g in pairs], to_cpu=False)

    def _move(self, pairs: list[tuple[int, int]], to_cpu: bool) -> float:
        """``(gpu, cpu)`` pairs in every rank: each rank's copies queued on its own stream, then
        waited for (one rank after another, they took the sum of their times: each GPU has its
        own host link)."""
        start = time.perf_counter()
        for rank in self.ranks:
            rank.issue(pairs, to_cpu)
        for rank in self.ranks:
            rank.wait()
        return time.perf_counter() - start

    def calibrate(self, sizes: tuple[int, ...] = (1, 4, 16, 64)) -> SwapCalibration | None:
        first = self.ranks[0]
        return calibrate_swaps(self, first.pool.shape[0], first.cpu_pool.shape[0], sizes)

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()
