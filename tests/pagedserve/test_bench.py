"""`pagedserve bench` as a user runs it (the CLI, in its own process) against the real stack:
every workload, both endpoints, a burst and Poisson arrivals, goodput under an SLO, failures
counted, the same seed giving the same requests."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedserve.bench import tokenizer_of
from pagedserve.bench_workloads import Lengths, TextMaker, build, parse_lengths
from tests.conftest import ROOT
from tests.stack import Stack


def bench(stack: Stack, tmp_path: Path, *flags: str) -> tuple[dict[str, Any], str, str]:
    """Runs `pagedserve bench` to its end: the JSON result, stdout, stderr."""
    out = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    command = [sys.executable, "-m", "pagedserve.cli", "bench", "--base-url", stack.url]
    command += ["--result-json", str(out), *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout, done.stderr


def ordered(p: dict[str, float]) -> bool:
    return 0 < p["p50"] <= p["p90"] <= p["p99"]


def test_a_burst_of_random_requests(stack: Stack, tmp_path: Path) -> None:
    """12 requests at once, prompts of exact token lengths (the tiny tokenizer), ignore_eos:
    every output is exactly the max_tokens the seed drew; the figures add up."""
    flags = ["--num-requests", "12", "--input-len", "8:40", "--output-len", "4:12"]
    result, stdout, stderr = bench(stack, tmp_path, *flags, "--tokenizer", "tiny", "--seed", "3")
    assert (result["completed"], result["failed"]) == (12, 0)
    decode, vocab = tokenizer_of("tiny")  # the very requests the benchmark drew
    groups = build(
        "random", 12, Lengths(8, 40), Lengths(4, 12), 3, lambda rng: TextMaker(rng, decode, vocab)
    )
    assert result["output_tokens"] == sum(g[0].max_tokens for g in groups)
    assert [r["output_tokens"] for r in result["requests"]] == [g[0].max_tokens for g in groups]
    assert all(ordered(result[k]) for k in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"))
    assert result["output_tok_s"] > 0 and result["goodput_request_s"] == result["request_s"]
    assert "completed 12, failed 0" in stdout and "TTFT" in stdout
    assert stderr.splitlines()[-1].startswith("12/12 requests")  # the progress line


def test_half_the_requests_asking_for_json_of_a_schema(stack: Stack, tmp_path: Path) -> None:
    """``--guided-fraction 0.5``: the seeded half sends a random JSON Schema; each of those
    outputs parses (a guided output ends where its grammar does, ``ignore_eos`` or not)."""
    flags = ["--num-requests", "10", "--input-len", "8:20", "--output-len", "400"]
    result, stdout, _ = bench(stack, tmp_path, *flags, "--guided-fraction", "0.5", "--seed", "2")
    assert (result["completed"], result["failed"]) == (10, 0)
    assert 0 < result["guided"] < 10 and result["guided_parsed"] == result["guided"]
    assert f"structured: {result['guided']} of {result['guided']} parse (0 cut" in stdout
    guided = [r for r in result["requests"] if r["guided"]]
    assert len(guided) == result["guided"] and all(r["finish_reason"] == "stop" for r in guided)


def test_requests_of_a_priority_are_served(stack: Stack, tmp_path: Path) -> None:
    """``--priority 7`` sends each request's ``priority`` (a 400 before priorities were
    scheduled)."""
    flags = ["--num-requests", "4", "--input-len", "8:20", "--output-len", "4"]
    result, _, _ = bench(stack, tmp_path, *flags, "--priority", "7")
    assert (result["completed"], result["failed"]) == (4, 0)


def test_poisson_arrivals_are_spread_over_time(stack: Stack, tmp_path: Path) -> None:
    """At 8 requests per second, the last of 6 is sent no sooner than the drawn gaps allow."""
    flags = ["--num-requests", "6", "--input-len", "4", "--output-len", "2"]
    result, *_ = bench(stack, tmp_path, *flags, "--request-rate", "8", "--seed", "5")
    rng = random.Random(5 + 1)
    gaps = [rng.expovariate(8) for _ in range(5)]
    starts = [r["start_s"] for r in result["requests"]]
    assert starts[-1] - starts[0] >= sum(gaps) * 0.95
    assert result["completed"] == 6


def test_multi_turn_chat_carries_the_history(stack: Stack, tmp_path: Path) -> None:
    """2 conversations of 3 turns on the chat endpoint: each turn's prompt holds the one before
    it and its answer, so it is longer, and the prefix cache hits the history."""
    flags = ["--endpoint", "chat", "--workload", "multi-turn", "--num-requests", "6"]
    flags += ["--turns", "3", "--input-len", "20:30", "--output-len", "8"]
    result, *_ = bench(stack, tmp_path, *flags)
    assert (result["completed"], result["failed"]) == (6, 0)
    for conversation in (0, 1):
        turns = [r for r in result["requests"] if r["conversation"] == conversation]
        assert [t["turn"] for t in turns] == [0, 1, 2]
        prompts = [t["prompt_tokens"] for t in turns]
        assert prompts[0] < prompts[1] < prompts[2]
        assert turns[2]["cached_tokens"] >= 16  # at least a block of its history
    assert result["cached_tokens"] > 0


def test_shared_prefixes_hit_the_prefix_cache(stack: Stack, tmp_path: Path) -> None:
    flags = ["--workload", "shared-prefix", "--num-requests", "8", "--num-prefixes", "2"]
    flags += ["--prefix-len", "64", "--input-len", "4:8", "--output-len", "2"]
    flags += ["--max-concurrency", "1"]  # one at a time: each prefix is cached after its first
    result, stdout, _ = bench(stack, tmp_path, *flags, "--tokenizer", "tiny")
    assert result["completed"] == 8
    hits = [r["cached_tokens"] for r in result["requests"]]
    assert all(h >= 48 for h in hits[2:]), hits  # the prefix's full blocks, from the 3rd on
    assert "prefix cache:" in stdout


def test_goodput_counts_only_requests_within_the_slo(stack: Stack, tmp_path: Path) -> None:
    flags = ["--num-requests", "4", "--input-len", "4", "--output-len", "3"]
    strict, *_ = bench(stack, tmp_path, *flags, "--slo-ttft-ms", "0.001")
    assert strict["completed"] == 4 and strict["goodput_request_s"] == 0
    loose, *_ = bench(stack, tmp_path, *flags, "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000")
    assert loose["goodput_request_s"] == loose["request_s"] > 0


def test_failed_requests_are_counted_with_their_error(stack: Stack, tmp_path: Path) -> None:
    flags = ["--num-requests", "3", "--input-len", "4", "--output-len", "2", "--model", "nope"]
    result, stdout, _ = bench(stack, tmp_path, *flags)
    assert (result["completed"], result["failed"]) == (0, 3)
    assert "HTTP 404" in result["errors"][0] and "model_not_found" in result["errors"][0]
    assert "error: HTTP 404" in stdout


def test_lognormal_lengths_have_the_mean_asked_and_stay_in_range() -> None:
    lengths = parse_lengths("lognormal:4.9:1.0:4:4096")  # mean exp(4.9 + 1/2) = 221
    rng = random.Random(0)
    draws = [lengths.draw(rng) for _ in range(20000)]
    assert 4 <= min(draws) < 20 and 2000 < max(draws) <= 4096
    assert 205 < sum(draws) / len(draws) < 240
    assert parse_lengths("5:9") == Lengths(5, 9) and parse_lengths("7") == Lengths(7, 7)
    for bad in ("lognormal:1:0:4:9", "lognormal:1:1:9:4", "lognormal:x:1:1:2", "lognormal:1:1:1"):
        with pytest.raises(ValueError, match="lognormal"):
            parse_lengths(bad)


def test_the_same_seed_gives_the_same_requests() -> None:
    def make(seed: int) -> list[list[Any]]:
        groups = build(
            "multi-turn",
            8,
            parse_lengths("5:9"),
            parse_lengths("2:4"),
            seed,
            lambda rng: TextMaker(rng, None, 0),
            turns=2,
        )
        return [[(t.text, t.max_tokens, t.conversation, t.turn) for t in g] for g in groups]

    assert make(1) == make(1) != make(2)
    assert len(make(1)) == 4 and all(len(g) == 2 for g in make(1))


def test_the_engine_alone_bench_serves_the_requests_the_client_sends(tmp_path: Path) -> None:
    """``bench/serve.py --tokenizer DIR`` (the engine alone) feeds the engine the very token ids
    the gateway makes of the chat requests ``pagedserve bench`` sends (``bench/http_serve.py``'s
    flags), so the two runs' throughputs compare one workload."""
    import msgspec
    from transformers import LlamaConfig

    from bench.shapes import save_word_level_tokenizer, workload
    from gateway.config import GatewayConfig
    from gateway.model_info import ModelInfo
    from gateway.prepare import prepare_chat
    from gateway.schemas import ChatRequest

    LlamaConfig(vocab_size=128256, max_position_embeddings=4096).save_pretrained(tmp_path)
    save_word_level_tokenizer(tmp_path, 128256)
    jobs = workload(6, seed=5, tokenizer=str(tmp_path))
    decode, vocab = tokenizer_of(str(tmp_path))
    groups = build(
        "random", 6, Lengths(64, 1024), Lengths(32, 512), 5, lambda r: TextMaker(r, decode, vocab)
    )
    model = ModelInfo.load(GatewayConfig(model=str(tmp_path)))
    for (turn,), (ids, max_tokens) in zip(groups, jobs, strict=True):
        body = {"model": "m", "max_tokens": turn.max_tokens}
        body["messages"] = [{"role": "user", "content": turn.text}]
        prepared = prepare_chat(msgspec.convert(body, ChatRequest), model, 1)
        assert prepared.prompts == [ids]
        assert prepared.params.max_tokens == max_tokens
        assert 64 - 3 <= len(ids) <= 1024  # special ids (0, BOS, EOS) are left out of the text
