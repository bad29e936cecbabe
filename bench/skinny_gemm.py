"""An experiment: the decode step's small products through a split-K Triton kernel, against
cuBLAS (H200). Not used by the worker: it measured whether such a kernel is worth wiring in.

At decode batch sizes the q/k/v, o and down products have few output tiles for 132 SMs, and
cuBLAS runs them at 1.3-2 TB/s (1B, M=128) or 500-640 TFLOP/s (8B, M=256) (BENCHMARKS.md,
thirteenth pass). Here each product ``x @ w.T`` (x: [M, K], w: [N, K], bf16) is cut into
BLOCK_N-wide column tiles and SPLIT slices of K; every program keeps all M rows, so each
weight is read once. With SPLIT > 1 the fp32 partial sums go to a workspace that a second
kernel adds up and rounds. Every layer of the stack has its own weights, and the whole stack
is one CUDA graph (no L2 reuse between layers, no host gaps), as in the decode step. Each
config is checked against an fp32 torch product before it is timed.

Result (thirteenth pass): slower than cuBLAS everywhere but the 1B down product (0.92x); the
simple tiling is not the way to those products' ceilings.

    python bench/skinny_gemm.py [--shape 1b] [--batch 128 [M ...]]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_tune import SHAPES, layer_products
from bench.kernels import graph_ms
from kernels._tl_utils import mma

DEV, BF16 = torch.device("cuda"), torch.bfloat16
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU check: see kernels._tl_utils


@triton.jit
def _split_k_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N output columns over K slice ``program_id(1)``, every row."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    start = tl.program_id(1) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(start, start + k_per_split, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_ptr + cols[None, :] * K + ks[:, None])
        acc += mma(a, b, UPCAST)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if PARTIAL:
        base = out_ptr + tl.program_id(1) * M * N
        tl.store(base + rows[:, None] * N + cols[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=mask)


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, size, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=mask)


def split_k_linear(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, work: torch.Tensor, cfg: tuple
) -> None:
    """out = x @ w.T. cfg: (BLOCK_N, BLOCK_K, SPLIT, warps, stages); ``work`` holds
    SPLIT x M x N fp32 when SPLIT > 1."""
    block_n, block_k, split, warps, stages = cfg
    (m, k), n = x.shape, w.shape[0]
    assert n % block_n == 0 and k % (split * block_k) == 0 and m <= 256
    block_m = max(16, triton.next_power_of_2(m))
    target = work if split > 1 else out
    grid = (n // block_n, split)
    _split_k_kernel[grid](
        x, w, target, m, n, k, k // split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PARTIAL=split > 1, UPCAST=INTERPRET, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        _reduce_kernel[(triton.cdiv(m * n, 1024),)](work, out, m * n, SPLIT=split, BLOCK=1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--batch", type=int, nargs="+", default=[128], help="rows M, one or more")
    args = parser.parse_args()
    for m in args.batch:
        compare(args.shape, m)


def compare(shape: str, m: int) -> None:
    """Prints a table row per product of ``shape`` at ``m`` rows: cuBLAS against the best
    split-K config."""
    layers = SHAPES[shape][5]
    products = layer_products(shape)
    print(f"## {shape}, M={m}: a stack of {layers} layers per product, one CUDA graph")
    print("| product | cuBLAS us/layer (GB/s) | best split-K us/layer (GB/s) | config | ratio |")
    print("|---|---|---|---|---|")
    for name, (n, k) in products.items():
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) * 0.02 for _ in range(layers)]
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        out = torch.empty(m, n, device=DEV, dtype=BF16)
        nbytes = n * k * 2

        def cublas(x: torch.Tensor = x, ws: list[torch.Tensor] = ws) -> None:
            for w in ws:
                functional.linear(x, w)

        def ours(cfg: tuple, work: torch.Tensor, x: torch.Tensor = x, out: torch.Tensor = out,
                 ws: list[torch.Tensor] = ws) -> None:  # fmt: skip
            for w in ws:
                split_k_linear(x, w, out, work, cfg)

        base_ms = graph_ms(cublas)
        best: tuple[float, tuple] | None = None
        for cfg in itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), (4,), (4,)):
            block_n, block_k, split = cfg[:3]
            if n % block_n or k % (split * block_k) or (n // block_n) * split < 64:
                continue
            work = torch.empty(split, m, n, device=DEV, dtype=torch.float32)
            try:
                split_k_linear(x, ws[0], out, work, cfg)
                want = functional.linear(x.float(), ws[0].float())
                torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
                ms = graph_ms(functools.partial(ours, cfg, work), rep=50)
            except (AssertionError, RuntimeError, triton.runtime.errors.OutOfResources) as err:
                print(f"  {name} {cfg}: {type(err).__name__}", file=sys.stderr)
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        base_us = base_ms / layers * 1e3
        if best is None:
            print(f"| {name} {n}x{k} | {base_us:.1f} ({nbytes / base_us / 1e3:.0f}) | – | – | – |")
            continue
        us = best[0] / layers * 1e3
        print(
            f"| {name} {n}x{k} | {base_us:.1f} ({nbytes / base_us / 1e3:.0f}) | {us:.1f} "
            f"({nbytes / us / 1e3:.0f}) | {best[1]} | {us / base_us:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
