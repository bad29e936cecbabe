"""The shared-prefix workload of `pagedserve bench` (no server): prefixes of a length range and
Zipf popularity, seeded; the flags that ask for them; and every workload's requests at the
defaults byte-identical to those of the code before those options (digests taken from it)."""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pagedserve.bench import requests_of
from pagedserve.bench_config import BenchConfig
from pagedserve.bench_report import report
from pagedserve.bench_workloads import Turn, parse_popularity, prefix_picks
from pagedserve.cli import build_parser
from tests.conftest import ROOT
from tests.stack import Stack

# sha256 of the requests of BenchConfig(workload=W) (words, seed 0), computed before
# --prefix-len took ranges and --prefix-popularity existed
BEFORE = {
    "random": "bdbc2607a70a0e36d0f56e19a76b88cc7c725921eca94c6871aa4571dde3ccb6",
    "shared-prefix": "8e73ceb3fa463f438e4cea43008846bfd4020d9ddda5311c467a7aeebc1a2cec",
    "multi-turn": "a1b6f1a8fc09c0b8a05f2c910f36acdaafa1f355fae438bdd6cd7e0eb94d16e5",
}


def digest(groups: list[list[Turn]]) -> str:
    rows = [[(t.text, t.max_tokens, t.conversation, t.turn, t.schema) for t in g] for g in groups]
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("workload", sorted(BEFORE))
def test_the_defaults_send_the_requests_they_always_did(workload: str) -> None:
    assert digest(requests_of(BenchConfig(workload=workload))) == BEFORE[workload]
    explicit = BenchConfig(workload=workload, prefix_len="512:512", prefix_popularity="uniform")
    assert digest(requests_of(explicit)) == BEFORE[workload]


def shared(**flags: object) -> list[str]:
    config = BenchConfig(workload="shared-prefix", input_len="3", output_len="2", **flags)  # type: ignore[arg-type]
    return [group[0].text for group in requests_of(config)]


def prefix_of(text: str) -> str:
    return " ".join(text.split()[:-3])  # the fresh part: the last 3 words


def test_each_prefix_draws_its_own_length_from_the_range() -> None:
    texts = shared(prefix_len="10:400", num_prefixes=6, num_requests=12, seed=4)
    prefixes = [prefix_of(t) for t in texts]
    lengths = [len(p.split()) for p in prefixes[:6]]
    assert all(10 <= n <= 400 for n in lengths) and len(set(lengths)) > 1, lengths
    assert prefixes[6:] == prefixes[:6]  # uniform: the prefixes in turn
    assert texts == shared(prefix_len="10:400", num_prefixes=6, num_requests=12, seed=4)
    assert texts != shared(prefix_len="10:400", num_prefixes=6, num_requests=12, seed=5)


def test_zipf_popularity_favours_the_first_prefixes_reproducibly() -> None:
    flags = {"prefix_len": "20", "num_prefixes": 8, "num_requests": 4000, "seed": 1}
    counts = Counter(prefix_of(t) for t in shared(prefix_popularity="zipf:1.1", **flags))
    uniform = shared(**{**flags, "num_requests": 8})
    by_rank = [counts[prefix_of(t)] for t in uniform]  # the prefixes in rank order
    assert sum(by_rank) == 4000 and by_rank[0] > 2 * by_rank[1] > by_rank[-1] > 0
    total = sum(1 / r**1.1 for r in range(1, 9))
    assert abs(by_rank[0] / 4000 - 1 / total) < 0.03  # rank 1 weighted 1/1^S of the total
    assert shared(prefix_popularity="zipf:1.1", **flags) == shared(
        prefix_popularity="zipf:1.1", **flags
    )
    assert prefix_picks(50, 8, 1.1, 1) != prefix_picks(50, 8, 1.1, 2)
    assert prefix_picks(5, 3, None, 9) == [0, 1, 2, 0, 1]


def test_bad_popularity_and_prefix_flags_are_refused() -> None:
    assert parse_popularity("uniform") is None and parse_popularity("zipf:0.8") == 0.8
    for spec in ("zipf", "zipf:", "zipf:0", "zipf:-1", "zipf:inf", "zipf:x", "pareto:1", ""):
        with pytest.raises(ValueError, match="prefix popularity"):
            parse_popularity(spec)
    with pytest.raises(ValueError, match="range"):
        shared(prefix_len="400:10")
    with pytest.raises(ValueError, match="at least 1"):
        shared(num_prefixes=0)


def test_the_flags_parse_and_explain_themselves() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "--prefix-len", "1000:8000", "--prefix-popularity", "zipf:1.1"]
    )
    assert (args.prefix_len, args.prefix_popularity) == ("1000:8000", "zipf:1.1")
    helped = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli", "bench", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    text = " ".join(helped.stdout.split())
    assert "--prefix-popularity PREFIX_POPULARITY" in text and "zipf:S" in text
    assert "lo:hi for each prefix" in text and "(default: uniform)" in text


def test_the_report_gives_the_prefix_cache_hit_rate() -> None:
    p = {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0}
    summary = {
        **{"completed": 1, "failed": 0, "duration_s": 1.0, "output_tok_s": 1.0},
        **{"input_tok_s": 1.0, "request_s": 1.0, "goodput_request_s": 1.0, "guided": 0},
        **{"cached_tokens": 300, "input_tokens": 400, "cached_fraction": 0.75, "errors": []},
        **{name: p for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")},
    }
    assert "prefix cache: 300 of 400 prompt tokens (75.0% hit)" in report(summary)


def test_zipf_tenants_through_the_round_robin_proxy(stack: Stack, tmp_path: Path) -> None:
    """The multi-GPU baseline's shape on one stack: ``bench/round_robin_proxy.py`` in front of
    it twice, `pagedserve bench` sending Zipf-popular prefixes of a length range through it; the
    streamed answers all arrive and the report counts the prefix cache's hits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = [sys.executable, str(ROOT / "bench" / "round_robin_proxy.py"), "--port", str(port)]
    proxy = subprocess.Popen(
        [*script, "--upstream", stack.url, "--upstream", stack.url],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stderr is not None and "round-robin over 2" in proxy.stderr.readline()
        out = tmp_path / "result.json"
        command = [sys.executable, "-m", "pagedserve.cli", "bench", "--workload", "shared-prefix"]
        command += ["--base-url", f"http://127.0.0.1:{port}", "--result-json", str(out)]
        command += ["--prefix-len", "32:96", "--prefix-popularity", "zipf:1.1"]
        command += ["--num-prefixes", "3", "--num-requests", "10", "--max-concurrency", "1"]
        command += ["--input-len", "4:8", "--output-len", "3", "--tokenizer", "tiny"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    finally:
        proxy.send_signal(signal.SIGINT)
        assert proxy.wait(10) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (10, 0)
    assert result["config"]["prefix_popularity"] == "zipf:1.1"
    assert all(r["output_tokens"] == 3 for r in result["requests"])
    assert 0 < result["cached_tokens"] < result["input_tokens"]
    assert f"({result['cached_fraction']:.1%} hit)" in done.stdout
