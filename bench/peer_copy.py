"""Copies of scattered KV blocks from one GPU's pool to another's, as the kvstore runs them
(``kvstore.device.copy_between``: gather into the source's staging buffer, one peer copy,
scatter), against one contiguous 256 MiB peer copy, the link's ceiling in the same process.

Both pools are ``DevicePools`` of the 1B (0.5 MiB blocks) or 8B (2 MiB blocks) shape, 4096
blocks each; block ids drawn at random (as a pool's allocator hands them out after a while).
The median of 5 timed copies after a warm-up.

    python bench/peer_copy.py --shape 8b [--sizes 1,4,16,64,256,1024]
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
from kvstore.device import DevicePools, calibrate_copies, copy_between  # noqa: E402

GEOMETRY = {
    "1b": KVGeometry(16, 8, 64, "bfloat16"),
    "8b": KVGeometry(32, 8, 128, "bfloat16"),
}


def contiguous_gbps(src: torch.device, dst: torch.device, nbytes: int = 256 << 20) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    times = []
    for _ in range(6):
        torch.cuda.synchronize(src)
        torch.cuda.synchronize(dst)
        start = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(dst)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times[1:]) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(GEOMETRY), default="8b")
    parser.add_argument("--sizes", default="1,4,16,64,256,1024")
    parser.add_argument("--blocks", type=int, default=4096)
    args = parser.parse_args()
    geometry = GEOMETRY[args.shape]
    src = DevicePools(geometry, 16, args.blocks, 0, "cuda:0")
    dst = DevicePools(geometry, 16, args.blocks, 0, "cuda:1")
    ceiling = contiguous_gbps(src.device, dst.device)
    print(f"contiguous 256 MiB peer copy cuda:0 -> cuda:1: {ceiling:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    print("| blocks | MiB | ms | GB/s | of the 256 MiB copy |\n|---|---|---|---|---|")
    for n in (int(x) for x in args.sizes.split(",")):
        pairs = list(
            zip(
                torch.randperm(args.blocks, generator=gen)[:n].tolist(),
                torch.randperm(args.blocks, generator=gen)[:n].tolist(),
                strict=True,
            )
        )
        copy_between(src, dst, pairs)
        seconds = statistics.median(copy_between(src, dst, pairs) for _ in range(5))
        gbps = n * src.block_bytes / seconds / 1e9
        mib = n * src.block_bytes / 2**20
        print(f"| {n} | {mib:.1f} | {seconds * 1e3:.3f} | {gbps:.0f} | {gbps / ceiling:.2f} |")
    price = calibrate_copies(src, dst)
    print(f"the kvstore's calibration: {price}")


if __name__ == "__main__":
    main()
