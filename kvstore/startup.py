"""The daemon's start-up: the pools allocated, their copies timed, the services wired under one
``Host``. ``kvstore.daemon`` runs it once its endpoint is bound."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvstore.host import Host, PeerCopyMode
from kvstore.manager import KVCacheManager
from kvstore.protocol import Tier
from kvstore.service import KVService

if TYPE_CHECKING:
    from kvstore.config import KVStoreConfig
    from kvstore.device import DevicePools
    from kvstore.rank_pools import RankPools

    Pools = DevicePools | RankPools  # a pool: one device's, or split over a group's ranks

log = logging.getLogger("pagedserve.kvstore")


def disable_expandable_segments() -> None:
    """CUDA IPC cannot export memory from expandable segments: force them off before CUDA starts."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:
        log.warning("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; turning it off for IPC")
    parts = [x for x in conf.split(",") if x and not x.startswith("expandable_segments")]
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join([*parts, "expandable_segments:False"])


def build_host(config: KVStoreConfig) -> tuple[Host, list[Pools]]:
    """Removes dead daemons' pool files, allocates each pool (the slow part: progress is logged),
    times copies between them, and wires one service per pool under one ``Host``. Raises
    ValueError on a flag that makes no sense (memory sizes, dtype, pool or rank count)."""
    from kvstore.cost_model import LinearCost
    from kvstore.peer_copy import PeerCopier

    for name, value in (
        ("--data-parallel-size", config.data_parallel_size),
        ("--tensor-parallel-size", config.tensor_parallel_size),
    ):
        if value < 1:
            raise ValueError(f"{name} {value}: at least 1")
    if config.demote_at_eviction_ms < 0:
        raise ValueError(f"--demote-at-eviction-ms {config.demote_at_eviction_ms}: at least 0")
    built = [build_service(config, i) for i in range(config.data_parallel_size)]
    services, pools = [s for s, _ in built], [d for _, d in built]
    # one copier per rank: rank r of a pool copies into rank r of another
    copiers = [PeerCopier([ranks_of(p)[r] for p in pools]) for r in range(len(ranks_of(pools[0])))]
    price = None
    if len(pools) > 1 and config.peer_copy != "never":
        lines = [c.calibrate() for c in copiers]
        if all(line is not None for line in lines):
            price = LinearCost(
                sum(line.fixed_s for line in lines if line is not None),
                sum(line.per_unit_s for line in lines if line is not None),
            )
    mode: PeerCopyMode = "auto"
    if config.peer_copy in ("always", "never"):
        mode = "always" if config.peer_copy == "always" else "never"
    devices = [str(d.device) for d in pools]

    def copy(src: int, dst: int, pairs: list[tuple[int, int]], tier: Tier) -> float:
        return sum(c.copy(src, dst, pairs, tier=tier) for c in copiers)

    return Host(services, devices, copy, price, mode), pools


def ranks_of(pools: Pools) -> list[DevicePools]:
    from kvstore.rank_pools import RankPools

    return pools.ranks if isinstance(pools, RankPools) else [pools]


def build_service(config: KVStoreConfig, index: int = 0) -> tuple[KVService, Pools]:
    """Pool ``index`` of the host (its rank pools with ``--tensor-parallel-size``) and its
    service."""
    disable_expandable_segments()
    from contracts.model_config import kv_geometry, load_config, resolve_device, resolve_dtype
    from kvstore.device import (
        SHM_DIR,
        DevicePools,
        blocks_for_memory,
        blocks_in_gib,
        remove_stale_pool_files,
    )
    from kvstore.rank_pools import RankPools

    device = resolve_device(config.device)
    ranks = config.tensor_parallel_size
    devices = [device] * ranks
    gpus = config.data_parallel_size * ranks
    if gpus > 1 and device.startswith("cuda"):
        if device != "cuda" and device != "cuda:0":
            raise ValueError(
                f"--device {config.device} with {config.data_parallel_size} pool(s) of "
                f"{ranks} rank(s): pools go on cuda:0 to cuda:{gpus - 1}; pick the GPUs with "
                "CUDA_VISIBLE_DEVICES"
            )
        devices = [f"cuda:{index * ranks + r}" for r in range(ranks)]
    if index == 0:
        files, freed = remove_stale_pool_files()
        if files:
            log.info(
                "removed %d stale pool file(s) of dead kvstores from %s: %.1f MiB freed",
                files,
                SHM_DIR,
                freed / 2**20,
            )
    model_config = load_config(config.model)
    dtype = resolve_dtype(model_config, config.dtype, device)
    geometry = kv_geometry(model_config, dtype, ranks)  # one rank's heads
    block_bytes = geometry.block_bytes(config.block_size)
    kv_memory = config.kv_memory
    if kv_memory == "auto":
        kv_memory = "0.5" if device.startswith("cuda") else "1GiB"
    num_blocks = min(blocks_for_memory(kv_memory, block_bytes, d) for d in devices)
    num_cpu_blocks = blocks_in_gib(config.swap_memory, block_bytes * ranks)
    log.info(
        "model %s: %s, block %d tokens = %d bytes%s",
        config.model,
        geometry,
        config.block_size,
        block_bytes,
        f" a rank, {ranks} ranks" if ranks > 1 else "",
    )
    bs = config.block_size
    made = [DevicePools(geometry, bs, num_blocks, num_cpu_blocks, d) for d in devices]
    pools: Pools = made[0] if ranks == 1 else RankPools(made)
    calibration = pools.calibrate() if config.calibrate and num_cpu_blocks else None
    budget = None
    if calibration is not None:
        out_bw, in_bw = calibration.bandwidth_gbps()
        log.info("swap calibration: out %.2f GB/s, in %.2f GB/s", out_bw, in_bw)
        budget = calibration.swap_out.units_within(config.demote_at_eviction_ms / 1e3)
        if config.cpu_prefix_cache:
            log.info("demotions at eviction: at most %s blocks a batch of copies", budget)
    manager = KVCacheManager(
        num_blocks,
        num_cpu_blocks,
        config.block_size,
        config.admission_watermark,
        config.cpu_prefix_cache,
        budget,
    )
    manager.pricing.calibration = calibration
    service = KVService(
        manager,
        pools,
        config.lease_timeout_s,
        config.orphan_grace_s,
        write_back_ahead=config.write_back_ahead,
    )
    return service, pools
