"""An experiment: the decode step's layer products as a chain of Triton kernels launched with
programmatic dependent launch (PDL), each prefetching its weights into L2 before it waits for the
kernel before it, against cuBLAS (H200). Not used by the worker.

At M=128 the 1B layer products read their weights at 1.3-3.3 TB/s (BENCHMARKS.md, eighth pass):
each small product pays a fixed ~4-5 us of launch, ramp-up and tail. A kernel launched with PDL
starts while the kernel before it still runs (``griddepcontrol``); its weights do not depend on
that kernel, so it can ask for them at once and wait only before it reads the activations.

The chain is 16 (1B) or 32 (8B) layers of q/k/v, o, gate/up and down products, each layer its own
weights, one CUDA graph, then the lm_head through cuBLAS in every variant. Every config is
checked against an fp32 torch product, and a two-product PDL chain against its reference.

Result (fifteenth pass, 1B, M=128): cuBLAS 0.995 ms for the chain; these kernels 1.25 ms plain,
1.25 with PDL, 1.43-1.46 with the prefetch. Launch gaps inside a CUDA graph are not what the small
products lose, and the prefetch only adds traffic; not wired in.

    python bench/pdl_chain.py [--shape 1b] [--batch 128]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode_tune import SHAPES, VOCAB, layer_products
from bench.kernels import graph_ms

DEV, BF16 = torch.device("cuda"), torch.bfloat16
LINE = 64  # bf16 elements in a 128-byte line


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_LINES: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """out[:, cols] = x @ w[cols].T for one BLOCK_N slice of w's rows, every row of x."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:  # the weights never come from the kernel before: ask for them first
        lines = tl.arange(0, K_LINES) * 64
        _prefetch_l2(w_ptr + cols[:, None] * K + lines[None, :])
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_ptr + cols[None, :] * K + ks[:, None])
        acc += tl.dot(a, b)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=mask)


