"""The overlapped engine step (``compute.loop.model_step``): step N+1 is launched before step N's
tokens reach the host, decodes are fed from the device, and the lag changes nothing a client
sees. Real processes: a kvstore daemon, Redis, the engine in this process, against transformers'
own ``generate``."""

from __future__ import annotations

import time

import pytest
import redis
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import compute.loop.engine
from compute.batch.scheduler import SchedulerConfig
from compute.loop.engine import Engine
from compute.model.models import load_model
from contracts import queue_keys, queue_worker
from contracts.records import OutputRecord, RequestRecord, SamplingParams
from kvstore import protocol as p
from kvstore.client import KVClient
from tests.compute.driver import EOS, generate_greedy, reference_model
from tests.compute.serving import PROFILE, assert_kvstore_holds_reported, prompts_of, submit
from tests.conftest import entry_record, start_kvstore, stop_process

STAGGERED = SchedulerConfig(32, 64)  # frozen


def records_of(r: redis.Redis, req_id: str) -> list[OutputRecord]:
    entries = r.xrange(queue_keys.output_key(req_id))
    assert entries is not None
    return [entry_record(entry) for entry in entries]


@pytest.fixture(scope="module")
def served() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, PreTrainedModel]:
    """tiny (fp32, CPU: the Triton kernels take fp16/bf16 only, where greedy tokens may differ
    from an SDPA reference), and its SDPA twin for ``generate``."""
    model, tokenizer = load_model("tiny", "float32", "cpu")
    return model, tokenizer, reference_model(model)


def serve_staggered(
    redis_url: str,
    tiny: tuple,
    jobs: dict[str, tuple[list[int], SamplingParams]],
    config: SchedulerConfig = STAGGERED,
) -> tuple[Engine, list[int], p.Stats]:
    """Submits one job before each engine step (so requests join at every step) and steps
    until every request is final. After each step, the kvstore holds exactly the tokens the
    worker reported (those of its last Step, whose reply it applies after its next launch,
    included). Returns the engine, the requests running after each step, the kvstore's
    stats at the end."""
    model, tokenizer, _ = tiny
    flags = ["--model", "tiny", "--dtype", "float32", "--kv-memory", "0.01GiB"]
    process, endpoint = start_kvstore(*flags)
    try:
        r = redis.Redis.from_url(redis_url)
        r.flushdb()
        with KVClient(endpoint) as kv:
            engine = Engine("w-overlap", model, tokenizer, kv, r, config, PROFILE)
            waiting = [
                RequestRecord(rid, prompt, params, "tiny") for rid, (prompt, params) in jobs.items()
            ]
            running: list[int] = []
            deadline = time.monotonic() + 120
            while (
                waiting
                or not engine.idle  # a step on the device, frees owed to the kvstore
                or not all(queue_worker.read_streamed(r, rid).final for rid in jobs)
            ):
                assert time.monotonic() < deadline, "the worker never finished"
                if waiting:
                    submit(redis_url, [waiting.pop(0)])
                engine.step(block_ms=20)
                running.append(len(engine.requests.running()))
                rows = {row.req_id: row for row in kv.call(p.GetStats(0)).requests}
                assert_kvstore_holds_reported(engine, rows)
            stats = kv.call(p.GetStats())
        return engine, running, stats
    finally:
        stop_process(process)


@pytest.mark.parametrize("interval", [1, 3])
def test_overlapped_greedy_equals_generate_with_requests_joining_and_finishing_every_step(
    redis_url: str, served: tuple, interval: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 requests arrive one per step, with max_tokens 1..24 (so some finish at nearly every
    step while others are being prefilled), prompts crossing block boundaries: every output is
    transformers' greedy continuation, token for token, and most decodes were fed from the
    device (the overlap ran). With a prefill interval of 3, prompts wait for every third step
    and the outputs are the same. Every step carries the worker's totals (the admin page's
    timeline), so the kvstore's last ones count the steps whose prompts waited."""
    monkeypatch.setattr(compute.loop.engine, "TIMELINE_EVERY_S", 0.0)
    _, _, ref = served
    prompts = prompts_of([3 + 7 * i % 61 for i in range(24)], seed=11)
    jobs = {
        rid: (prompt, SamplingParams(max_tokens=1 + (i * 5) % 24, temperature=0.0))
        for i, (rid, prompt) in enumerate(prompts.items())
    }
    config = SchedulerConfig(32, 64, prefill_interval=interval)
    engine, running, stats = serve_staggered(redis_url, served, jobs, config)
    for rid, (prompt, params) in jobs.items():
        sequence = queue_worker.read_streamed(engine.redis, rid).sequences[0]
        expected = generate_greedy(ref, prompt, params.max_tokens)  # ends at EOS, if it comes
        assert sequence.token_ids == expected, rid
        assert sequence.finish_reason == ("stop" if expected[-1] == EOS else "length"), rid
    decodes = sum(params.max_tokens - 1 for _, params in jobs.values())
    assert engine.model_step.tokens_fed >= decodes // 2, (engine.model_step.tokens_fed, decodes)
    assert (engine.scheduler.held_steps > 0) == (interval > 1)  # prompts did wait, or never
    (row,) = [w for w in stats.workers if w.worker_id == "w-overlap"]
    assert row.timeline is not None and row.timeline.steps == engine.steps
    assert row.timeline.held_steps == engine.scheduler.held_steps
    assert max(running) >= 8  # many requests at once, not one after another
    assert stats.gpu.used == 0 and not stats.requests  # every block freed, none leaked by the lag


