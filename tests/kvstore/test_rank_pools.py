"""A pool split over the ranks of a tensor-parallel group (``--tensor-parallel-size``): each rank's
``/dev/shm`` pool holds its KV heads for the same block ids, a swap moves a block in every rank
byte for byte, and a worker registering with the real daemon gets every rank's pool to map."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from contracts.model_config import KVGeometry, heads_per_rank, kv_geometry, tiny_config
from kvstore import protocol as p
from kvstore.client import KVClient
from kvstore.device import DevicePools
from kvstore.mapping import map_pool
from kvstore.rank_pools import RankPools
from tests.conftest import start_kvstore, stop_process

RANK_GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32")


@pytest.fixture
def ranks() -> Iterator[RankPools]:
    pools = RankPools([DevicePools(RANK_GEOMETRY, 16, 8, 4, "cpu") for _ in range(2)])
    yield pools
    pools.close()


def test_a_swap_moves_a_block_in_every_rank(ranks: RankPools) -> None:
    gen = torch.Generator().manual_seed(0)
    for rank in ranks.ranks:
        rank.pool.copy_(torch.randn(rank.pool.shape, generator=gen))
    before = [rank.pool[3].clone() for rank in ranks.ranks]
    assert not torch.equal(before[0], before[1])  # each rank its own heads' bytes
    assert ranks.swap_out([(3, 1)]) >= 0
    for rank in ranks.ranks:
        rank.pool[3].zero_()
    ranks.swap_in([(1, 5)])
    for rank, block in zip(ranks.ranks, before, strict=True):
        assert torch.equal(rank.pool[5], block)
    assert ranks.block_bytes == 2 * RANK_GEOMETRY.block_bytes(16)


def test_a_swap_of_scattered_blocks_moves_each_to_its_place_in_every_rank(
    ranks: RankPools,
) -> None:
    """Blocks 6, 0 and 4 out to CPU blocks 2, 0 and 3 (runs 0 and 2-3), then back in to GPU
    blocks 1, 7 and 2: each rank's bytes land where its pairs say, whatever their order."""
    gen = torch.Generator().manual_seed(1)
    for rank in ranks.ranks:
        rank.pool.copy_(torch.randn(rank.pool.shape, generator=gen))
    before = [rank.pool.clone() for rank in ranks.ranks]
    ranks.swap_out([(6, 2), (0, 0), (4, 3)])
    for rank, pool in zip(ranks.ranks, before, strict=True):
        for gpu, cpu in [(6, 2), (0, 0), (4, 3)]:
            assert torch.equal(rank.cpu_pool[cpu], pool[gpu])
    ranks.swap_in([(3, 1), (2, 7), (0, 2)])
    for rank, pool in zip(ranks.ranks, before, strict=True):
        for gpu, old in [(1, 4), (7, 6), (2, 0)]:
            assert torch.equal(rank.pool[gpu], pool[old])


def test_the_export_names_every_rank_pool(ranks: RankPools) -> None:
    info = ranks.export()
    assert [r.shm_path for r in info.ranks] == [r.shm_path for r in ranks.ranks]
    assert info.shm_path == ranks.ranks[0].shm_path and len(set(ranks_paths(info))) == 2
    mapped = map_pool(info.ranks[1])
    assert mapped.data_ptr() != ranks.ranks[1].pool.data_ptr()  # another mapping of one file
    ranks.ranks[1].pool[2].fill_(7.0)
    assert torch.equal(mapped[2], ranks.ranks[1].pool[2])


def ranks_paths(info: p.PoolInfo) -> list[str]:
    return [r.shm_path for r in info.ranks]


def test_rank_pools_must_share_block_ids() -> None:
    a = DevicePools(RANK_GEOMETRY, 16, 8, 0, "cpu")
    b = DevicePools(RANK_GEOMETRY, 16, 9, 0, "cpu")
    try:
        with pytest.raises(ValueError, match="same block ids"):
            RankPools([a, b])
    finally:
        a.close()
        b.close()


def test_the_daemon_splits_each_pool_by_kv_heads() -> None:
    """``--tensor-parallel-size 2`` on the tiny model (2 KV heads): each rank's pool holds one
    head, the same blocks; with 2 pools, 4 rank pools in all."""
    assert heads_per_rank(2, 2) == 1 and kv_geometry(tiny_config(), "auto", 2).num_kv_heads == 1
    process, endpoint = start_kvstore(
        "--model", "tiny", "--kv-memory", "0.005GiB", "--swap-memory", "0.002GiB",
        "--tensor-parallel-size", "2", "--data-parallel-size", "2",
    )  # fmt: skip
    try:
        with KVClient(endpoint, timeout_s=10) as client:
            paths = []
            for pool in (0, 1):
                reply = client.call(p.Register(f"w{pool}", [(16, 0.001)], "cpu", 1, pool=pool))
                assert isinstance(reply, p.Registered)
                assert len(reply.pool.ranks) == 2
                for info in reply.pool.ranks:
                    assert info.shape == [reply.num_gpu_blocks, 2, 2, 16, 1, 16]
                paths += ranks_paths(reply.pool)
            assert len(set(paths)) == 4
    finally:
        log = stop_process(process)
    assert process.returncode == 0, log
    assert "2 ranks" in log
