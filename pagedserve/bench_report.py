"""What ``pagedserve bench`` measures of each request (``Result``) and its report: percentiles of
TTFT, TPOT, ITL and end to end, throughput, goodput under the SLOs, structured outputs that
parse; for conversations (multi-turn), TTFT and the prefix-cache hit by turn."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.bench_config import BenchConfig

__all__ = ["PERCENTILES", "Result", "percentiles", "report", "summarize"]

PERCENTILES = (50, 90, 99)


@dataclass
class Result:
    """One request as the client saw it (seconds since the benchmark started)."""

    start: float
    first: float | None = None
    end: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # the prefix-cache hit the server reports (usage.prompt_tokens_details)
    text: str = ""
    error: str = ""
    conversation: int = -1
    turn: int = 0
    guided: bool = False  # asked for JSON of a schema
    finish_reason: str | None = None
    server_pool: str = ""  # the pool (GPU) a pagedserve host served it on (X-PagedServe-Pool)

    @property
    def ok(self) -> bool:
        return not self.error and self.first is not None

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.start

    @property
    def tpot(self) -> float | None:
        assert self.first is not None
        return (
            (self.end - self.first) / (self.output_tokens - 1) if self.output_tokens > 1 else None
        )


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99 (nearest rank) and the mean, in milliseconds; zeros when empty."""
    if not values:
        return {**{f"p{q}": 0.0 for q in PERCENTILES}, "mean": 0.0}
    ordered = sorted(values)
    picks = {
        f"p{q}": ordered[min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1)]
        for q in PERCENTILES
    }
    return {k: v * 1e3 for k, v in {**picks, "mean": sum(ordered) / len(ordered)}.items()}


def summarize(config: BenchConfig, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tpots = [t for r in ok if (t := r.tpot) is not None]
    itls = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    good = [
        r
        for r in ok
        if (not config.slo_ttft_ms or r.ttft * 1e3 <= config.slo_ttft_ms)
        and (not config.slo_tpot_ms or (r.tpot or 0.0) * 1e3 <= config.slo_tpot_ms)
    ]
    span = max(duration, 1e-9)
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    return {
        "config": asdict(config),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "output_tokens": sum(r.output_tokens for r in ok),
        "input_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": cached / max(prompt, 1),  # of the prompt tokens, hit in the cache
        "guided": sum(r.guided for r in ok),
        "guided_parsed": sum(r.guided and _parses(r.text) for r in ok),
        "guided_cut": sum(r.guided and r.finish_reason == "length" for r in ok),  # max_tokens
        "output_tok_s": sum(r.output_tokens for r in ok) / span,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / span,
        "request_s": len(ok) / span,
        "goodput_request_s": len(good) / span,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles(itls),
        "e2e_ms": percentiles([r.end - r.start for r in ok]),
        **by_turn(ok),
        "requests": [
            {
                "start_s": r.start,
                "end_s": r.end,
                "ttft_ms": r.ttft * 1e3 if r.ok else None,
                "e2e_ms": (r.end - r.start) * 1e3,
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "conversation": r.conversation,
                "turn": r.turn,
                "guided": r.guided,
                "finish_reason": r.finish_reason,
                "server_pool": r.server_pool,
                "chunks_s": [round(t, 6) for t in r.chunks],
                "tpot_ms": None if r.first is None or r.tpot is None else r.tpot * 1e3,
                "error": r.error,
            }
            for r in results
        ],
    }


def report(summary: dict[str, Any]) -> str:
    lines = [
        f"completed {summary['completed']}, failed {summary['failed']} in "
        f"{summary['duration_s']:.2f} s",
        f"output {summary['output_tok_s']:.1f} tok/s, input {summary['input_tok_s']:.1f} tok/s, "
        f"{summary['request_s']:.2f} req/s (goodput {summary['goodput_request_s']:.2f} req/s)",
        f"prefix cache: {summary['cached_tokens']} of {summary['input_tokens']} prompt tokens "
        f"({summary['cached_fraction']:.1%} hit)",
    ]
    if summary["guided"]:
        lines.append(
            f"structured: {summary['guided_parsed']} of {summary['guided']} parse "
            f"({summary['guided_cut']} cut short by max_tokens)"
        )
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        p = summary[name]
        lines.append(
            f"{name[:-3].upper():5} ms  p50 {p['p50']:.1f}  p90 {p['p90']:.1f}  "
            f"p99 {p['p99']:.1f}  mean {p['mean']:.1f}"
        )
    turns = summary.get("turns") or {}
    if turns:
        p = summary["ttft_ms_later_turns"]
        lines.append(f"TTFT ms of turns 2+  p50 {p['p50']:.1f}  p99 {p['p99']:.1f}")
    for turn, row in turns.items():
        lines.append(
            f"  turn {turn}: {row['requests']} requests, TTFT ms p50 {row['ttft_ms']['p50']:.1f}"
            f"  p99 {row['ttft_ms']['p99']:.1f}; prompt tokens {row['prompt_tokens']}, "
            f"cached {row['cached_fraction']:.0%}"
        )
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


def by_turn(ok: list[Result]) -> dict[str, Any]:
    """For conversations (some request past its first turn): ``turns``, per turn (1-based):
    requests, TTFT percentiles, prompt tokens and the fraction the prefix cache held; and
    ``ttft_ms_later_turns``, the TTFT of every turn but the first. Nothing for single requests."""
    if not any(r.turn > 0 for r in ok):
        return {}
    turns: dict[str, Any] = {}
    for turn in sorted({r.turn for r in ok}):
        rows = [r for r in ok if r.turn == turn]
        prompt = sum(r.prompt_tokens for r in rows)
        turns[str(turn + 1)] = {
            "requests": len(rows),
            "ttft_ms": percentiles([r.ttft for r in rows]),
            "prompt_tokens": prompt,
            "cached_fraction": sum(r.cached_tokens for r in rows) / max(prompt, 1),
        }
    later = percentiles([r.ttft for r in ok if r.turn > 0])
    return {"turns": turns, "ttft_ms_later_turns": later}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
