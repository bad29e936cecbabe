"""Copies of scattered KV blocks from one GPU's pool to another's, as the kvstore runs them
(``kvstore.peer_copy.PeerCopier``), by each route: ``push`` (one kernel on the source writing
the peer's pool), ``pull`` (one kernel on the destination reading it) and ``staged`` (gather into
the source's staging buffer, one peer copy, scatter), against one contiguous 256 MiB peer copy,
the link's ceiling in the same process.

Both pools are ``DevicePools`` of the 1B (0.5 MiB blocks) or 8B (2 MiB blocks) shape, 4096
blocks each; block ids drawn at random (as a pool's allocator hands them out after a while).
The median of 5 timed copies after a warm-up, two ways: ``ms`` as the daemon waits for it
(host wall time from the call to its synchronised end: the ids' upload, the launch, the kernel,
the wait) and ``GPU ms`` the kernel alone (``push``/``pull``: CUDA events around the same
``copy_blocks_between`` launch, ids already on the GPU), each against the 256 MiB copy timed the
same way.

``cpu`` (in ``--routes``) times the other path between pools: pool 0's CPU-tier blocks loaded
into pool 1's GPU (``PeerCopier.copy(..., tier="cpu")``, a prefix one GPU demoted serving a
request on the other), against pool 1 loading as many blocks from its own CPU tier (a swap-in).

    python bench/peer_copy.py --shape 8b [--sizes 1,4,16,64,256,1024]
        [--routes push,pull,staged,cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts.model_config import KVGeometry  # noqa: E402
from kvstore.device import DevicePools  # noqa: E402
from kvstore.peer_copy import CopyRoute, PeerCopier, random_pairs  # noqa: E402

GEOMETRY = {
    "1b": KVGeometry(16, 8, 64, "bfloat16"),
    "8b": KVGeometry(32, 8, 128, "bfloat16"),
}


def contiguous_gbps(
    src: torch.device, dst: torch.device, nbytes: int = 256 << 20
) -> tuple[float, float]:
    """One contiguous ``nbytes`` copy ``src`` -> ``dst``: GB/s by host wall time (synchronised)
    and by CUDA events on the destination's stream."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    times, gpu = [], []
    with torch.cuda.device(dst):
        for _ in range(6):
            torch.cuda.synchronize(src)
            torch.cuda.synchronize(dst)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            b.copy_(a)
            end.record()
            torch.cuda.synchronize(dst)
            times.append(time.perf_counter() - start)
            gpu.append(begin.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times[1:]) / 1e9, nbytes / statistics.median(gpu[1:]) / 1e9


def kernel_seconds(
    src: DevicePools, dst: DevicePools, pairs: list[tuple[int, int]], push: bool
) -> float:
    """The GPU time of one ``copy_blocks_between`` launch (median of 5 after a warm-up)."""
    from kernels import copy_blocks_between

    runner = src if push else dst
    ids = torch.tensor(pairs, dtype=torch.int64, device=runner.device).T.contiguous()
    times = []
    with torch.cuda.device(runner.device):
        for _ in range(6):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            copy_blocks_between(src.pool, dst.pool, ids[0], ids[1])
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(GEOMETRY), default="8b")
    parser.add_argument("--sizes", default="1,4,16,64,256,1024")
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--routes", default="push,pull,staged,cpu")
    args = parser.parse_args()
    geometry = GEOMETRY[args.shape]
    sizes = [int(x) for x in args.sizes.split(",")]
    cpu_blocks = max(sizes) if "cpu" in args.routes else 0
    src = DevicePools(geometry, 16, args.blocks, cpu_blocks, "cuda:0")
    dst = DevicePools(geometry, 16, args.blocks, cpu_blocks, "cuda:1")
    copier = PeerCopier([src, dst])
    src.pool.view(torch.int16).random_()  # random bits: every copy is checked bit for bit
    ceiling, gpu_ceiling = contiguous_gbps(src.device, dst.device)
    print(
        f"contiguous 256 MiB peer copy cuda:0 -> cuda:1: {ceiling:.0f} GB/s "
        f"({gpu_ceiling:.0f} GB/s by CUDA events)"
    )
    print(
        "| route | blocks | MiB | ms | GB/s | of the 256 MiB copy | GPU ms | of it, GPU times |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    routes: list[CopyRoute] = [r for r in ("push", "pull", "staged") if r in args.routes]
    for route in routes:
        gen = torch.Generator().manual_seed(0)
        for n in sizes:
            pairs = random_pairs(args.blocks, args.blocks, n, gen)
            copier.copy(0, 1, pairs, route)
            seconds = statistics.median(copier.copy(0, 1, pairs, route) for _ in range(5))
            want = src.pool[[s for s, _ in pairs]].view(torch.int16).to(dst.device)
            assert torch.equal(dst.pool[[d for _, d in pairs]].view(torch.int16), want), route
            gbps = n * src.block_bytes / seconds / 1e9
            mib = n * src.block_bytes / 2**20
            gpu = ""
            if route != "staged":
                on_gpu = kernel_seconds(src, dst, pairs, route == "push")
                gpu_gbps = n * src.block_bytes / on_gpu / 1e9
                gpu = f" {on_gpu * 1e3:.3f} | {gpu_gbps / gpu_ceiling:.2f} |"
            print(
                f"| {route} | {n} | {mib:.1f} | {seconds * 1e3:.3f} | {gbps:.0f} "
                f"| {gbps / ceiling:.2f} |{gpu or ' | |'}"
            )
    if cpu_blocks:
        cpu_tier_loads(copier, sizes, args.blocks)
    price = copier.calibrate()
    print(f"the kvstore's calibration: route {copier.route}, {price}")


def cpu_tier_loads(copier: PeerCopier, sizes: list[int], gpu_blocks: int) -> None:
    """Pool 0's CPU-tier blocks into pool 1's GPU, against pool 1's own swap-in of as many."""
    src, dst = copier.pools
    src.cpu_pool.view(torch.int16).random_()
    dst.cpu_pool.view(torch.int16).random_()
    print(
        "\n| CPU-tier blocks | MiB | from cuda:0's tier, ms | GB/s | own tier (swap-in), ms "
        "| GB/s |\n|---|---|---|---|---|---|"
    )
    gen = torch.Generator().manual_seed(1)
    for n in sizes:
        pairs = random_pairs(len(src.cpu_pool), gpu_blocks, n, gen)
        copier.copy(0, 1, pairs, tier="cpu")
        seconds = statistics.median(copier.copy(0, 1, pairs, tier="cpu") for _ in range(5))
        want = src.cpu_pool[[c for c, _ in pairs]].view(torch.int16).to(dst.device)
        assert torch.equal(dst.pool[[g for _, g in pairs]].view(torch.int16), want)
        dst.swap_in(pairs)
        own = statistics.median(dst.swap_in(pairs) for _ in range(5))
        nbytes = n * src.block_bytes
        print(
            f"| {n} | {nbytes / 2**20:.1f} | {seconds * 1e3:.3f} | {nbytes / seconds / 1e9:.1f} "
            f"| {own * 1e3:.3f} | {nbytes / own / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
