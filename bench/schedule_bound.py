"""The device time a workload needs at given kernel ceilings, step by step as the scheduler
composes its steps. CPU only: a model, fed with ceilings measured on the GPU.

The requests are those of ``bench/http_serve.py`` (``pagedserve bench --seed 0``: prompts
64-1024 tokens, outputs 32-512). Steps are composed as ``compute.batch.scheduler.Scheduler`` does:
every running request that has its prompt decodes one token, then prompt chunks first come,
first served, within ``--max-num-batched-tokens``; at most ``--max-num-seqs`` run, and a
request that finishes makes room for the next. Each step costs

- its matrix products: ``2 x non-embedding weights x tokens`` FLOPs at ``--products-tflops``,
  or a read of every weight at ``--copy-tb-s``, whichever is longer;
- the lm_head on the sampled rows, at ``--products-tflops``;
- its decodes' attention: every decode reads its context's K and V at ``--attention-tb-s``;
- the padding of the CUDA graph it replays: a decode-only step of at most ``--graph-batch``
  requests runs its products over its decode graph's batch bucket (``compute.model.graphs``), any
  other step of at most ``--graph-tokens`` tokens over its mixed graph's token bucket
  (``compute.model.mixed_graphs``); the padded rows' products are priced as ``padding``. Larger
  steps run eagerly, unpadded.

Everything else (norms, rotary, activations, prompt attention, gaps between kernels, host time)
is left out: the figure is a bound the kernels as measured cannot beat, and the distance of a
measured run from it is what those parts and the schedule's shape cost. The seconds and steps
are also split by the forward path the worker would take (decode graph, mixed graph, eager), to
set beside the worker's own split (``bench/serve.py``'s ``device_by_path``).

The products' rate is the one thing a long run does not hold at its burst value: a run that
keeps the tensor cores busy for seconds reaches the board's power limit, and the GPU lowers its
SM clock (``bench/sustained.py``: ~670 TFLOP/s held on the H200 against ~790 in a burst).

    python bench/schedule_bound.py --shape 8b --requests 1000 --products-tflops 760 \\
        --attention-tb-s 4.2 [--graph-tokens 2048 --graph-batch 256]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.shapes import SHAPES, save_word_level_tokenizer, workload
from compute.model.graphs import bucket_sizes
from compute.model.mixed_graphs import token_buckets


def bound(
    jobs: list[tuple[int, int]],
    max_seqs: int,
    budget: int,
    flops: tuple[float, float],
    kv_bytes: float,
    rates: tuple[float, float, float],
    graphs: tuple[list[int], list[int]] = ([], []),
    prefill_interval: int = 1,
) -> dict[str, float]:
    """Seconds per part for ``jobs`` (prompt length, output length). ``flops``: FLOPs per token
    of the products and of the lm_head; ``kv_bytes``: K and V bytes per context token (all
    layers); ``rates``: (FLOP/s of products, bytes/s of a weight read, bytes/s of attention);
    ``graphs``: the batch buckets of decode graphs and the token buckets of mixed graphs, each
    ascending (none: every step unpadded); ``prefill_interval``: a step with decodes carries
    prompt chunks only if the ``prefill_interval - 1`` steps before it carried none (the
    scheduler's). Also counts ``steps`` and ``padded_tokens``, the seconds and steps of each
    forward path the worker would take (``decode_s``, ``decode_steps``: a decode graph;
    ``mixed_*``: a mixed graph; ``eager_*``: no graph fits), and ``itl_p50``: the median of
    the steps' seconds over the tokens they decode (a request's inter-token gap is its step)."""
    per_token, head = flops
    products_rate, copy_rate, attention_rate = rates
    weight_bytes = per_token  # 2 FLOPs per weight and token; 2 bytes per bf16 weight

    def products(tokens: int) -> float:
        return max(per_token * tokens / products_rate, weight_bytes / copy_rate)

    waiting = list(range(len(jobs)))[::-1]
    running: list[list[int]] = []  # [job, prompt tokens computed, output tokens drawn]
    parts = {"products": 0.0, "padding": 0.0, "lm_head": 0.0, "decode_attention": 0.0}
    parts |= {"steps": 0.0, "padded_tokens": 0.0}
    parts |= {f"{path}_{x}": 0.0 for path in PATHS for x in ("s", "steps")}
    gaps: list[tuple[float, int]] = []  # (a step's seconds, its decodes)
    quiet = prefill_interval  # steps since the last one with prompt tokens
    while waiting or running:
        while waiting and len(running) < max_seqs:
            running.append([waiting.pop(), 0, 0])
        left, tokens, context, sampled = budget, 0, 0, 0
        for request in running:  # decodes first
            prompt = jobs[request[0]][0]
            if request[1] == prompt and left > 0:
                context += prompt + request[2]
                request[2] += 1
                left, tokens, sampled = left - 1, tokens + 1, sampled + 1
        decodes = tokens
        if decodes and quiet + 1 < prefill_interval:
            left = 0  # prompts wait for a later step
        for request in running:  # then prompt chunks, first come first served
            prompt = jobs[request[0]][0]
            if request[1] < prompt and left > 0:
                n = min(left, prompt - request[1])
                request[1] += n
                left, tokens = left - n, tokens + n
                if request[1] == prompt:  # the chunk's last row draws the first token
                    request[2], sampled = 1, sampled + 1
        buckets = graphs[0] if tokens == decodes else graphs[1]
        padded = next((size for size in buckets if size >= tokens), None)
        path = "eager" if padded is None else "decode" if tokens == decodes else "mixed"
        padded = tokens if padded is None else padded
        quiet = quiet + 1 if tokens == decodes else 0
        step = {
            "products": products(tokens),
            "padding": products(padded) - products(tokens),
            "lm_head": head * sampled / products_rate,
            "decode_attention": context * kv_bytes / attention_rate,
        }
        for part, seconds in step.items():
            parts[part] += seconds
        parts["padded_tokens"] += padded - tokens
        seconds = sum(step.values())
        parts["steps"] += 1
        parts[f"{path}_s"] += seconds
        parts[f"{path}_steps"] += 1
        gaps.append((seconds, decodes))
        running = [r for r in running if not (r[1] == jobs[r[0]][0] and r[2] >= jobs[r[0]][1])]
    parts["itl_p50"] = weighted_median(gaps)
    return parts


PATHS = ("eager", "decode", "mixed")  # the worker's "eager", "decode_graph", "mixed_graph"


def weighted_median(values: list[tuple[float, int]]) -> float:
    """The value at the middle of ``(value, weight)`` pairs counted ``weight`` times each (the
    lower middle for an even total); 0.0 for no weight."""
    half = sum(weight for _, weight in values) / 2
    seen = 0
    for value, weight in sorted(values):
        seen += weight
        if weight and seen >= half:
            return value
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--products-tflops",
        type=float,
        default=760.0,
        help="bf16, measured in a burst; ~670 held at the H200's 700 W power cap "
        "(bench/sustained.py), as a run of many seconds holds it",
    )
    parser.add_argument("--copy-tb-s", type=float, default=4.28, help="device copy")
    parser.add_argument("--attention-tb-s", type=float, default=4.2, help="decode attention")
    parser.add_argument(
        "--graph-tokens", type=int, default=2048, help="the worker's, 0: no mixed graphs"
    )
    parser.add_argument(
        "--graph-batch", type=int, default=256, help="the worker's, 0: no decode graphs"
    )
    parser.add_argument(
        "--prefill-interval", type=int, default=1, help="the scheduler's (1: prompts every step)"
    )
    args = parser.parse_args()
    config = SHAPES[args.shape]()
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        save_word_level_tokenizer(Path(directory), config.vocab_size)
        requests = workload(args.requests, seed=0, tokenizer=directory)
    jobs = [(len(prompt), max_tokens) for prompt, max_tokens in requests]
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    head_dim, kv_heads = config.head_dim, config.num_key_value_heads
    assert head_dim is not None and kv_heads is not None, "the bench shapes set both"
    kv_width = kv_heads * head_dim
    q_width = int(config.num_attention_heads) * head_dim
    mlp = 3 * hidden * int(config.intermediate_size)
    per_layer = hidden * (q_width + 2 * kv_width) + q_width * hidden + mlp
    head = 2.0 * hidden * config.vocab_size
    parts = bound(
        jobs,
        args.max_num_seqs,
        args.max_num_batched_tokens,
        (2.0 * per_layer * layers, head),
        2.0 * 2 * kv_width * layers,  # K and V, bf16
        (args.products_tflops * 1e12, args.copy_tb_s * 1e12, args.attention_tb_s * 1e12),
        (
            bucket_sizes(args.graph_batch) if args.graph_batch > 0 else [],
            token_buckets(args.graph_tokens) if args.graph_tokens > 0 else [],
        ),
        args.prefill_interval,
    )
    seconds = parts["products"] + parts["padding"] + parts["lm_head"] + parts["decode_attention"]
    out = sum(max_tokens for _, max_tokens in jobs)
    print(
        f"{args.shape}, {args.requests} requests ({sum(p for p, _ in jobs)} prompt and {out} "
        f"output tokens), {args.max_num_seqs} seqs, {args.max_num_batched_tokens} tokens per "
        f"step: {parts['steps']:.0f} steps; bound {seconds:.2f} s (products "
        f"{parts['products']:.2f}, their graphs' padding {parts['padding']:.2f} for "
        f"{parts['padded_tokens']:.0f} padded tokens, lm_head {parts['lm_head']:.2f}, decode "
        f"attention {parts['decode_attention']:.2f}) -> at most {out / seconds:.0f} output tok/s; "
        f"a step's bound at the median decoded token (ITL p50 at best): "
        f"{parts['itl_p50'] * 1e3:.1f} ms"
    )
    for path in PATHS:
        print(f"  {path}: {parts[path + '_steps']:.0f} steps, {parts[path + '_s']:.2f} s")


if __name__ == "__main__":
    main()
