"""Kernel benchmark on one GPU: paged decode / prefill / store_kv against same-run baselines.

    PYTHONPATH=$PWD python bench/kernels.py [--sweep] [--log FILE]

Baselines, all measured in this run: a device-to-device copy (2 GiB, bytes read + written over
time); torch SDPA decode over a contiguous [B, H, ctx, D] cache (GQA via enable_gqa, or with
K/V expanded to the query heads: whichever is faster, named in the table); SDPA (flash backend
forced) prefill over contiguous tensors with K/V expanded to the query heads. Times are
triton.testing.do_bench medians (it flushes L2 before each call); decode and store_kv inputs
rotate among several copies when one copy would fit in L2.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.decode as kdecode
import kernels.prefill as kprefill
from kernels import copy_blocks, paged_decode, paged_prefill, store_kv

DEV = torch.device("cuda")
BF16 = torch.bfloat16
L2_BYTES = 60 << 20
NUM_LAYERS = 2  # the pool's block stride spans 2 layers x (K, V)
LINES: list[str] = []
T = TypeVar("T")


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def bench_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """Eager: median of event-timed calls (L2 flushed before each); includes launch gaps when
    the host launches slower than the GPU runs."""
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def graph_ms(fn: Callable[[], object], rep: int = 100) -> float:
    """GPU time: median over replays of a CUDA graph of many unrolled calls (no host gaps).
    do_bench_cudagraph runs on a side stream: finish the default stream's setup work first."""
    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def launcher_cpu_us(fn: Callable[[], object], n: int = 2000) -> float:
    """Host time per call of a launcher on a tiny problem (GPU never the bottleneck)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def rotating(make: Callable[[], T], nbytes: int) -> list[T]:
    """Enough independent input sets that cycling through them never hits L2."""
    return [make() for _ in range(max(1, math.ceil(4 * L2_BYTES / max(nbytes, 1))))]


def cycle(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    state = [0]

    def run() -> object:
        state[0] = (state[0] + 1) % len(fns)
        return fns[state[0]]()

    return run


def copy_bandwidth() -> float:
    """Device copy ceiling in bytes/s (read + write), 2 GiB."""
    src = torch.randn(1 << 30, device=DEV, dtype=BF16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * (2 << 30) / (ms * 1e-3)


def paged_setup(
    batch: int, ctx: int, kv_heads: int, head_dim: int, block_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool holding B requests of ctx tokens in randomly permuted blocks (one layer used)."""
    per_req = math.ceil(ctx / block_size)
    num_blocks = batch * per_req
    pool = torch.randn(
        (num_blocks, NUM_LAYERS, 2, block_size, kv_heads, head_dim), device=DEV, dtype=BF16
    )
    tables = torch.randperm(num_blocks, device=DEV).view(batch, per_req).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return pool, tables, lens


def decode_case(
    batch: int,
    ctx: int,
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    splits: int | None = None,
    eager: bool = True,
) -> tuple[float, float, int]:
    """(eager ms, graph ms, K/V bytes) of paged_decode over rotating pools (eager 0 if skipped)."""
    kv_bytes = batch * ctx * 2 * kv_heads * head_dim * 2
    sets = rotating(lambda: paged_setup(batch, ctx, kv_heads, head_dim), kv_bytes)
    q = torch.randn((batch, q_heads, head_dim), device=DEV, dtype=BF16)
    fns = [
        (
            lambda p=p, t=t, c=c: paged_decode(
                q, p[:, 1, 0], p[:, 1, 1], t, c, head_dim**-0.5, num_splits=splits
            )
        )
        for p, t, c in sets
    ]
    run = cycle(fns)
    ms = bench_ms(run) if eager else 0.0
    gms = graph_ms(run)
    del sets, fns, run
    return ms, gms, kv_bytes


