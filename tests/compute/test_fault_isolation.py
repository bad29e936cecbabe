"""Per-request fault isolation in a real worker process (``tests/compute/faulty_worker.py``),
through Redis and the kvstore daemon: an exception injected into each per-request stage in turn
ends that request alone, with an error record naming the stage; every other request of the same
steps ends with exactly the text of a run without faults; the worker process never exits; no
block stays in use. And a request that kills its worker is failed after its second death."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from contracts import queue_keys
from contracts.records import Guide, OutputRecord, RequestRecord, SamplingParams
from kvstore import protocol as p
from kvstore.client import KVClient
from pagedserve.procs import wait_for_workers
from tests.compute.faulty_worker import KILL_SEED, POISON_LOGPROBS, SLOW_S, SLOW_SEED
from tests.compute.serving import submit
from tests.conftest import ROOT, entry_record, start_kvstore, stop_process
from tests.stack import Stack

# the requests that run beside each poisoned one, one per kind of per-request work
NORMAL: dict[str, tuple[bytes, SamplingParams]] = {
    "greedy": (b"hello world", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    "n2": (b"two ways", SamplingParams(max_tokens=8, n=2, seed=3, ignore_eos=True)),
    "logprobs": (b"how sure", SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)),
    "penalties": (
        b"again and again",
        SamplingParams(max_tokens=8, seed=5, repetition_penalty=1.3, frequency_penalty=0.5),
    ),
    "guided": (
        b"a word:",
        SamplingParams(max_tokens=10, temperature=0.0, guide=Guide("regex", "[a-z]{3,6}")),
    ),
    "beams": (b"search", SamplingParams(max_tokens=6, temperature=0.0, beam_width=3, n=2)),
    "prompt": (b"score me", SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)),
    "stop": (b"stop at e", SamplingParams(max_tokens=10, seed=9, stop=["e"])),
}
ORPHAN_GRACE_S = 20.0  # a dead worker's requests wait this long to be taken over
# stage -> the poisoned request's parameters (what makes the worker reach that stage for it)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
POISONED: dict[str, SamplingParams] = {
    "admission": GREEDY,
    "guide": SamplingParams(max_tokens=6, guide=Guide("regex", "(poison-guide)?[a-z]{1,4}")),
    "grammar": SamplingParams(max_tokens=6, guide=Guide("regex", "[a-z]{2,5}")),
    "sampling": GREEDY,
    "penalties": SamplingParams(max_tokens=8, presence_penalty=1.0),
    "logprobs": SamplingParams(max_tokens=8, logprobs=POISON_LOGPROBS),
    "prompt-logprobs": SamplingParams(max_tokens=4, prompt_logprobs=1),
    "stop": SamplingParams(max_tokens=8, stop=["poison-stop"]),
    "beams": SamplingParams(max_tokens=6, temperature=0.0, beam_width=2),
    "fork": SamplingParams(max_tokens=6, n=3, seed=1),
    "output": GREEDY,
}


@dataclass
class Outcome:
    """One request's outcome, from its output stream: each sequence's tokens and text."""

    tokens: dict[int, list[int]]
    text: dict[int, str]
    finals: list[OutputRecord]


@dataclass
class FaultyStack:
    redis_url: str
    endpoint: str
    logs: Path
    worker_id: str = "w-faulty"
    worker: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start_worker(self) -> None:
        self.starts += 1
        log = open(self.logs / f"worker-{self.starts}.log", "wb")  # noqa: SIM115
        flags = ["--model", "tiny", "--device", "cpu", "--dtype", "float32"]
        flags += ["--kvstore", self.endpoint, "--redis-url", self.redis_url]
        flags += ["--worker-id", self.worker_id, "--max-num-seqs", "32"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "tests.compute.faulty_worker", *flags]
        self.worker = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for_workers(self.endpoint, 1, [self.worker], 120)

    def log(self) -> str:
        return "".join(
            (self.logs / f"worker-{i}.log").read_text(errors="replace")
            for i in range(1, self.starts + 1)
        )

    def serve(self, requests: dict[str, tuple[bytes, SamplingParams]]) -> dict[str, Outcome]:
        records = [
            RequestRecord(rid, list(text), params, "tiny")
            for rid, (text, params) in requests.items()
        ]
        submit(self.redis_url, records)
        return {rid: self.wait(rid) for rid in requests}

    def wait(self, req_id: str, timeout_s: float = 120.0) -> Outcome:
        r = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = [entry_record(e) for e in r.xrange(queue_keys.output_key(req_id)) or []]
            if records and records[-1].final:
                return outcome(records)
            time.sleep(0.05)
        raise AssertionError(f"{req_id} did not end within {timeout_s} s")

    def stats(self) -> p.Stats:
        with KVClient(self.endpoint) as kv:
            stats = kv.call(p.GetStats(0))
        assert isinstance(stats, p.Stats)
        return stats


def outcome(records: list[OutputRecord]) -> Outcome:
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    for record in records:
        if record.finish_reason == "error":
            continue
        tokens.setdefault(record.index, []).extend(record.token_ids)
        text[record.index] = text.get(record.index, "") + record.text
    return Outcome(tokens, text, [r for r in records if r.final])


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultyStack]:
    redis.Redis.from_url(redis_url).flushdb()
    grace = ("--orphan-grace-s", str(ORPHAN_GRACE_S))
    kvstore, endpoint = start_kvstore("--model", "tiny", "--dtype", "float32", *grace)
    faulty = FaultyStack(redis_url, endpoint, tmp_path_factory.mktemp("faulty"))
    try:
        faulty.start_worker()
        yield faulty
    finally:
        if faulty.worker is not None:
            faulty.worker.kill()
        stop_process(kvstore)


@pytest.fixture(scope="module")
def reference(stack: FaultyStack) -> dict[str, Outcome]:
    """The normal requests' outcomes in a run without any fault."""
    return stack.serve({f"ref-{name}": request for name, request in NORMAL.items()})


