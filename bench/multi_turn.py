"""Multi-turn conversations whose histories outgrow the GPU pool: TTFT and throughput with the
kvstore's CPU prefix tier off (``--no-cpu-prefix-cache``) and on (``--cpu-prefix-cache``).

``pagedserve up`` serves a random-weight checkpoint of the shape asked for (``--shape 1b``:
Llama-3.2-1B, built as ``bench/http_serve.py`` builds it, word-level tokenizer: prompts of exact
token lengths) with a GPU KV pool sized so that the conversations' full histories (every prompt
and answer of every turn) are ``--ratio`` times the pool, and a CPU tier (``--swap-memory``) that
holds them all. ``pagedserve bench --workload multi-turn`` then runs the conversations: each
opens with its own random prompt, each later turn sends the previous prompt, its answer and a new
user message once that answer is in; all conversations start at once and at most
``--max-concurrency`` requests are in flight, so between two turns of one conversation every
other conversation takes a turn and, without the tier, its history has left the pool.

One fresh stack per run (off, then on), each warmed up with short conversations of another seed
and its prefix cache reset before the timed run; ``/admin/cache`` after each run.

    python bench/multi_turn.py --shape 1b                     # the H200
    python bench/multi_turn.py --device cpu --conversations 12 --turns 3 --first-prompt-len 64 \\
        --turn-prompt-len 16 --output-len 8 --max-concurrency 2  # a smoke check: the tiny model
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_serve import (  # noqa: E402
    admin,
    client,
    pagedserve_up,
    timeline_delta,
    timelines,
)
from bench.shapes import checkpoint  # noqa: E402

GiB = 1 << 30
TIER_FLAG = "--cpu-prefix-cache"


@dataclass(frozen=True)
class Plan:
    """The workload's token counts and the pool sizes they call for."""

    conversations: int
    turns: int
    first_prompt_len: int
    turn_prompt_len: int
    output_len: int
    max_concurrency: int
    ratio: float
    block_size: int
    block_bytes: int
    expansion: float = 1.0  # tokens per drawn token once the text is encoded again

    @property
    def last_prompt(self) -> int:
        """The last turn's prompt, in tokens."""
        drawn = self.first_prompt_len + (self.turns - 1) * (self.output_len + self.turn_prompt_len)
        return math.ceil(drawn * self.expansion)

    @property
    def history_blocks(self) -> int:
        """One conversation's final history (last prompt and answer, a BOS) in blocks."""
        return math.ceil((self.last_prompt + self.output_len + 1) / self.block_size)

    @property
    def pool_blocks(self) -> int:
        return max(1, round(self.conversations * self.history_blocks / self.ratio))

    @property
    def kv_memory(self) -> str:
        """``--kv-memory`` for exactly ``pool_blocks`` (half a block over: no rounding loss)."""
        return f"{(self.pool_blocks + 0.5) * self.block_bytes / GiB:.9f}GiB"

    def swap_gib(self) -> float:
        """A CPU tier for every history and half as much again (swapped requests), in GiB."""
        return math.ceil(1.5 * self.conversations * self.history_blocks * self.block_bytes / GiB)

    def describe(self) -> str:
        history = self.conversations * self.history_blocks
        running = self.max_concurrency * self.history_blocks
        mib = self.block_bytes / 2**20
        return "\n".join(
            [
                f"block: {self.block_size} tokens = {self.block_bytes} bytes ({mib:.3f} MiB)",
                f"workload: {self.conversations} conversations x {self.turns} turns, first "
                f"prompt {self.first_prompt_len}, then +{self.output_len} answer "
                f"+{self.turn_prompt_len} user per turn: last prompt {self.last_prompt} tokens "
                f"(text re-encoded: x{self.expansion:.2f})",
                f"histories: {self.history_blocks} blocks each, {history} in all "
                f"({history * self.block_bytes / GiB:.3f} GiB)",
                f"GPU pool: {self.pool_blocks} blocks = --kv-memory {self.kv_memory} "
                f"(histories / pool = {history / self.pool_blocks:.2f})",
                f"in flight at most: {self.max_concurrency} requests, {running} blocks "
                f"({running / self.pool_blocks:.0%} of the pool)",
            ]
        )