def sdpa_decode(
    batch: int, ctx: int, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128
) -> tuple[float, float, str]:
    """Best (by graph time) of SDPA(enable_gqa) and SDPA(expanded K/V) over a contiguous cache:
    (eager ms, graph ms, which)."""
    kv_bytes = batch * ctx * 2 * kv_heads * head_dim * 2
    q = torch.randn((batch, q_heads, 1, head_dim), device=DEV, dtype=BF16)
    best = (float("inf"), float("inf"), "")

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.randn((batch, kv_heads, ctx, head_dim), device=DEV, dtype=BF16),
            torch.randn((batch, kv_heads, ctx, head_dim), device=DEV, dtype=BF16),
        )

    sets = rotating(make, kv_bytes)
    gqa = [
        (lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) for k, v in sets
    ]
    run = cycle(gqa)
    best = min(best, (graph_ms(run), bench_ms(run), "gqa"))
    group = q_heads // kv_heads
    if kv_bytes * group <= 40 << 30:
        exp = [(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for k, v in sets]
        fns = [(lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v)) for k, v in exp]
        run = cycle(fns)
        best = min(best, (graph_ms(run), bench_ms(run), "expanded"))
        del exp, fns, run
    del sets, gqa
    return best[1], best[0], best[2]


def prefill_flops(q_lens: list[int], ctxs: list[int], q_heads: int, head_dim: int) -> float:
    """Useful FLOPs: 4 * D per (query head, visible key) pair (QK^T and PV)."""
    pairs = sum(q * (c - q) + q * (q + 1) / 2 for q, c in zip(q_lens, ctxs, strict=True))
    return 4.0 * head_dim * q_heads * pairs


def prefill_case(
    batch: int,
    q_len: int,
    cached: int,
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    baseline: bool = True,
) -> tuple[float, float]:
    """(ms of paged_prefill, ms of SDPA flash) for B chunks of q_len over `cached` tokens."""
    ctx = cached + q_len
    pool, tables, lens = paged_setup(batch, ctx, kv_heads, head_dim)
    q = torch.randn((batch * q_len, q_heads, head_dim), device=DEV, dtype=BF16)
    cu = torch.arange(0, batch + 1, device=DEV, dtype=torch.int32) * q_len
    scale = head_dim**-0.5
    ms = bench_ms(
        lambda: paged_prefill(
            q, pool[:, 1, 0], pool[:, 1, 1], tables, cu, lens, scale, max_query_len=q_len
        )
    )
    if not baseline:
        return ms, 0.0
    qs = torch.randn((batch, q_heads, q_len, head_dim), device=DEV, dtype=BF16)
    ks = torch.randn((batch, q_heads, ctx, head_dim), device=DEV, dtype=BF16)
    vs = torch.randn((batch, q_heads, ctx, head_dim), device=DEV, dtype=BF16)
    mask = causal_lower_right(q_len, ctx)
    if cached == 0:

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    else:

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)

    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            base = bench_ms(sdpa)
    except RuntimeError as exc:  # flash refused: say so, time the default dispatch
        say(f"SDPA flash refused ({exc}); timing the default backend")
        base = bench_ms(sdpa)
    return ms, base


def store_case(tokens: int, kv_heads: int = 8, head_dim: int = 128) -> float:
    """store_kv bandwidth (bytes read + written per second), random distinct slots."""
    num_blocks = 2 * tokens // 16
    pool = torch.randn((num_blocks, NUM_LAYERS, 2, 16, kv_heads, head_dim), device=DEV, dtype=BF16)
    key = torch.randn((tokens, kv_heads, head_dim), device=DEV, dtype=BF16)
    val = torch.randn_like(key)
    slots = torch.randperm(num_blocks * 16, device=DEV)[:tokens]
    ms = bench_ms(lambda: store_kv(key, val, pool[:, 0, 0], pool[:, 0, 1], slots))
    return 2 * 2 * key.numel() * 2 / (ms * 1e-3)


def copy_blocks_case(pairs: int, kv_heads: int = 8, head_dim: int = 128) -> float:
    pool = torch.randn((2 * pairs, 16, 2, 16, kv_heads, head_dim), device=DEV, dtype=BF16)
    perm = torch.randperm(2 * pairs, device=DEV)
    src, dst = perm[:pairs].clone(), perm[pairs:].clone()
    ms = bench_ms(lambda: copy_blocks(pool, src, dst))
    return 2 * pairs * pool[0].numel() * 2 / (ms * 1e-3)


class TileConfig(Protocol):
    """``kernels.decode.decode_config`` and ``kernels.prefill.prefill_config``."""

    def __call__(self, head_dim: int, group: int) -> dict[str, int]: ...


def fixed_config(cfg: dict[str, int]) -> TileConfig:
    """A stand-in for a kernel's tile config: always ``cfg``."""

    def config(head_dim: int, group: int) -> dict[str, int]:
        return cfg

    return config


