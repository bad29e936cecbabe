"""``pagedserve bench``'s flags (``BenchConfig``): read by the load generator
(``pagedserve.bench``) and by its report (``pagedserve.bench_report``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from contracts.options import flag
from pagedserve.bench_workloads import WORKLOADS


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = flag("http://127.0.0.1:8000", "the server, without /v1")
    model: str = flag("", "the model to ask for (default: the first one GET /v1/models lists)")
    endpoint: str = flag("completions", "which API to call", choices=["completions", "chat"])
    workload: str = flag(
        "random",
        "the requests (see pagedserve/bench_workloads.py)",
        choices=WORKLOADS,
    )
    num_requests: int = flag(
        128,
        "requests to send (multi-turn: turns in all, unless --conversations)",
    )
    input_len: str = flag(
        "64:1024",
        "prompt length, tokens (words without --tokenizer): lo:hi (uniform) or "
        "lognormal:MU:SIGMA:LO:HI (a long-tailed chat mix, clipped to LO:HI)",
    )
    output_len: str = flag("32:512", "max_tokens: lo:hi or lognormal:MU:SIGMA:LO:HI")
    prefix_len: str = flag(
        "512",
        "shared-prefix: each prefix's length, tokens (words without --tokenizer): N, or lo:hi "
        "for each prefix (system prompt, tenant) to draw its own (uniform, seeded)",
    )
    num_prefixes: int = flag(4, "shared-prefix: distinct prefixes (system prompts, tenants)")
    prefix_popularity: str = flag(
        "uniform",
        "shared-prefix: which prefix each request uses: 'uniform' (the prefixes in turn, equal "
        "shares) or 'zipf:S', e.g. zipf:1.1 (drawn, seeded by --seed; the prefix of rank r "
        "weighted 1/r^S, so the first ones take most requests)",
    )
    turns: int = flag(4, "multi-turn: turns per conversation")
    conversations: int = flag(0, "multi-turn: conversations (0: --num-requests // --turns)")
    first_prompt_len: str = flag(
        "",
        "multi-turn: the first turn's prompt lo:hi (each conversation's own random "
        "system and user message; default --input-len)",
    )
    turn_prompt_len: str = flag(
        "",
        "multi-turn: the new user message of each later turn, lo:hi (default "
        "--input-len); the prompt is the previous one, its answer and this",
    )
    think_time_s: float = flag(
        0.0,
        "multi-turn: pause between an answer and the next turn's request",
    )
    request_rate: float = flag(
        math.inf,
        "requests (multi-turn: conversations) per second, Poisson arrivals; "
        "inf sends them all at once",
    )
    max_concurrency: int = flag(
        0,
        "requests in flight at most (0: no limit); multi-turn: all conversations "
        "start, one turn each in flight at most, waiting turns sent first come first served",
    )
    ignore_eos: bool = flag(True, "send ignore_eos (outputs of exactly max_tokens)")
    priority: int = flag(
        0,
        "every request's 'priority' (lower first; 0, the server's default, is not sent): two "
        "bench processes of different priorities against one server measure the scheduling",
    )
    tokenizer: str = flag(
        "",
        "local tokenizer directory (or 'tiny') for prompts of exact token lengths",
    )
    seed: int = flag(0, "seed of the requests and the arrivals")
    guided_fraction: float = flag(
        0.0,
        "this fraction of the requests (seeded) asks for JSON of a random JSON "
        "Schema (response_format json_schema); the report counts those that parse",
    )
    slo_ttft_ms: float = flag(0.0, "goodput: TTFT limit (0: none)")
    slo_tpot_ms: float = flag(0.0, "goodput: TPOT limit (0: none)")
    timeout_s: float = flag(600.0, "one request's limit")
    api_key: str = flag("", "bearer token (default: $OPENAI_API_KEY)")
    result_json: str = flag("", "write every figure to this file")
    progress: bool = flag(True, "a progress line on stderr")
    processes: int = flag(
        1,
        "client OS processes sending the requests (one Python client may be the bottleneck at "
        "tens of thousands of streamed tokens/s): the same seeded requests dealt round-robin "
        "(request i to process i mod N), all starting at one moment, arrivals on the one "
        "--request-rate schedule, --max-concurrency shared out (total unchanged, so at most "
        "that many processes); one report, as if one client had sent them",
    )