def assert_as_reference(
    served: dict[str, Outcome], reference: dict[str, Outcome], round_: str
) -> None:
    for name in NORMAL:
        got, want = served[f"{round_}-{name}"], reference[f"ref-{name}"]
        assert (got.tokens, got.text) == (want.tokens, want.text), name
        assert got.finals[-1].finish_reason != "error", name


@pytest.mark.parametrize("stage", list(POISONED))
def test_a_fault_in_one_request_s_stage_ends_that_request_alone(
    stack: FaultyStack, reference: dict[str, Outcome], stage: str
) -> None:
    assert stack.worker is not None
    pid = stack.worker.pid
    poisoned = f"poison-{stage}-req"
    requests = {f"{stage}-{name}": request for name, request in NORMAL.items()}
    requests[poisoned] = (b"poison", POISONED[stage])
    served = stack.serve(requests)
    final = served[poisoned].finals[-1]
    assert final.finish_reason == "error" and final.error_code == "worker_error", final
    assert final.error is not None and f"injected fault at {stage}" in final.error, final.error
    assert len(served[poisoned].finals) == 1
    assert_as_reference(served, reference, stage)
    assert stack.worker.poll() is None and stack.worker.pid == pid, "the worker exited"
    assert stack.log().count(f"InjectedFault: injected fault at {stage}") == 1  # one traceback
    stats = stack.stats()
    assert stats.gpu.used == 0 and not stats.requests, stats.gpu


def test_a_fault_while_adopting_a_dead_worker_s_request_ends_that_request_alone(
    stack: FaultyStack, reference: dict[str, Outcome]
) -> None:
    """The worker is killed mid-stream and restarted under its id: it takes its requests back,
    one of which fails while it is adopted; the others end with the uninterrupted text."""
    assert stack.worker is not None
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    requests = {f"adopt-{name}": request for name, request in NORMAL.items()}
    requests["poison-adoption-req"] = (b"poison", long)
    records = [
        RequestRecord(rid, list(text), params, "tiny") for rid, (text, params) in requests.items()
    ]
    submit(stack.redis_url, records)
    r = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + 60
    while not r.xlen(queue_keys.output_key("poison-adoption-req")):
        assert time.monotonic() < deadline, "nothing streamed"
        time.sleep(0.02)
    stack.worker.kill()
    stack.worker.wait()
    stack.start_worker()
    served = {rid: stack.wait(rid) for rid in requests}
    final = served["poison-adoption-req"].finals[-1]
    assert final.error_code == "worker_error" and "injected fault at adoption" in str(final.error)
    assert_as_reference(served, reference, "adopt")
    # the dead process's beams (the search starts again) are nobody's: freed after the grace
    deadline = time.monotonic() + ORPHAN_GRACE_S + 10
    while (stats := stack.stats()).gpu.used or stats.requests:
        assert time.monotonic() < deadline, (stats.gpu, stats.requests)
        time.sleep(0.2)