def sweep_decode_configs() -> None:
    say("\n## decode tile sweep (GB/s, graph-timed; 32/8 heads, d 128, bf16, block 16)")
    orig = kdecode.decode_config
    configs = [(64, 4, 3), (64, 4, 4), (64, 4, 5), (128, 4, 3), (128, 8, 3), (32, 2, 3), (32, 4, 4)]
    say("| BLOCK_N | warps | stages | B=64 ctx 4096 (1 split) | B=1 ctx 32768 (heuristic) |")
    say("|---|---|---|---|---|")
    for bn, w, st in configs:
        cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
        kdecode.decode_config = fixed_config(cfg)
        _, g1, b1 = decode_case(64, 4096, splits=1, eager=False)
        _, g2, b2 = decode_case(1, 32768, eager=False)
        say(f"| {bn} | {w} | {st} | {b1 / g1 / 1e6:.0f} | {b2 / g2 / 1e6:.0f} |")
    kdecode.decode_config = orig


def sweep_splits() -> None:
    say("\n## split sweep (GB/s, graph-timed; 32/8 heads, d 128); * = heuristic's choice")
    splits = [1, 2, 4, 8, 16, 32, 64, 128]
    say("| B | ctx | " + " | ".join(str(s) for s in splits) + " |")
    say("|---|---|" + "---|" * len(splits))
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    bn = kdecode.decode_config(128, 4)["BLOCK_N"]
    for batch, ctx in [
        (1, 4096),
        (1, 32768),
        (1, 131072),
        (4, 8192),
        (4, 32768),
        (16, 2048),
        (16, 16384),
        (32, 4096),
        (48, 8192),
        (64, 1024),
    ]:
        choice = kdecode.choose_num_splits(batch, 8, ctx, sms, bn)
        row = []
        for sp in splits:
            per_split = max(math.ceil(math.ceil(ctx / sp) / bn) * bn, 2 * bn)  # the kernel's
            if math.ceil(ctx / per_split) != sp:  # the context would not use every split
                row.append("-")
                continue
            _, gms, nbytes = decode_case(batch, ctx, splits=sp, eager=False)
            row.append(f"{nbytes / gms / 1e6:.0f}" + ("*" if sp == choice else ""))
        say(f"| {batch} | {ctx} | " + " | ".join(row) + " |")


PREFILL_SHAPES = [(32, 8, 128), (32, 32, 128), (32, 8, 64), (32, 8, 256)]
PREFILL_CONFIGS = {
    64: [(128, 64, 4, 3), (256, 64, 8, 3), (256, 64, 4, 3), (256, 128, 8, 3), (128, 128, 8, 3)],
    128: [
        (128, 64, 8, 3),
        (256, 64, 8, 3),
        (256, 64, 8, 2),
        (256, 32, 8, 3),
        (256, 128, 8, 2),
        (128, 128, 8, 3),
    ],
    256: [(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3)],
}