def test_a_fan_out_step_processed_beside_fed_decodes_keeps_them_right(
    redis_url: str, served: tuple
) -> None:
    """An n > 1 request's first token (a step processed at once, right after its launch) lands
    while greedy requests are being fed from the device: in that turn two steps are processed
    before the kvstore hears of either, so a fed sequence reports two tokens, the second already
    computed. Everyone finishes without an error, greedy outputs still equal ``generate``."""
    _, _, ref = served
    prompts = prompts_of([20 + 9 * i % 37 for i in range(12)], seed=13)
    jobs = {
        rid: (
            prompt,
            SamplingParams(max_tokens=16, temperature=0.8, seed=i, n=3)
            if i % 4 == 3
            else SamplingParams(max_tokens=16, temperature=0.0),
        )
        for i, (rid, prompt) in enumerate(prompts.items())
    }
    engine, _, stats = serve_staggered(redis_url, served, jobs)
    for rid, (prompt, params) in jobs.items():
        records = records_of(engine.redis, rid)
        assert all(record.error is None for record in records), (rid, records[-1].error)
        streamed = queue_worker.read_streamed(engine.redis, rid)
        assert sorted(streamed.sequences) == list(range(params.n)), rid
        if params.temperature == 0:
            expected = generate_greedy(ref, prompt, params.max_tokens)
            assert streamed.sequences[0].token_ids == expected, rid
    assert stats.gpu.used == 0 and not stats.requests


def test_overlapped_stop_string_and_stop_token_emit_exactly_the_text_before_them(
    redis_url: str, served: tuple
) -> None:
    """A request that ends on a stop string or a stop token (what EOS is) at step N has already
    computed its token of step N+1: that token is dropped, and the text streamed is exactly the
    greedy output up to the stop (the stop string and the stop token's text left out)."""
    _, tokenizer, ref = served
    prompts = prompts_of([9, 30, 17, 44, 5, 23], seed=12)
    jobs: dict[str, tuple[list[int], SamplingParams]] = {}
    expected: dict[str, tuple[list[int], str]] = {}
    for i, (rid, prompt) in enumerate(prompts.items()):
        tokens = generate_greedy(ref, prompt, 24)
        if i % 2 == 0:  # a stop token id: the output ends with it, its text is not emitted
            stop_token = tokens[4 + i]
            cut = tokens.index(stop_token) + 1
            params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token])
            expected[rid] = (
                tokens[:cut],
                tokenizer.decode(tokens[: cut - 1], skip_special_tokens=True),
            )
        else:  # a one-character stop string taken from the middle of the greedy text
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            stop = next(ch for ch in text[4:] if ch.isascii() and ch.isalnum())
            params = SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])
            end = text.index(stop)
            expected[rid] = (tokens, text[:end])  # tokens: checked as a prefix below
        jobs[rid] = (prompt, params)
    engine, _, stats = serve_staggered(redis_url, served, jobs)
    for rid, (tokens, text) in expected.items():
        records = records_of(engine.redis, rid)
        streamed_tokens = [t for record in records for t in record.token_ids]
        assert "".join(record.text for record in records) == text, rid
        assert records[-1].finish_reason == "stop" and records[-1].final, rid
        if jobs[rid][1].stop_token_ids:
            assert streamed_tokens == tokens, rid
        else:  # stopped mid-way, on the token that completed the stop string
            assert (
                streamed_tokens == tokens[: len(streamed_tokens)] and len(streamed_tokens) < 24
            ), rid
    assert stats.gpu.used == 0 and not stats.requests
