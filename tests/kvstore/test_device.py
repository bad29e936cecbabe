"""The torch side of the kvstore: pool mapping across processes and swap byte-exactness."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from contracts.model_config import KVGeometry, kv_geometry, tiny_config
from kvstore import protocol as p
from kvstore.device import (
    DevicePools,
    blocks_for_memory,
    blocks_in_gib,
    contiguous_runs,
    create_shm_file,
    remove_stale_pool_files,
)
from kvstore.manager import KVCacheManager
from kvstore.mapping import map_pool
from kvstore.service import KVService

GEOMETRY = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")


@pytest.fixture
def pools() -> Iterator[DevicePools]:
    pools = DevicePools(GEOMETRY, 16, num_blocks=32, num_cpu_blocks=16, device="cpu")
    yield pools
    pools.close()


def test_pool_layout_and_geometry() -> None:
    geometry = kv_geometry(tiny_config(), "auto")
    assert geometry == KVGeometry(2, 2, 16, "float32")
    assert geometry.block_bytes(16) == 2 * 2 * 16 * 2 * 16 * 4
    pools = DevicePools(geometry, 16, 4, 2, "cpu")
    try:
        assert list(pools.pool.shape) == [4, 2, 2, 16, 2, 16]
        assert pools.pool[1].data_ptr() - pools.pool[0].data_ptr() == geometry.block_bytes(16)
    finally:
        pools.close()


def test_memory_specs() -> None:
    assert blocks_for_memory("1GiB", 1 << 20, "cpu") == 1024
    assert blocks_for_memory("2", 1 << 20, "cpu") == 2048
    assert 0 < blocks_for_memory("0.01", 1 << 20, "cpu") < blocks_for_memory("0.02", 1 << 20, "cpu")
    for bad in ("lots", "-1", "0", "0.0000001GiB"):
        with pytest.raises(ValueError):
            blocks_for_memory(bad, 1 << 20, "cpu")
    assert blocks_in_gib("0", 1 << 20) == 0 and blocks_in_gib("0.5", 1 << 20) == 512
    assert list(contiguous_runs([4, 5, 6, 9, 1, 2])) == [(0, 4, 3), (3, 9, 1), (4, 1, 2)]


def test_swap_out_then_in_returns_identical_bytes_and_frees_cpu_blocks(pools: DevicePools) -> None:
    manager = KVCacheManager(32, 16, 16)
    manager.pricing.prefill_profiles["w"] = [(16, 10.0)]  # recompute is dear: the cost model swaps
    manager.pricing.calibration = pools.calibrate(sizes=(1, 4))
    service = KVService(manager, pools, lease_timeout_s=60, orphan_grace_s=60)
    service.handle(p.Register("w", [(16, 10.0)], "cpu", 0))
    # Two requests: 'a' (90 tokens, 6 blocks) to swap, 'b' sharing nothing, to stay put.
    a_tokens, b_tokens = list(range(90)), list(range(500, 540))
    placed = service.handle(
        p.Step("w", admits=[p.AdmitItem("a", a_tokens), p.AdmitItem("b", b_tokens)])
    )
    assert isinstance(placed, p.StepReply)
    a_blocks, b_blocks = placed.admitted[0].block_ids, placed.admitted[1].block_ids
    torch.manual_seed(1)
    pools.pool.copy_(torch.randn(pools.pool.shape).to(pools.pool.dtype))  # the "worker" writes
    a_bytes, b_bytes = pools.pool[a_blocks].clone(), pools.pool[b_blocks].clone()
    service.handle(p.Step("w", appends=[p.AppendItem("a", [1], 90)]))
    reply = service.handle(p.Step("w", preempts=["a"]))
    assert isinstance(reply, p.StepReply)
    assert reply.preempted == [("a", "swap")] and manager.cpu.num_used == 6
    # Make every freed block really free (no prefix-cache reuse at resume), then let others
    # overwrite them: all six blocks must come back from the CPU tier.
    reset = service.handle(p.ResetCache())
    assert isinstance(reset, p.CacheReset) and reset.blocks == 5
    pools.pool[a_blocks] = float("nan")
    reply = service.handle(p.Step("w", resumes=["a"]))
    assert isinstance(reply, p.StepReply)
    new_blocks = reply.resumed[0].block_ids
    assert reply.resumed[0].num_computed == 90
    assert manager.cpu.num_free == 16, "swap-in must free the CPU blocks"
    assert torch.equal(pools.pool[new_blocks].view(torch.int16), a_bytes.view(torch.int16))
    assert torch.equal(pools.pool[b_blocks].view(torch.int16), b_bytes.view(torch.int16))
    decision = manager.decisions.recent()[-1]
    actual_s = decision["actual_s"]
    assert decision["mode"] == "swap" and isinstance(actual_s, float) and actual_s > 0
    manager.check_integrity()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_pool_loads_another_pools_cpu_blocks_byte_exact(device: str) -> None:
    """Pool 1 loads CPU blocks 3, 4 and 9 of pool 0's tier into its GPU blocks 7, 2 and 5 (runs
    of the source ids, out of order on the destination); nothing else of pool 1 changes."""
    src, dst = (DevicePools(GEOMETRY, 16, 16, 12, device) for _ in range(2))
    try:
        torch.manual_seed(2)
        src.cpu_pool.copy_(torch.randn(src.cpu_pool.shape).to(src.cpu_pool.dtype))
        dst.pool.fill_(1.0)
        assert dst.load_from(src, [(3, 7), (4, 2), (9, 5)]) >= 0.0
        for c, g in [(3, 7), (4, 2), (9, 5)]:
            assert torch.equal(
                dst.pool[g].cpu().view(torch.int16), src.cpu_pool[c].view(torch.int16)
            )
        untouched = [g for g in range(16) if g not in (7, 2, 5)]
        assert bool((dst.pool[untouched] == 1.0).all())
        other = DevicePools(KVGeometry(3, 1, 8, "bfloat16"), 16, 16, 12, "cpu")
        with pytest.raises(ValueError, match="different geometries"):
            dst.load_from(other, [(0, 0)])
        other.close()
    finally:
        src.close()
        dst.close()


def tier_round_trip(pools: DevicePools, write_back: int) -> None:
    """A computed prompt is evicted from the GPU (demoted to the CPU tier, ahead of time when
    ``write_back``, else at eviction) while other content overwrites its blocks; the same
    prompt comes back as a prefix hit loaded from the CPU: its blocks must hold the exact bytes."""
    manager = KVCacheManager(8, 4, 16, cpu_prefix_cache=True)
    manager.pricing.calibration = pools.calibrate(sizes=(1, 4))
    service = KVService(manager, pools, 60, 60, write_back_ahead=write_back)
    service.handle(p.Register("w", [(16, 10.0)], "cpu", 0))  # recompute is dear: it loads
    prompt = list(range(49))  # 3 full blocks + 1 token
    reply = service.handle(p.Step("w", admits=[p.AdmitItem("a", prompt)]))
    assert isinstance(reply, p.StepReply)
    blocks = reply.admitted[0].block_ids
    torch.manual_seed(2)
    pools.pool[blocks] = torch.randn(pools.pool[blocks].shape).to(pools.pool)  # "computed"
    expected = pools.pool[blocks[:3]].clone()
    service.handle(p.Step("w", appends=[p.AppendItem("a", [], 49)], frees=[]))
    service.handle(p.Step("w", frees=["a"]))
    assert service.between_calls() == (3 if write_back else 0)
    # 126 other tokens and their two lookahead slots take every GPU block; the "worker"
    # overwrites them all.
    reply = service.handle(p.Step("w", admits=[p.AdmitItem("b", list(range(500, 626)))]))
    assert isinstance(reply, p.StepReply) and len(reply.admitted[0].block_ids) == 8
    pools.pool.fill_(-1.0)
    assert manager.store.counts["demoted_at_eviction"] == (0 if write_back else 3)
    service.handle(p.Step("w", frees=["b"]))
    reply = service.handle(p.Step("w", admits=[p.AdmitItem("c", [*prompt, 9, 9])]))
    assert isinstance(reply, p.StepReply)
    [placed] = reply.admitted
    assert placed.num_computed == 48 and placed.num_cached_tokens == 48
    loaded = pools.pool[placed.block_ids[:3]]
    assert torch.equal(loaded.view(torch.int16), expected.view(torch.int16))
    decision = manager.decisions.recent()[-1]
    assert decision["kind"] == "prefix" and decision["mode"] == "load"
    assert isinstance(decision["actual_s"], float) and decision["actual_s"] > 0
    stats = service.handle(p.GetStats())
    assert isinstance(stats, p.Stats) and stats.prefix_hit_tokens_cpu == 48
    assert stats.tier_counts["loaded"] == 3 and stats.cpu.cached == 3
    manager.check_integrity()


@pytest.mark.parametrize("write_back", [0, 8], ids=["demoted-at-eviction", "written-back"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_demoted_prefix_comes_back_byte_exact(device: str, write_back: int) -> None:
    pools = DevicePools(GEOMETRY, 16, num_blocks=8, num_cpu_blocks=4, device=device)
    try:
        tier_round_trip(pools, write_back)
    finally:
        pools.close()


def test_second_process_maps_the_shm_pool(pools: DevicePools) -> None:
    info = msgspec.msgpack.encode(pools.export())  # exactly what a worker receives
    pools.pool[3, 1, 0] = 1.5  # we write block 3 (layer 1, K) ...
    child = textwrap.dedent("""
        import sys, msgspec, torch
        from kvstore import protocol as p
        from kvstore.mapping import map_pool
        pool = map_pool(msgspec.msgpack.decode(sys.stdin.buffer.read(), type=p.PoolInfo))
        assert bool((pool[3, 1, 0] == 1.5).all()), "child does not see the parent's bytes"
        pool[7, 2, 1] = -2.25  # ... the child writes block 7 (layer 2, V)
    """)
    subprocess.run([sys.executable, "-c", child], input=info, check=True)
    assert bool((pools.pool[7, 2, 1] == -2.25).all())
    assert bool((pools.pool[6] == 0).all()), "the child wrote outside its block"


@pytest.mark.gpu
def test_second_process_maps_the_cuda_pool_through_ipc() -> None:
    pools = DevicePools(GEOMETRY, 16, num_blocks=64, num_cpu_blocks=8, device="cuda")
    pools.pool.fill_(0)
    pools.pool[5] = 3.0
    torch.cuda.synchronize()
    info = msgspec.msgpack.encode(pools.export())
    child = textwrap.dedent("""
        import sys, msgspec, torch
        from kvstore import protocol as p
        from kvstore.mapping import map_pool
        pool = map_pool(msgspec.msgpack.decode(sys.stdin.buffer.read(), type=p.PoolInfo))
        assert pool.is_cuda and bool((pool[5] == 3.0).all()), "child misses the parent's bytes"
        pool[9, 1, 0] = 7.0
        torch.cuda.synchronize()
    """)
    subprocess.run([sys.executable, "-c", child], input=info, check=True)
    assert bool((pools.pool[9, 1, 0] == 7.0).all()) and bool((pools.pool[8] == 0).all())
    # Swap through the pinned CPU tier on the same pool, byte-exact.
    pools.pool.copy_(torch.randn(pools.pool.shape, device="cuda").to(pools.pool.dtype))
    before = pools.pool[[3, 40, 41, 7]].clone()
    pools.swap_out([(3, 0), (40, 1), (41, 2), (7, 6)])
    pools.pool[[3, 40, 41, 7]] = float("nan")
    pools.swap_in([(0, 10), (1, 11), (2, 12), (6, 13)])
    assert torch.equal(pools.pool[[10, 11, 12, 13]].view(torch.int16), before.view(torch.int16))


def test_map_pool_rejects_a_missing_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("only meaningful without a GPU")
    handle = p.CudaIpcHandle("GPU-nope", b"x", 1, 0, b"", 0, b"", False)
    with pytest.raises(RuntimeError, match="not visible"):
        map_pool(p.PoolInfo("cuda_ipc", [1], "float32", 16, cuda=handle))


def test_expandable_segments_are_forced_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.daemon import disable_expandable_segments

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    disable_expandable_segments()
    conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert conf == "max_split_size_mb:64,expandable_segments:False"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    disable_expandable_segments()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_the_shm_pool_file_is_private_and_locked(pools: DevicePools) -> None:
    path = pools.shm_path
    assert os.path.basename(path).startswith(f"pagedserve-kv-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):  # the daemon's flock: never taken for stale
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    with pytest.raises(FileExistsError):  # O_EXCL: never a file someone planted
        create_shm_file(path, 16)


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_stale_pool_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    files = {
        "dead": tmp_path / f"pagedserve-kv-{dead}-aaaa",
        "live": tmp_path / f"pagedserve-kv-{os.getpid()}-bbbb",
        "locked": tmp_path / f"pagedserve-kv-{dead}-cccc",  # a live daemon, other pid namespace
        "other_name": tmp_path / f"other-{dead}-dddd",
        "no_pid": tmp_path / "pagedserve-kv-x-eeee",
    }
    for path in files.values():
        path.write_bytes(b"k" * 8192)
    lock = os.open(files["locked"], os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    if os.getuid() == 0:
        files["not_mine"] = tmp_path / f"pagedserve-kv-{dead}-ffff"
        files["not_mine"].write_bytes(b"k")
        os.chown(files["not_mine"], 65534, -1)
    try:
        assert remove_stale_pool_files(str(tmp_path)) == (1, 8192)
    finally:
        os.close(lock)
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
        path.name for key, path in files.items() if key != "dead"
    )
    assert remove_stale_pool_files(str(tmp_path / "missing")) == (0, 0)
