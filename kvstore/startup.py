"""The daemon's start-up: the pools allocated, their copies timed, the services wired under one
``Host``. ``kvstore.daemon`` runs it once its endpoint is bound."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from kvstore.host import Host, PeerCopyMode
from kvstore.manager import KVCacheManager
from kvstore.service import KVService

if TYPE_CHECKING:
    from kvstore.config import KVStoreConfig
    from kvstore.device import DevicePools

log = logging.getLogger("pagedserve.kvstore")


def disable_expandable_segments() -> None:
    """CUDA IPC cannot export memory from expandable segments: force them off before CUDA starts."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:
        log.warning("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; turning it off for IPC")
    parts = [x for x in conf.split(",") if x and not x.startswith("expandable_segments")]
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join([*parts, "expandable_segments:False"])


def build_host(config: KVStoreConfig) -> tuple[Host, list[DevicePools]]:
    """Removes dead daemons' pool files, allocates each pool (the slow part: progress is logged),
    times copies between them, and wires one service per pool under one ``Host``. Raises
    ValueError on a flag that makes no sense (memory sizes, dtype, pool count)."""
    from kvstore.peer_copy import PeerCopier

    if config.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size {config.data_parallel_size}: at least 1")
    built = [build_service(config, i) for i in range(config.data_parallel_size)]
    services, pools = [s for s, _ in built], [d for _, d in built]
    copier = PeerCopier(pools)
    price = None
    if len(pools) > 1 and config.peer_copy != "never":
        price = copier.calibrate()
    mode: PeerCopyMode = "auto"
    if config.peer_copy in ("always", "never"):
        mode = "always" if config.peer_copy == "always" else "never"
    devices = [str(d.device) for d in pools]
    return Host(services, devices, copier.copy, price, mode), pools


def build_service(config: KVStoreConfig, index: int = 0) -> tuple[KVService, DevicePools]:
    """Pool ``index`` of the host and its service."""
    disable_expandable_segments()
    from contracts.model_config import kv_geometry, load_config, resolve_device, resolve_dtype
    from kvstore.device import (
        SHM_DIR,
        DevicePools,
        blocks_for_memory,
        blocks_in_gib,
        remove_stale_pool_files,
    )

    device = resolve_device(config.device)
    if config.data_parallel_size > 1 and device.startswith("cuda"):
        if device != "cuda" and device != "cuda:0":
            raise ValueError(
                f"--device {config.device} with --data-parallel-size "
                f"{config.data_parallel_size}: pools go on cuda:0 to cuda:"
                f"{config.data_parallel_size - 1}; pick the GPUs with CUDA_VISIBLE_DEVICES"
            )
        device = f"cuda:{index}"
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
    geometry = kv_geometry(model_config, resolve_dtype(model_config, config.dtype, device))
    block_bytes = geometry.block_bytes(config.block_size)
    kv_memory = config.kv_memory
    if kv_memory == "auto":
        kv_memory = "0.5" if device.startswith("cuda") else "1GiB"
    num_blocks = blocks_for_memory(kv_memory, block_bytes, device)
    num_cpu_blocks = blocks_in_gib(config.swap_memory, block_bytes)
    log.info(
        "model %s: %s, block %d tokens = %d bytes",
        config.model,
        geometry,
        config.block_size,
        block_bytes,
    )
    pools = DevicePools(geometry, config.block_size, num_blocks, num_cpu_blocks, device)
    manager = KVCacheManager(
        num_blocks,
        num_cpu_blocks,
        config.block_size,
        config.admission_watermark,
        config.cpu_prefix_cache,
    )
    if config.calibrate and num_cpu_blocks:
        manager.pricing.calibration = pools.calibrate()
        if manager.pricing.calibration is not None:
            out_bw, in_bw = manager.pricing.calibration.bandwidth_gbps()
            log.info("swap calibration: out %.2f GB/s, in %.2f GB/s", out_bw, in_bw)
    service = KVService(
        manager,
        pools,
        config.lease_timeout_s,
        config.orphan_grace_s,
        write_back_ahead=config.write_back_ahead,
    )
    return service, pools
