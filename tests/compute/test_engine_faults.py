"""Requests that used to take a worker down, through the real kvstore daemon, Redis and the
engine: branches that end on their first token, a prompt the pool can never hold, a kvstore that
restarts under a running worker, a request another worker took over."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from transformers import PreTrainedModel

from compute.batch.scheduler import SchedulerConfig
from compute.loop.engine import RECOVERABLE, Engine
from contracts import queue_keys, queue_worker
from contracts.records import (
    OutputRecord,
    RequestRecord,
    SamplingParams,
    StreamedSequence,
)
from kvstore import protocol as p
from kvstore.client import KVClient
from tests.compute.driver import generate_greedy
from tests.compute.serving import PROFILE, prompts_of, run_engine, submit
from tests.conftest import entry_record, start_kvstore, stop_process

FLAGS = ["--kv-memory", "0.01GiB"]
EOS_PROMPT = [256, 76]  # BOS "L": the tiny model's greedy next token is its EOS (257)


def test_every_branch_ending_on_its_first_token(redis_url: str, tiny: tuple) -> None:
    """n=2 with max_tokens 1, and greedy n=4 whose first token is EOS: a branch forked and
    finished in the same step is never sent to the kvstore; each request ends with n
    one-token sequences and nothing stays allocated."""
    params = {
        "n2": SamplingParams(max_tokens=1, n=2, seed=1),
        "eos4": SamplingParams(max_tokens=8, n=4, temperature=0.0),
    }
    prompts = {"n2": list(b"hi"), "eos4": EOS_PROMPT}
    served = run_engine(redis_url, FLAGS, prompts, 1, tiny, params=params)
    n2, eos4 = served.streamed["n2"], served.streamed["eos4"]
    assert n2.final and sorted(n2.sequences) == [0, 1]
    assert all(len(s.token_ids) == 1 and s.finish_reason == "length" for s in n2.sequences.values())
    assert eos4.final and sorted(eos4.sequences) == [0, 1, 2, 3]
    assert all(s.token_ids == [257] and s.finish_reason == "stop" for s in eos4.sequences.values())
    for rid, n in (("n2", 2), ("eos4", 4)):  # one record per branch, the last one final
        assert [r.final for r in records(redis_url, rid)] == [False] * (n - 1) + [True], rid
    assert served.stats.gpu.used == 0 and not served.stats.requests


def records(redis_url: str, req_id: str) -> list[OutputRecord]:
    entries = redis.Redis.from_url(redis_url).xrange(queue_keys.output_key(req_id))
    assert entries is not None
    return [entry_record(entry) for entry in entries]


def test_the_first_branch_ending_while_the_others_go_on(redis_url: str, tiny: tuple) -> None:
    """n=4, seeded, with half the vocabulary as stop tokens: some first branches end on their
    first token while their siblings, forked in that same step, go on (the kvstore forks before
    it frees). Every branch ends as its own stop condition says."""
    stops = list(range(0, 256, 2))
    params = {
        f"s{seed}": SamplingParams(max_tokens=6, n=4, seed=seed, stop_token_ids=stops)
        for seed in range(8)
    }
    prompts = {rid: list(b"fork") for rid in params}
    served = run_engine(redis_url, FLAGS, prompts, 6, tiny, params=params)
    shapes = []
    for rid in params:
        sequences = served.streamed[rid].sequences
        assert served.streamed[rid].final and sorted(sequences) == [0, 1, 2, 3]
        for seq in sequences.values():
            stopped = seq.token_ids[-1] in stops
            assert seq.finish_reason == ("stop" if stopped else "length"), seq
            assert all(t not in stops for t in seq.token_ids[:-1])
            assert stopped or len(seq.token_ids) == 6
        shapes.append([len(sequences[k].token_ids) for k in range(4)])
        finals = [r.final for r in records(redis_url, rid)]
        assert finals.count(True) == 1 and finals[-1], (rid, finals)
    assert any(s[0] == 1 and max(s) > 1 for s in shapes), shapes  # the case that crashed
    assert served.stats.gpu.used == 0 and not served.stats.requests


def test_a_prompt_the_pool_can_never_hold_fails_alone(redis_url: str, tiny: tuple) -> None:
    """A prompt of more blocks than the pool (submitted straight to Redis, past any gateway
    check) gets an error record naming the capacity; the request beside it is served."""
    small = prompts_of([20], seed=3)["req0"]
    prompts = {"huge": [7] * (16 * 20), "ok": small}
    served = run_engine(redis_url, ["--kv-memory", "0.0001GiB"], prompts, 4, tiny)
    huge = served.streamed["huge"]
    assert huge.final and huge.sequences[0].finish_reason == "error"
    error = records(redis_url, "huge")[-1].error
    assert error is not None and "too_large" in error and "at most" in error, error
    assert served.outputs["ok"] == generate_greedy(tiny[2], small, 4)
    assert served.stats.gpu.used == 0 and not served.stats.requests


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def engine_mid_stream(
    name: str, tiny: tuple, kv: KVClient, redis_url: str, prompts: dict[str, list[int]]
) -> Engine:
    """A new engine serving greedy 24-token requests of ``prompts``, stepped until each has
    streamed 5 tokens."""
    model, tokenizer, _ = tiny
    r = redis.Redis.from_url(redis_url)
    submit(redis_url, [RequestRecord(k, v, GREEDY, "tiny") for k, v in prompts.items()])
    engine = Engine(name, model, tokenizer, kv, r, SchedulerConfig(8, 64), PROFILE)
    while min(len(streamed(r, rid).get(0, NO_TOKENS).token_ids) for rid in prompts) < 5:
        engine.step(block_ms=50)
    return engine


def streamed(r: redis.Redis, req_id: str) -> dict[int, StreamedSequence]:
    return queue_worker.read_streamed(r, req_id).sequences


def step_to_the_end(engine: Engine, prompts: dict[str, list[int]], timeout_s: float = 60) -> None:
    """Steps until every request is final, recovering as ``run_forever`` does."""
    deadline = time.monotonic() + timeout_s
    while not all(queue_worker.read_streamed(engine.redis, rid).final for rid in prompts):
        assert time.monotonic() < deadline, "the worker never finished"
        try:
            engine.step(block_ms=50)
        except RECOVERABLE as err:
            engine.recover(err, lambda: time.monotonic() > deadline)


def assert_greedy(engine: Engine, prompts: dict[str, list[int]], ref: PreTrainedModel) -> None:
    for rid, prompt in prompts.items():
        tokens = streamed(engine.redis, rid)[0].token_ids
        assert tokens == generate_greedy(ref, prompt, GREEDY.max_tokens), rid


@pytest.mark.parametrize("its_last_step", ["sent", "never read"])
def test_a_restarted_kvstore_is_registered_with_again(
    redis_url: str, tiny: tuple, its_last_step: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The kvstore dies (SIGKILL) under a worker with requests in flight and comes back on the
    same endpoint with a new pool: the worker recovers by itself (registers again, maps the new
    pool, rebuilds its requests from Redis, recomputes them) and the greedy output is the one
    an uninterrupted run gives. The worker takes a Step's reply a turn later, so the kill
    always lands with one unanswered: just sent ("sent": the daemon may have answered it
    before it died), or sent to a daemon already stopped ("never read": its reply never
    comes, and the worker gives up on it after its timeout)."""
    prompts = prompts_of([30, 9, 50], seed=4)
    redis.Redis.from_url(redis_url).flushdb()
    kv_flags = ["--model", "tiny", "--dtype", "float32", *FLAGS]
    first, endpoint = start_kvstore(*kv_flags)
    second = None
    try:
        with KVClient(endpoint, timeout_s=2) as kv:
            engine = engine_mid_stream("w-restart", tiny, kv, redis_url, prompts)
            if its_last_step == "never read":
                kvsync = engine.session.kvsync
                submit = kvsync.submit

                def stop_then_submit(*args: Any) -> None:
                    first.send_signal(signal.SIGSTOP)  # the Step below is never read
                    submit(*args)

                kvsync.submit = stop_then_submit  # type: ignore[method-assign,assignment]
                engine.step(block_ms=50)  # takes the last reply, sends the Step never read
                kvsync.submit = submit  # type: ignore[method-assign]
            reporting = dict(engine.unanswered_reports)
            assert set(reporting) == set(prompts), reporting  # n = 1: a sequence per request
            first.kill()
            first.wait()
            second, _ = start_kvstore(*kv_flags, endpoint=endpoint)
            step_to_the_end(engine, prompts)
            stats = kv.call(p.GetStats(0))
        assert_greedy(engine, prompts, tiny[2])
        assert isinstance(stats, p.Stats) and stats.gpu.used == 0 and not stats.requests
        assert "lost the kvstore or Redis" in caplog.text  # rebuilt, not carried on by chance
    finally:
        stop_process(first)
        if second is not None:
            stop_process(second)