def test_a_request_that_kills_its_worker_is_failed_after_its_second_death(
    redis_url: str, tmp_path: Path
) -> None:
    """Through HTTP: a request whose admission kills the worker (SIGKILL, as a segfault
    would). A supervisor restarts the worker each time; its second death is the request's
    last (``queue_keys.MAX_DELIVERIES``): the client gets a 500 saying so, and the stack then
    serves the next request."""
    url = redis_url.rsplit("/", 1)[0] + "/5"  # not the other tests' stack's
    redis.Redis.from_url(url).flushdb()
    kvstore, endpoint = start_kvstore("--model", "tiny", "--dtype", "float32")
    faulty = FaultyStack(url, endpoint, tmp_path, worker_id="w-poison")
    deaths = 0
    try:
        faulty.start_worker()
        with Stack("", url, endpoint, tmp_path).gateway() as gateway:
            body = {"model": "tiny", "prompt": "kill", "max_tokens": 4, "seed": KILL_SEED}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(post, f"{gateway.url}/v1/completions", body)
                deadline = time.monotonic() + 300
                while not answer.done():  # the supervisor
                    assert time.monotonic() < deadline, "no answer"
                    assert faulty.worker is not None
                    if faulty.worker.poll() is not None:
                        deaths += 1
                        faulty.start_worker()
                    time.sleep(0.1)
                status, error = answer.result()
            assert status == 500 and error["error"]["code"] == "worker_error", error
            assert "died while serving it, 2 times" in error["error"]["message"], error
            assert deaths == 2
            normal = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
            status, done = post(f"{gateway.url}/v1/completions", normal)
            assert status == 200 and done["usage"]["completion_tokens"] == 4, done
    finally:
        if faulty.worker is not None:
            faulty.worker.kill()
        stop_process(kvstore)


def post(url: str, body: dict[str, object]) -> tuple[int, dict[str, Any]]:
    """POSTs ``body`` as JSON: the status and the decoded answer (an error's too)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=280) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_step_longer_than_the_leases_keeps_its_worker_alive(
    redis_url: str, tmp_path: Path
) -> None:
    """A step lasts 4x the kvstore's lease (a long prompt chunk on a CPU, a CUDA graph
    capture): the worker's heartbeat thread keeps its lease and its claims, so it is never
    declared dead mid-step (which would make it take the same request back and run the same
    long step again, for ever), and the request ends with all its tokens."""
    url = redis_url.rsplit("/", 1)[0] + "/6"
    redis.Redis.from_url(url).flushdb()
    lease = SLOW_S / 4
    kvstore, endpoint = start_kvstore(
        "--model", "tiny", "--dtype", "float32", "--lease-timeout-s", str(lease)
    )
    faulty = FaultyStack(url, endpoint, tmp_path, worker_id="w-slow")
    try:
        faulty.start_worker()
        slow = SamplingParams(max_tokens=3, temperature=0.0, seed=SLOW_SEED, ignore_eos=True)
        served = faulty.serve({"slow": (b"long step", slow), **NORMAL})
        assert served["slow"].tokens[0] and len(served["slow"].tokens[0]) == 3
        assert all(o.finals[-1].finish_reason != "error" for o in served.values())
    finally:
        if faulty.worker is not None:
            faulty.worker.kill()
        kv_log = stop_process(kvstore)
    assert "lease expired" not in kv_log, kv_log
    assert "lost the kvstore" not in faulty.log(), faulty.log()