def block_geometry(model: str, device: str) -> tuple[int, int]:
    """Tokens per block (the kvstore's default) and a block's bytes, as the kvstore has them."""
    from contracts.model_config import kv_geometry, load_config, resolve_dtype
    from kvstore.daemon import KVStoreConfig

    config = load_config(model)
    block_size = KVStoreConfig().block_size
    geometry = kv_geometry(config, resolve_dtype(config, "auto", device))
    return block_size, geometry.block_bytes(block_size)


def expansion(tokenizer: str) -> float:
    """Tokens per token drawn, once the prompt text is encoded again: 1 for the word-level
    checkpoint; more for the tiny model's bytes (random bytes decode to U+FFFD, 3 bytes)."""
    import random

    from contracts.tokenizer import load_tokenizer
    from pagedserve.bench import tokenizer_of
    from pagedserve.bench_workloads import TextMaker

    decode, vocab = tokenizer_of(tokenizer)
    text = TextMaker(random.Random(0), decode, vocab)(2000)
    return len(load_tokenizer(tokenizer).encode(text, add_special_tokens=False)) / 2000


def tier_flags() -> dict[str, str]:
    """The kvstore flag of each run; a kvstore without the flag has no CPU prefix tier, so its
    'off' run passes nothing and its 'on' run cannot be made."""
    command = [sys.executable, "-m", "pagedserve.cli", "kvstore", "--help"]
    help_text = subprocess.run(command, cwd=ROOT, capture_output=True, text=True).stdout
    if TIER_FLAG in help_text:
        return {"off": "--no-cpu-prefix-cache", "on": TIER_FLAG}
    print(f"this kvstore has no {TIER_FLAG}: 'off' passes no flag, 'on' is left out")
    return {"off": ""}