def test_a_restarted_redis_is_reconnected_to(tiny: tuple, tmp_path: Path) -> None:
    """Redis dies (SIGKILL) under a worker with requests in flight and comes back on its port
    from its append-only file: the worker recovers by itself (rebuilds its requests from
    Redis, adopts their blocks: nothing is recomputed but the last token of each) and every
    request ends with the greedy output of an uninterrupted run."""
    from pagedserve.redis_server import RedisServer

    server = RedisServer.durable_in(tmp_path / "redis")
    process = server.spawn()
    server.wait_ready(process, 10)
    kvstore, endpoint = start_kvstore("--model", "tiny", "--dtype", "float32", *FLAGS)
    prompts = prompts_of([30, 9, 50], seed=5)
    try:
        with KVClient(endpoint, timeout_s=2) as kv:
            engine = engine_mid_stream("w-redis", tiny, kv, server.url, prompts)
            time.sleep(1.2)  # the append-only file is written every second
            process.kill()
            process.wait()
            with pytest.raises(RECOVERABLE) as lost:  # its records' write may still go out:
                for _ in range(5):  # the next Redis reply it reads fails
                    engine.step(block_ms=50)
            process = server.spawn()
            server.wait_ready(process, 10)
            before = engine.tokens_computed
            engine.recover(lost.value, lambda: False)
            assert len(engine.active) == 3  # taken back from Redis
            step_to_the_end(engine, prompts)
        assert_greedy(engine, prompts, tiny[2])
        # adopted: each request recomputes its last token, then decodes what was left
        assert engine.tokens_computed - before <= 3 * (1 + 24)
    finally:
        process.kill()
        process.wait()
        server.close()
        stop_process(kvstore)


NO_TOKENS = StreamedSequence([])
