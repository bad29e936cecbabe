"""``pagedserve bench``'s flags (``BenchConfig``): read by the load generator
(``pagedserve.bench``) and by its report (``pagedserve.bench_report``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.bench_workloads import WORKLOADS


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = field(
        default="http://127.0.0.1:8000", metadata={"help": "the server, without /v1"}
    )
    model: str = field(
        default="",
        metadata={"help": "the model to ask for (default: the first one GET /v1/models lists)"},
    )
    endpoint: str = field(
        default="completions",
        metadata={"help": "which API to call", "choices": ["completions", "chat"]},
    )
    workload: str = field(
        default="random",
        metadata={"help": "the requests (see pagedserve/bench_workloads.py)", "choices": WORKLOADS},
    )
    num_requests: int = field(
        default=128,
        metadata={"help": "requests to send (multi-turn: turns in all, unless --conversations)"},
    )
    input_len: str = field(
        default="64:1024",
        metadata={"help": "prompt length lo:hi, tokens (words without --tokenizer)"},
    )
    output_len: str = field(default="32:512", metadata={"help": "max_tokens lo:hi"})
    prefix_len: int = field(default=512, metadata={"help": "shared-prefix: the prefix length"})
    num_prefixes: int = field(default=4, metadata={"help": "shared-prefix: distinct prefixes"})
    turns: int = field(default=4, metadata={"help": "multi-turn: turns per conversation"})
    conversations: int = field(
        default=0,
        metadata={"help": "multi-turn: conversations (0: --num-requests // --turns)"},
    )
    first_prompt_len: str = field(
        default="",
        metadata={
            "help": "multi-turn: the first turn's prompt lo:hi (each conversation's own random "
            "system and user message; default --input-len)"
        },
    )
    turn_prompt_len: str = field(
        default="",
        metadata={
            "help": "multi-turn: the new user message of each later turn, lo:hi (default "
            "--input-len); the prompt is the previous one, its answer and this"
        },
    )
    think_time_s: float = field(
        default=0.0,
        metadata={"help": "multi-turn: pause between an answer and the next turn's request"},
    )
    request_rate: float = field(
        default=math.inf,
        metadata={
            "help": "requests (multi-turn: conversations) per second, Poisson arrivals; "
            "inf sends them all at once"
        },
    )
    max_concurrency: int = field(
        default=0,
        metadata={
            "help": "requests in flight at most (0: no limit); multi-turn: all conversations "
            "start, one turn each in flight at most, waiting turns sent first come first served"
        },
    )
    ignore_eos: bool = field(
        default=True, metadata={"help": "send ignore_eos (outputs of exactly max_tokens)"}
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "local tokenizer directory (or 'tiny') for prompts of exact token lengths"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the requests and the arrivals"})
    guided_fraction: float = field(
        default=0.0,
        metadata={
            "help": "this fraction of the requests (seeded) asks for JSON of a random JSON "
            "Schema (response_format json_schema); the report counts those that parse"
        },
    )
    slo_ttft_ms: float = field(default=0.0, metadata={"help": "goodput: TTFT limit (0: none)"})
    slo_tpot_ms: float = field(default=0.0, metadata={"help": "goodput: TPOT limit (0: none)"})
    timeout_s: float = field(default=600.0, metadata={"help": "one request's limit"})
    api_key: str = field(default="", metadata={"help": "bearer token (default: $OPENAI_API_KEY)"})
    result_json: str = field(default="", metadata={"help": "write every figure to this file"})
    progress: bool = field(default=True, metadata={"help": "a progress line on stderr"})