def linear(
    x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: tuple[int, int, int, int],
    pdl: bool, prefetch: bool,
) -> None:  # fmt: skip
    """out = x @ w.T. cfg: (BLOCK_N, BLOCK_K, warps, stages)."""
    block_n, block_k, warps, stages = cfg
    (m, k), n = x.shape, w.shape[0]
    assert n % block_n == 0 and k % block_k == 0 and k % LINE == 0 and m <= 256
    assert not prefetch or can_prefetch(k), f"prefetch needs K / {LINE} a power of two, not {k}"
    assert x.is_contiguous() and w.is_contiguous() and out.is_contiguous()
    _linear_kernel[(n // block_n,)](
        x, w, out, m, n, k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n,
        BLOCK_K=block_k, K_LINES=k // LINE, USE_PDL=pdl, PREFETCH=prefetch, num_warps=warps,
        num_stages=stages, launch_pdl=pdl,
    )  # fmt: skip


def can_prefetch(k: int) -> bool:
    """The prefetch's line count, ``k / LINE``, is one ``tl.arange``: a power of two."""
    lines = k // LINE
    return lines & (lines - 1) == 0


def stack(
    x: torch.Tensor, ws: list[torch.Tensor], out: torch.Tensor | None,
    cfg: tuple[int, int, int, int] | None,
) -> None:  # fmt: skip
    """``x @ w.T`` for every ``w``: through ``linear`` with ``cfg``, or cuBLAS without."""
    for w in ws:
        if out is None or cfg is None:
            functional.linear(x, w)
        else:
            linear(x, w, out, cfg, False, False)


def best_config(n: int, k: int, m: int, layers: int) -> tuple[tuple[int, int, int, int], float]:
    """The fastest plain (no PDL, no prefetch) config over a stack of ``layers`` weights."""
    ws = [torch.randn(n, k, device=DEV, dtype=BF16) * 0.02 for _ in range(layers)]
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    out = torch.empty(m, n, device=DEV, dtype=BF16)
    want = functional.linear(x.float(), ws[0].float())
    best: tuple[tuple[int, int, int, int], float] | None = None
    for cfg in itertools.product((16, 32, 64), (64, 128), (4,), (3, 5)):
        if n % cfg[0] or k % cfg[1]:
            continue
        try:
            linear(x, ws[0], out, cfg, False, False)
            torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
            ms = graph_ms(functools.partial(stack, x, ws, out, cfg), 50)
        except (AssertionError, RuntimeError, triton.runtime.errors.OutOfResources) as err:
            print(f"  {n}x{k} {cfg}: {type(err).__name__}", file=sys.stderr)
            continue
        if best is None or ms < best[1]:
            best = (cfg, ms)
    assert best is not None, f"no config ran for {n}x{k}"
    return best


def check_pdl_chain(cfg: tuple[int, int, int, int], m: int, hidden: int) -> None:
    """y2 = (x @ w1.T) @ w2.T with both products launched with PDL and prefetch: the second
    must read the first's finished output."""
    x = torch.randn(m, hidden, device=DEV, dtype=BF16)
    w1, w2 = (torch.randn(hidden, hidden, device=DEV, dtype=BF16) * 0.02 for _ in range(2))
    y1, y2 = (torch.empty(m, hidden, device=DEV, dtype=BF16) for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        linear(x, w1, y1, cfg, True, True)
        linear(y1, w2, y2, cfg, True, True)
    for _ in range(3):
        y1.zero_()
        y2.zero_()
        graph.replay()
        want = functional.linear(
            functional.linear(x.float(), w1.float()).bfloat16().float(), w2.float()
        )
        torch.testing.assert_close(y2.float(), want, atol=2e-2, rtol=2e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--batch", type=int, default=128, help="rows M")
    args = parser.parse_args()
    m, layers, hidden = args.batch, SHAPES[args.shape][5], SHAPES[args.shape][3]
    shapes = layer_products(args.shape)
    configs = {}
    print(f"## {args.shape}, M={m}: best plain config per product (stack of {layers})")
    for name, (n, k) in shapes.items():
        cfg, ms = best_config(n, k, m, layers)
        configs[name] = cfg
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) for _ in range(layers)]
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        base = graph_ms(functools.partial(stack, x, ws, None, None), 50)
        gbs = n * k * 2 * layers / ms / 1e6
        print(f"- {name} {n}x{k}: {cfg} {ms / layers * 1e3:.1f} us/layer ({gbs:.0f} GB/s); "
              f"cuBLAS {base / layers * 1e3:.1f} us/layer", flush=True)  # fmt: skip
    check_pdl_chain(configs["o"], m, hidden)
    print("PDL chain check: passed", flush=True)

    weights = [
        {name: torch.randn(n, k, device=DEV, dtype=BF16) * 0.02 for name, (n, k) in shapes.items()}
        for _ in range(layers)
    ]
    lm_head = torch.randn(VOCAB, hidden, device=DEV, dtype=BF16) * 0.02
    ins = {name: torch.randn(m, k, device=DEV, dtype=BF16) for name, (n, k) in shapes.items()}
    outs = {name: torch.empty(m, n, device=DEV, dtype=BF16) for name, (n, k) in shapes.items()}
    nbytes = sum(n * k * 2 for n, k in shapes.values()) * layers + VOCAB * hidden * 2

    def chain(step: Callable[[str, torch.Tensor], None]) -> Callable[[], None]:
        def run() -> None:
            for layer in weights:
                for name, w in layer.items():
                    step(name, w)
            functional.linear(ins["qkv"][:, :hidden], lm_head)

        return run

    def cublas(name: str, w: torch.Tensor) -> None:
        torch.matmul(ins[name], w.t(), out=outs[name])

    variants: dict[str, Callable[[], None]] = {"cuBLAS": chain(cublas)}
    prefetches = (False, True) if all(can_prefetch(k) for _, k in shapes.values()) else (False,)
    for pdl, prefetch in itertools.product((False, True), prefetches):

        def ours(name: str, w: torch.Tensor, pdl: bool = pdl, prefetch: bool = prefetch) -> None:
            linear(ins[name], w, outs[name], configs[name], pdl, prefetch)

        variants[f"Triton pdl={pdl} prefetch={prefetch}"] = chain(ours)
    print(f"\n## the chain: {layers} layers + lm_head, {nbytes / 1e9:.2f} GB, one CUDA graph")
    print("| variant | ms (rounds) | TB/s |")
    print("|---|---|---|")
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):  # alternate the variants
        for name, fn in variants.items():
            results[name].append(graph_ms(fn, 50))
    for name, times in results.items():
        best = min(times)
        print(f"| {name} | {' / '.join(f'{t:.3f}' for t in times)} | {nbytes / best / 1e9:.2f} |")


if __name__ == "__main__":
    main()
