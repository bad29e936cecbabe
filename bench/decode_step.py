"""Device time of one pure-decode step (CUDA graph replay), against its byte roofline.

A random bf16 model of ``bench/serve.py``'s ``--shape`` (``1b``: Llama-3.2-1B, the default;
``8b``: Llama-3.1-8B) decodes a batch of ``--batch`` requests whose contexts are ``--context``
tokens, through ``ModelRunner`` (captured graphs, Triton kernels) over a local paged pool; CUDA
events around the replay alone time the device (no host gap inside). The roofline reads every
weight once and every request's K/V once at ``--copy-tb-s`` (the H200's measured device copy).

    python bench/decode_step.py [--shape 1b] [--batch 128 [B ...]] [--context 600]
        [--copy-tb-s 4.28]
        [--profile] [--blas cublaslt] [--unfused] [--prefill N [--graph-tokens M] [--host-profile]]

``--profile`` also lists the kernels of one replay (``torch.profiler``): device time and count
per kernel name, and how much of the replay is kernel time (the rest: gaps between kernels).

``--prefill N`` times a mixed step instead: the batch's decodes beside one prompt chunk of N
tokens, as the engine runs it (``ModelRunner.forward``: eagerly, or replaying graphs of mixed steps
with ``--graph-tokens``). It reports the host time to enqueue
the step, the device time from its first kernel to its last with the host ahead (the step
enqueued behind a sleeping kernel), and with ``--host-profile`` the functions that cost the
most host time (cProfile).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compute.model.attention  # noqa: F401  (registers the "paged" attention function)
from bench.shapes import SHAPES, build_model
from compute.model.runner import ModelRunner, ScheduledChunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="the model")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[128], help="one or more batch sizes (decode)"
    )
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--copy-tb-s", type=float, default=4.28)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="list the kernels of a replay")
    parser.add_argument(
        "--blas",
        choices=["cublas", "cublaslt"],
        default="cublas",
        help="the BLAS torch's matrix products use (torch.backends.cuda.preferred_blas_library)",
    )
    parser.add_argument(
        "--unfused", action="store_true", help="transformers' own norm and attention forwards"
    )
    parser.add_argument("--prefill", type=int, default=0, help="time a mixed step: N prompt tokens")
    parser.add_argument("--host-profile", action="store_true", help="cProfile the mixed step")
    parser.add_argument(
        "--graph-tokens", type=int, default=0, help="mixed step: CUDA graphs up to N tokens"
    )
    args = parser.parse_args()
    torch.backends.cuda.preferred_blas_library(args.blas)
    config = SHAPES[args.shape]()
    model = build_model(config, "paged", fused=not args.unfused)
    bs, layers = 16, int(config.num_hidden_layers)
    kv, d = config.num_key_value_heads or 8, config.head_dim or 64
    per_request = -(-(args.context + 1) // bs)
    largest = max(args.batch)
    if args.prefill and len(args.batch) > 1:
        parser.error("--prefill times one batch size")
    blocks = largest * per_request + 1
    prompt = -(-args.prefill // bs)  # the mixed step's prompt blocks
    pool = torch.zeros(blocks + prompt, layers, 2, bs, kv, d, dtype=torch.bfloat16, device="cuda")
    graphs = 0 if args.prefill else largest  # a mixed step replays no decode graph
    runner = ModelRunner(model, pool, bs, graphs, args.graph_tokens)
    batch = [
        ScheduledChunk(
            [1], args.context, list(range(1 + b * per_request, 1 + (b + 1) * per_request))
        )
        for b in range(largest)
    ]
    if args.prefill:
        chunk = ScheduledChunk([1] * args.prefill, 0, list(range(blocks, blocks + prompt)))
        mixed_step(runner, [*batch, chunk], args)
        if args.profile:
            print_kernels(lambda: runner.forward([*batch, chunk]), 0.0)
        return
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    for size in args.batch:
        step_ms = decode_step(runner, batch[:size], args.steps)
        kv_bytes = size * (args.context + 1) * layers * 2 * kv * d * 2
        roofline_ms = (weights + kv_bytes) / (args.copy_tb_s * 1e12) * 1e3
        print(
            f"decode step B={size} context={args.context}"
            f"{' unfused' if args.unfused else ''}: {step_ms:.3f} ms (median of "
            f"{args.steps} replays); roofline {roofline_ms:.3f} ms (weights "
            f"{weights / 1e9:.2f} GB + K/V {kv_bytes / 1e9:.2f} GB at {args.copy_tb_s} TB/s): "
            f"{step_ms / roofline_ms:.2f}x",
            flush=True,
        )
        if args.profile:
            graphs = runner.graphs
            assert graphs is not None
            print_kernels(functools.partial(graphs.replay, size), step_ms)


def decode_step(runner: ModelRunner, batch: list[ScheduledChunk], steps: int) -> float:
    """Median device ms of ``steps`` replays of the decode graph of ``batch``, loaded once."""
    for _ in range(3):
        runner.forward(batch)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    graphs = runner.graphs
    assert graphs is not None
    p = runner.pack(batch)
    tables = runner.tables.plan([None] * len(batch), [c.block_ids for c in batch], p.width)
    graphs.load(p.ids, p.positions, p.slots, tables, p.context_lens)
    for _ in range(steps):
        start.record()
        graphs.replay(len(batch))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def mixed_step(runner: ModelRunner, batch: list[ScheduledChunk], args: argparse.Namespace) -> None:
    """Host time to enqueue one eager mixed step, and its device time when the host is ahead."""
    import cProfile
    import pstats
    import time

    for _ in range(3):
        runner.forward(batch)
    torch.cuda.synchronize()
    host, device = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(args.steps):
        torch.cuda.synchronize()
        clock = time.perf_counter()
        runner.forward(batch)
        host.append((time.perf_counter() - clock) * 1e3)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the host enqueues far ahead
        start.record()
        runner.forward(batch)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    tokens = sum(len(c.token_ids) for c in batch)
    mode = f"mixed-step graphs to {args.graph_tokens} tokens" if args.graph_tokens else "eager"
    print(
        f"mixed step ({mode}): {len(batch) - 1} decodes (context {args.context}) + "
        f"{args.prefill} prompt tokens = {tokens} tokens: host enqueue "
        f"{sorted(host)[len(host) // 2]:.3f} ms, device {sorted(device)[len(device) // 2]:.3f} "
        f"ms (medians of {args.steps})"
    )
    if args.host_profile:
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            runner.forward(batch)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def print_kernels(replay: Callable[[], object], step_ms: float, replays: int = 10) -> None:
    """Device time per kernel name over ``replays`` replays (CUPTI sees kernels inside graphs)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            per_name.setdefault(event.name, []).append(event.device_time / 1e3)  # ms
    total = sum(sum(ts) for ts in per_name.values()) / replays
    print(
        f"kernels of one replay: {total:.3f} ms of kernel time in a {step_ms:.3f} ms replay "
        f"({sum(len(ts) for ts in per_name.values()) // replays} kernels)"
    )
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    for name, times in rows[:30]:
        ms = sum(times) / replays
        print(f"  {ms:7.3f} ms {100 * ms / total:5.1f}%  x{len(times) // replays:<4d} {name[:110]}")


if __name__ == "__main__":
    main()