def sweep_prefill_configs() -> None:
    say("\n## prefill tile sweep (TFLOP/s, 8 x 2048 new over 2048 cached, bf16)")
    orig = kprefill.prefill_config
    say("| heads q/kv | d | BLOCK_M | BLOCK_N | warps | stages | TFLOP/s |")
    say("|---|---|---|---|---|---|---|")
    for hq, hkv, d in PREFILL_SHAPES:
        flops = prefill_flops([2048] * 8, [4096] * 8, hq, d)
        for bm, bn, w, st in PREFILL_CONFIGS[d]:
            kprefill.prefill_config = fixed_config(
                {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
            )
            try:
                ms, _ = prefill_case(8, 2048, 2048, hq, hkv, d, baseline=False)
                res = f"{flops / ms / 1e9:.0f}"
            except Exception as exc:  # e.g. out of shared memory
                res = f"failed: {type(exc).__name__}"
            say(f"| {hq}/{hkv} | {d} | {bm} | {bn} | {w} | {st} | {res} |")
    kprefill.prefill_config = orig


def launcher_overheads() -> list[str]:
    """Host microseconds per launcher call on tiny inputs."""
    pool, tables, lens = paged_setup(1, 64, 8, 128)
    k, v = pool[:, 1, 0], pool[:, 1, 1]
    q = torch.randn((1, 32, 128), device=DEV, dtype=BF16)
    cu = torch.tensor([0, 1], device=DEV, dtype=torch.int32)
    slots = torch.arange(1, device=DEV)
    kv1 = torch.randn((1, 8, 128), device=DEV, dtype=BF16)
    one = torch.ones(1, dtype=torch.int64, device=DEV)
    calls: dict[str, Callable[[], object]] = {
        "paged_decode 1 split": lambda: paged_decode(q, k, v, tables, lens, 0.1, 1),
        "paged_decode 2 splits": lambda: paged_decode(q, k, v, tables, lens, 0.1, 2),
        "paged_prefill": lambda: paged_prefill(q, k, v, tables, cu, lens, 0.1, max_query_len=1),
        "store_kv": lambda: store_kv(kv1, kv1, k, v, slots),
        "copy_blocks": lambda: copy_blocks(pool, one - 1, one),
    }
    return [f"{name} {launcher_cpu_us(fn):.1f}" for name, fn in calls.items()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--sweep",
        default="",
        help="comma list of sweeps to run first: decode_tiles, splits, prefill_tiles",
    )
    parser.add_argument("--log", type=Path, default=None)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    say(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    sweeps = {
        "decode_tiles": sweep_decode_configs,
        "splits": sweep_splits,
        "prefill_tiles": sweep_prefill_configs,
    }
    for name in filter(None, args.sweep.split(",")):
        sweeps[name]()
    copy_bw = copy_bandwidth()
    say(f"\nlauncher host us/call: {'; '.join(launcher_overheads())}")
    say("\n## decode (32/8 heads, d 128, bf16, block 16): K/V bytes read / time")
    say(
        "| B x ctx | splits | ours graph GB/s | ours eager | 1-split graph | SDPA graph | "
        "SDPA eager | ours/SDPA graph | ours/SDPA eager | ours graph/copy | ours eager/copy |"
    )
    say("|---|---|---|---|---|---|---|---|---|---|---|")
    sms = props.multi_processor_count
    for batch, ctx in [(64, 4096), (256, 1024), (1, 32768), (8, 131072)]:
        splits = kdecode.choose_num_splits(
            batch, 8, ctx, sms, kdecode.decode_config(128, 4)["BLOCK_N"]
        )
        ms, gms, nbytes = decode_case(batch, ctx)
        _, g1, _ = decode_case(batch, ctx, splits=1, eager=False)
        base_ms, base_gms, which = sdpa_decode(batch, ctx)

        def gb(t: float, nbytes: int = nbytes) -> float:
            return nbytes / (t * 1e-3) / 1e9

        say(
            f"| {batch} x {ctx} | {splits} | {gb(gms):.0f} | {gb(ms):.0f} | {gb(g1):.0f} | "
            f"{gb(base_gms):.0f} ({which}) | {gb(base_ms):.0f} | {base_gms / gms:.2f} | "
            f"{base_ms / ms:.2f} | {gb(gms) * 1e9 / copy_bw:.2f} | {gb(ms) * 1e9 / copy_bw:.2f} |"
        )
    say("\n## prefill 8 x 2048 new tokens (32/8 heads, d 128, bf16), eager do_bench")
    say("| cached | ours TFLOP/s | SDPA flash TFLOP/s (K/V expanded to 32 heads) | ours/SDPA |")
    say("|---|---|---|---|")
    for cached in (0, 2048):
        ms, base = prefill_case(8, 2048, cached)
        fl = prefill_flops([2048] * 8, [2048 + cached] * 8, 32, 128)
        kind = "is_causal" if cached == 0 else "causal_lower_right"
        say(
            f"| {cached} | {fl / ms / 1e9:.0f} | {fl / base / 1e9:.0f} ({kind}) | {base / ms:.2f} |"
        )
    say("\n## cache ops (bytes read + written / time), eager do_bench")
    say(f"device copy 2 GiB: {copy_bw / 1e9:.0f} GB/s")
    bw = store_case(65536)
    say(f"store_kv 65536 tokens x 8 x 128: {bw / 1e9:.0f} GB/s = {bw / copy_bw:.2f} x copy")
    bw = copy_blocks_case(1024)
    say(f"copy_blocks 1024 x 1 MiB blocks: {bw / 1e9:.0f} GB/s = {bw / copy_bw:.2f} x copy")
    if args.log:
        args.log.write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