def client_flags(args: argparse.Namespace, tokenizer: str, seed: int, short: bool) -> list[str]:
    """The multi-turn workload of ``args`` (``short``: the warm-up's 2 turns of 4 conversations)."""
    flags = ["--workload", "multi-turn", "--tokenizer", tokenizer, "--seed", str(seed)]
    flags += ["--conversations", str(4 if short else args.conversations)]
    flags += ["--turns", str(2 if short else args.turns)]
    flags += ["--first-prompt-len", str(args.first_prompt_len)]
    flags += ["--turn-prompt-len", str(args.turn_prompt_len)]
    flags += ["--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency)]
    return [*flags, "--think-time-s", str(args.think_time_s)]


def one_run(
    name: str, flag: str, model: str, plan: Plan, args: argparse.Namespace
) -> dict[str, Any]:
    """A fresh stack with the tier ``flag``: warm-up, prefix cache reset, the timed run; its
    result with ``/admin/cache`` after it."""
    kvstore = f"--kv-memory {plan.kv_memory} --swap-memory {args.swap_memory or plan.swap_gib()}"
    kvstore += f" {flag}" if flag else ""
    kvstore += f" {args.kvstore_args}" if args.kvstore_args else ""
    print(f"== CPU tier {name}: pagedserve up --kvstore-args='{kvstore}'", flush=True)
    with pagedserve_up(model, args.out / f"redis-{name}", args.device, kvstore) as url:
        warmup = args.out / f"{name}.warmup.json"
        client(url, client_flags(args, model, args.seed + 1, short=True), warmup)
        print(f"prefix cache reset: {json.dumps(admin(url, '/admin/cache/reset', 'POST'))}")
        out = args.out / f"{name}.json"
        before = timelines(url)
        result = client(url, client_flags(args, model, args.seed, short=False), out)
        result["admin_cache"] = admin(url, "/admin/cache?top=0")
        result["worker_timeline"] = timeline_delta(before, timelines(url))
    cache = {k: v for k, v in result["admin_cache"].items() if k != "top_prefixes"}
    print(f"/admin/cache after the run (tier {name}): {json.dumps(cache)}", flush=True)
    print(f"worker step timeline over the run (tier {name}): {result['worker_timeline']}")
    return result


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| CPU tier | requests | out tok/s | TTFT p50 / p99 ms | TTFT turns 2+ p50 / p99 ms "
        "| cached tokens |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ttft, later = r["ttft_ms"], r.get("ttft_ms_later_turns") or {"p50": 0.0, "p99": 0.0}
        rows.append(
            f"| {name} | {r['completed']}/{r['completed'] + r['failed']} | "
            f"{r['output_tok_s']:.0f} | {ttft['p50']:.0f} / {ttft['p99']:.0f} | "
            f"{later['p50']:.0f} / {later['p99']:.0f} | {r['cached_fraction']:.1%} |"
        )
    if {"off", "on"} <= results.keys():
        off, on = results["off"], results["on"]
        later_off = (off.get("ttft_ms_later_turns") or {}).get("p50", 0.0)
        later_on = (on.get("ttft_ms_later_turns") or {}).get("p50", 0.0)
        rows.append(
            f"TTFT p50 off / on: {ratio(off['ttft_ms']['p50'], on['ttft_ms']['p50'])} (turns "
            f"2+: {ratio(later_off, later_on)}); TTFT p99 off / on: "
            f"{ratio(off['ttft_ms']['p99'], on['ttft_ms']['p99'])}; out tok/s on / off: "
            f"{ratio(on['output_tok_s'], off['output_tok_s'])}"
        )
    for name, r in results.items():
        cache = r.get("admin_cache") or {}
        hits, tier = cache.get("prefix_cache") or {}, cache.get("cpu_tier")
        rows.append(
            f"tier {name}: prefix hit rate {hits.get('hit_rate', 0.0):.1%} of "
            f"{hits.get('queried_tokens', 0)} tokens queried; CPU tier {json.dumps(tier)}"
        )
    return "\n".join(rows)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where")
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b", help="cuda; cpu: tiny")
    parser.add_argument("--conversations", type=int, default=64, help="all started at once")
    parser.add_argument("--turns", type=int, default=5, help="per conversation")
    parser.add_argument("--first-prompt-len", type=int, default=2048, help="tokens")
    parser.add_argument("--turn-prompt-len", type=int, default=256, help="tokens, per turn")
    parser.add_argument("--output-len", type=int, default=64, help="tokens, per turn")
    parser.add_argument("--max-concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--think-time-s", type=float, default=0.0, help="between turns")
    parser.add_argument("--ratio", type=float, default=3.0, help="all histories / GPU pool")
    parser.add_argument("--swap-memory", default="", help="GiB; empty: 1.5x the histories")
    parser.add_argument("--runs", default="off,on", help="which runs, in order: off,on")
    parser.add_argument("--kvstore-args", default="", help="more flags for both runs' kvstore")
    parser.add_argument("--seed", type=int, default=0, help="the workload's")
    parser.add_argument(
        "--out", type=Path, default=Path("/tmp/pagedserve-multi-turn"), help="checkpoint, results"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        model = str(checkpoint(args.out / f"model-{args.shape}", args.shape))
    else:
        model = "tiny"
    block_size, block_bytes = block_geometry(model, args.device)
    tokens_per_token = expansion(model)
    plan = Plan(
        args.conversations,
        args.turns,
        args.first_prompt_len,
        args.turn_prompt_len,
        args.output_len,
        args.max_concurrency,
        args.ratio,
        block_size,
        block_bytes,
        tokens_per_token,
    )
    print(plan.describe(), flush=True)
    if plan.max_concurrency * plan.history_blocks > plan.pool_blocks // 2:
        raise SystemExit("the requests in flight would take over half the pool: fewer of them")
    flags = tier_flags()
    results = {}
    for name in args.runs.split(","):
        if name not in flags:
            raise SystemExit(f"run {name!r}: not one of {', '.join(flags)}")
        results[name] = one_run(name, flags[name], model, plan, args)
    (args.out / "summary.json").write_text(json.dumps({"plan": vars(plan), **results}, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
