"""Swap bandwidth of the kvstore's CPU tier against a pinned 1 GiB copy in the same run (CUDA).

For Llama-3.2-1B- and Llama-3.1-8B-shaped pools (bf16, block 16): swap-out and swap-in of 1 GiB
worth of blocks from random GPU block ids, to consecutive CPU ids (what the allocator hands out)
and to a random half of a CPU tier twice that size (fragmented: runs of ~2 blocks).

    python bench/swap.py
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contracts.model_config import KVGeometry
from kvstore.device import DevicePools

GiB = 1 << 30
SHAPES = {
    "Llama-3.2-1B": KVGeometry(num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16"),
    "Llama-3.1-8B": KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16"),
}


def median_s(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pinned_baseline() -> tuple[float, float]:
    """GB/s of one 1 GiB pinned copy, device->host and host->device."""
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    d2h = GiB / median_s(lambda: host.copy_(dev, non_blocking=True)) / 1e9
    h2d = GiB / median_s(lambda: dev.copy_(host, non_blocking=True)) / 1e9
    return d2h, h2d


def main() -> None:
    d2h, h2d = pinned_baseline()
    print(
        f"# {time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} torch {torch.__version__}"
        f" host {platform.node()}"
    )
    print(f"# pinned 1 GiB copy: device->host {d2h:.1f} GB/s, host->device {h2d:.1f} GB/s")
    print("| pool | block | CPU ids | swap-out GB/s | % of pinned | swap-in GB/s | % of pinned |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, geometry in SHAPES.items():
        bench_shape(name, geometry, d2h, h2d, gen)
        torch.cuda.empty_cache()


def bench_shape(
    name: str, geometry: KVGeometry, d2h: float, h2d: float, gen: torch.Generator
) -> None:
    block_bytes = geometry.block_bytes(16)
    n = GiB // block_bytes
    pools = DevicePools(geometry, 16, num_blocks=4 * n, num_cpu_blocks=2 * n, device="cuda")
    pools.pool.normal_()
    gpu_ids = torch.randperm(4 * n, generator=gen)[:n].tolist()
    fragmented = torch.randperm(2 * n, generator=gen)[:n].tolist()  # gaps: runs of ~2 blocks
    for layout, cpu_ids in (("consecutive", list(range(n))), ("fragmented", fragmented)):
        out_pairs = list(zip(gpu_ids, cpu_ids, strict=True))
        in_pairs = [(c, g) for g, c in out_pairs]
        out_bw = n * block_bytes / median_s(partial(pools.swap_out, out_pairs)) / 1e9
        in_bw = n * block_bytes / median_s(partial(pools.swap_in, in_pairs)) / 1e9
        print(
            f"| {name} | {block_bytes / 2**20:.1f} MiB | {layout} | {out_bw:.1f} | "
            f"{100 * out_bw / d2h:.0f}% | {in_bw:.1f} | {100 * in_bw / h2d:.0f}% |"
        )
    ids = gpu_ids[:64]
    before = pools.pool[ids].clone()
    pools.swap_out(list(zip(ids, range(64), strict=True)))
    pools.pool[ids] = float("nan")
    pools.swap_in(list(zip(range(64), ids, strict=True)))
    assert torch.equal(pools.pool[ids], before), "swap round trip changed bytes"
    cal = pools.calibrate()
    assert cal is not None
    out_gbps, in_gbps = cal.bandwidth_gbps()
    print(
        f"# {name} calibration fit: out {cal.swap_out.fixed_s * 1e6:.0f} µs + "
        f"{cal.swap_out.per_unit_s * 1e6:.1f} µs/block ({out_gbps:.1f} GB/s); in "
        f"{cal.swap_in.fixed_s * 1e6:.0f} µs + {cal.swap_in.per_unit_s * 1e6:.1f} µs/block "
        f"({in_gbps:.1f} GB/s)"
    )


if __name__ == "__main__":
    main()
