"""The multi-turn workload of `pagedserve bench` against the real stack (CPU, the tiny model):
a conversation's next turn goes out only once the previous answer is in, and its prompt is the
previous prompt, that answer and a new message; the report's figures per turn; and the pool sizes
`bench/multi_turn.py` derives from a workload."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from bench.multi_turn import Plan
from kvstore.device import blocks_for_memory
from pagedserve.bench import Client, tokenizer_of
from pagedserve.bench_config import BenchConfig
from pagedserve.bench_report import Result
from pagedserve.bench_workloads import Lengths, TextMaker, build
from tests.conftest import ROOT
from tests.stack import Stack


class Recording(Client):
    """The client as the benchmark runs it, keeping each request body with its result."""

    sent: list[tuple[dict[str, Any], Result]]

    async def send(self, body: dict[str, Any]) -> Result:
        result = await super().send(body)
        self.sent.append((body, result))
        return result


def test_each_turn_follows_the_last_answer_and_extends_its_prompt(stack: Stack) -> None:
    """3 conversations of 3 turns, 2 requests in flight, 50 ms think time: turn k+1 starts after
    turn k's answer ended (plus the think time); its prompt is turn k's prompt, the answer's text
    and the new message; and the prefix cache holds turn k's prompt when turn k+1 comes."""
    think = 0.05
    config = BenchConfig(
        base_url=stack.url, workload="multi-turn", max_concurrency=2, think_time_s=think
    )
    decode, vocab = tokenizer_of("tiny")
    groups = build(
        "multi-turn",
        0,
        Lengths(8, 8),
        Lengths(4, 6),
        7,
        lambda rng: TextMaker(rng, decode, vocab),
        turns=3,
        conversations=3,
        first_prompt_len=Lengths(40, 60),
        turn_prompt_len=Lengths(5, 10),
    )
    assert len({g[0].text for g in groups}) == 3  # every conversation opens on its own prompt

    async def converse() -> Recording:
        async with aiohttp.ClientSession() as session:
            client = Recording(config, session, stack.model)
            client.sent = []
            await asyncio.gather(*(client.conversation(g, lambda r: None) for g in groups))
            return client

    sent = asyncio.run(converse()).sent
    assert len(sent) == 9 and all(result.ok for _, result in sent)
    for conversation, turns in enumerate(groups):
        mine = [(b, r) for b, r in sent if r.conversation == conversation]
        assert [r.turn for _, r in mine] == [0, 1, 2]
        assert mine[0][0]["prompt"] == turns[0].text
        for (body, result), (after, later), turn in zip(
            mine[:-1], mine[1:], turns[1:], strict=True
        ):
            assert later.start >= result.end + think
            assert after["prompt"] == f"{body['prompt']}\n{result.text}\n{turn.text}"
            assert later.prompt_tokens > result.prompt_tokens
            assert later.cached_tokens >= (result.prompt_tokens // 16 - 1) * 16, (result, later)


def test_a_multi_turn_run_reports_every_request_and_each_turn(stack: Stack, tmp_path: Path) -> None:
    """`pagedserve bench --workload multi-turn --conversations 4 --turns 3`: 12 requests, all
    answered, each conversation's turns one after the other; TTFT per turn in the report."""
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", stack.url]
    command += ["--workload", "multi-turn", "--conversations", "4", "--turns", "3"]
    command += ["--first-prompt-len", "48", "--turn-prompt-len", "8", "--output-len", "4"]
    command += ["--tokenizer", "tiny", "--max-concurrency", "2", "--result-json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (12, 0)
    assert all(r["ttft_ms"] is not None and r["output_tokens"] == 4 for r in result["requests"])
    for conversation in range(4):
        rows = [r for r in result["requests"] if r["conversation"] == conversation]
        assert [r["turn"] for r in rows] == [0, 1, 2]
        assert all(b["start_s"] >= a["end_s"] for a, b in itertools.pairwise(rows))
    turns = result["turns"]
    assert list(turns) == ["1", "2", "3"] and all(t["requests"] == 4 for t in turns.values())
    assert turns["1"]["prompt_tokens"] < turns["2"]["prompt_tokens"] < turns["3"]["prompt_tokens"]
    assert turns["3"]["cached_fraction"] > 0.5 and 0 < result["cached_fraction"] < 1
    assert result["ttft_ms_later_turns"]["p50"] > 0
    assert "TTFT ms of turns 2+" in done.stdout and "turn 3: 4 requests" in done.stdout


def test_the_pool_is_sized_to_a_third_of_the_histories() -> None:
    """The Llama-3.2-1B shape's blocks (16 layers, 8 KV heads of 64, bf16: 512 KiB per 16
    tokens): the --kv-memory the plan passes gives the kvstore exactly its pool."""
    plan = Plan(64, 5, 2048, 256, 64, 8, 3.0, 16, 16 * 2 * 16 * 8 * 64 * 2)
    assert plan.last_prompt == 2048 + 4 * (64 + 256)
    assert plan.history_blocks == -(-(plan.last_prompt + 64 + 1) // 16)
    assert blocks_for_memory(plan.kv_memory, plan.block_bytes, "cpu") == plan.pool_blocks
    assert abs(64 * plan.history_blocks / plan.pool_blocks - 3.0) < 0.01
    assert plan.swap_gib() >= 1.5 * 64 * plan.history_blocks * plan.block_bytes / 2**30
    assert 8 * plan.history_blocks <= plan.pool_blocks // 2  # the default run is not refused
