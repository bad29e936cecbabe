"""Where a decode step's device time goes, kernel by kernel, against the byte roofline (H200).

Two sweeps on one GPU, each figure in GB/s of bytes that must be read (the same-run device copy
ceiling printed first):

- ``paged_decode`` over a pool shaped like the worker's (block-major, ``--layers`` layers, one of
  them read): every (BLOCK_N, warps, stages, grid order) of ``CONFIGS`` and split count, for
  the batch and context pairs asked for;
- the decoder's matrix products at decode batch sizes (``--shape 1b`` or ``8b``: the fused
  q/k/v, o, gate/up, down and lm_head weights), alone and as one layer stack in a CUDA graph
  (each layer its own weights, so nothing stays in L2), with torch's default BLAS and with
  cuBLASLt.

    python bench/decode_tune.py [--shape 1b] [--cases 128x600,64x600,128x2000] [--skip-gemm]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch.nn import functional
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.decode as kdecode
from bench.kernels import copy_bandwidth, fixed_config, graph_ms
from kernels import paged_decode

DEV = torch.device("cuda")
BF16 = torch.bfloat16
# (BLOCK_N, num_warps, num_stages, HEADS_FASTEST)
CONFIGS = [
    (64, 4, 3, 0),
    (64, 4, 3, 1),
    (32, 2, 3, 1),
    (32, 4, 3, 1),
    (64, 2, 3, 1),
    (64, 4, 4, 1),
    (128, 4, 3, 1),
    (128, 8, 3, 1),
    (16, 1, 4, 1),
    (16, 2, 4, 1),
    (32, 1, 3, 1),
    (64, 1, 3, 1),
    (64, 2, 2, 1),
    (64, 2, 4, 1),
    (128, 2, 2, 1),
    (128, 2, 3, 1),
]
# (q heads, kv heads, head dim, hidden, intermediate, layers)
SHAPES = {"1b": (32, 8, 64, 2048, 8192, 16), "8b": (32, 8, 128, 4096, 14336, 32)}
VOCAB = 128256


def decode_sweep(shape: str, cases: list[tuple[int, int]], layers: int) -> None:
    q_heads, kv_heads, d, *_ = SHAPES[shape]
    print(f"\n## paged_decode, {shape} heads {q_heads}/{kv_heads} d {d}, pool of {layers} layers")
    print("| B x ctx | BLOCK_N / warps / stages / heads fastest | " + " | ".join(
        f"{s} split{'s' if s > 1 else ''} GB/s" for s in SPLITS) + " |")  # fmt: skip
    print("|---|---|" + "---|" * len(SPLITS))
    original = kdecode.decode_config
    try:
        for batch, ctx in cases:
            decode_case(batch, ctx, q_heads, kv_heads, d, layers)
    finally:
        kdecode.decode_config = original


SPLITS = [1, 2, 4, 8, 16]


def decode_case(batch: int, ctx: int, q_heads: int, kv_heads: int, d: int, layers: int) -> None:
    """One table row per config of ``CONFIGS``: GB/s of K/V per split count."""
    per = -(-ctx // 16)
    blocks = batch * per
    pool = torch.randn((blocks, layers, 2, 16, kv_heads, d), device=DEV, dtype=BF16)
    tables = torch.randperm(blocks, device=DEV).view(batch, per).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn((batch, q_heads, d), device=DEV, dtype=BF16)
    out = torch.empty_like(q)
    nbytes = batch * ctx * 2 * kv_heads * d * 2

    def launch(splits: int) -> None:
        paged_decode(q, pool[:, 0, 0], pool[:, 0, 1], tables, lens, d**-0.5, splits, out)

    for bn, warps, stages, heads_fastest in CONFIGS:
        cfg = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
        cfg["HEADS_FASTEST"] = heads_fastest
        kdecode.decode_config = fixed_config(cfg)
        cells = []
        for sp in SPLITS:
            try:  # compiled outside the graph capture: a failure leaves no capture open
                launch(sp)
                torch.cuda.synchronize()
            except Exception as err:  # a config triton cannot build: its cell says so
                cells.append(type(err).__name__)
                continue
            ms = graph_ms(functools.partial(launch, sp))
            cells.append(f"{nbytes / ms / 1e6:.0f}")
        label = f"{bn} / {warps} / {stages} / {heads_fastest}"
        print(f"| {batch} x {ctx} | {label} | " + " | ".join(cells) + " |", flush=True)


def layer_products(shape: str) -> dict[str, tuple[int, int]]:
    """A decoder layer's products of ``shape`` in forward order: name -> (N, K) of its weight."""
    q_heads, kv_heads, d, hidden, inter, _ = SHAPES[shape]
    return {
        "qkv": ((q_heads + 2 * kv_heads) * d, hidden),
        "o": (hidden, q_heads * d),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def gemm_sweep(shape: str, batches: list[int]) -> None:
    hidden, layers = SHAPES[shape][3], SHAPES[shape][5]
    weights = layer_products(shape)
    stack = [
        {name: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02 for name, (n, k) in weights.items()}
        for _ in range(layers)
    ]
    head = torch.randn(VOCAB, hidden, device=DEV, dtype=BF16) * 0.02
    print(f"\n## products, {shape}: {weight_bytes(stack, head) / 1e9:.2f} GB of weights per step")
    print("| BLAS | M | " + " | ".join(weights) + " | lm_head | all layers + lm_head, graph "
          "(ms, GB/s) |")  # fmt: skip
    print("|---|---|" + "---|" * (len(weights) + 2))
    try:
        for blas in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(blas)
            for m in batches:
                cells = " | ".join(gemm_row(stack, head, m))
                print(f"| {blas} | {m} | {cells} |", flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def weight_bytes(stack: list[dict[str, torch.Tensor]], head: torch.Tensor) -> int:
    return sum(w.numel() * 2 for layer in stack for w in layer.values()) + head.numel() * 2


def gemm_row(stack: list[dict[str, torch.Tensor]], head: torch.Tensor, m: int) -> list[str]:
    """GB/s of each product of one layer and the lm_head alone (L2 flushed before each), then
    the whole step's products replayed as one CUDA graph."""
    xs = {name: torch.randn(m, w.shape[1], device=DEV, dtype=BF16) for name, w in stack[0].items()}
    x_head = torch.randn(m, head.shape[1], device=DEV, dtype=BF16)
    cells = []
    for name, w in [*stack[0].items(), ("lm_head", head)]:
        x = x_head if name == "lm_head" else xs[name]
        ms = float(do_bench(lambda w=w, x=x: functional.linear(x, w), return_mode="median"))
        cells.append(f"{w.numel() * 2 / ms / 1e6:.0f}")

    def step() -> None:
        for layer in stack:
            for name, w in layer.items():
                functional.linear(xs[name], w)
        functional.linear(x_head, head)

    ms = graph_ms(step)
    cells.append(f"{ms:.3f} ms, {weight_bytes(stack, head) / ms / 1e6:.0f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--cases", default="128x600,64x600,32x600,128x2000")
    parser.add_argument("--batches", default="16,64,128,256")
    parser.add_argument("--skip-gemm", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    args = parser.parse_args()
    print(f"device copy: {copy_bandwidth() / 1e9:.0f} GB/s (read + write)")
    if not args.skip_decode:
        cases = [(int(b), int(c)) for b, c in (x.split("x") for x in args.cases.split(","))]
        decode_sweep(args.shape, cases, SHAPES[args.shape][5])
    if not args.skip_gemm:
        gemm_sweep(args.shape, [int(m) for m in args.batches.split(",")])


if __name__ == "__main__":
    main()
