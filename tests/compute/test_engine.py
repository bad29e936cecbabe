"""The engine loop through real processes: a kvstore daemon, Redis, and the worker's engine
(in this process: the real Engine code), against transformers' own generate."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from compute.batch.scheduler import Scheduler, SchedulerConfig, Sequence
from compute.loop.engine import Engine
from compute.model.models import FAMILIES, byte_tokenizer, tiny_family_config
from contracts import queue_keys, queue_worker
from contracts.records import RequestRecord, SamplingParams, Streamed
from kvstore.client import KVClient
from tests.compute.driver import generate_greedy, paged_model, reference_model
from tests.compute.serving import (
    BLOCK_BYTES,
    PROFILE,
    kill_and_take_over,
    prompts_of,
    run_engine,
    submit,
)
from tests.conftest import start_kvstore, stop_process


def test_greedy_through_kvstore_and_redis_equals_generate(redis_url: str, tiny: tuple) -> None:
    prompts = prompts_of([5, 17, 33, 40, 64, 3], seed=1)
    outputs, stats, _, steps, _, _ = run_engine(
        redis_url, ["--kv-memory", "0.01GiB"], prompts, 12, tiny
    )
    for rid, prompt in prompts.items():
        assert outputs[rid] == generate_greedy(tiny[2], prompt, 12), rid
    # 162 prompt tokens at 64 per step (3 steps), then one decode per request per step: the
    # 12th token of the last prefilled request comes ~14 steps in (one step admits).
    assert steps <= 20, f"{steps} steps: requests stall between decodes"
    assert stats.gpu.used == 0 and not stats.requests  # everything freed


def test_a_busy_loop_engine_takes_every_request_and_never_more_than_it_has_room_for(
    redis_url: str, tiny: tuple
) -> None:
    """Stepped without waiting (``bench/serve.py``'s loop): idle, the engine reads requests
    itself; busy, its Redis jobs read them as room frees up (9 requests, 4 at a time), and
    ``run_engine`` checks it never holds more than 4."""
    prompts = prompts_of([5, 17, 33, 40, 64, 3, 9, 21, 2], seed=3)
    served = run_engine(redis_url, [], prompts, 6, tiny, max_num_seqs=4, block_ms=None)
    for rid, prompt in prompts.items():
        assert served.outputs[rid] == generate_greedy(tiny[2], prompt, 6), rid


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_through_kvstore_and_redis_equals_generate(
    family: str, redis_url: str, tmp_path: Path
) -> None:
    """Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm): a batch of mixed prompt lengths,
    chunked under the 64-token budget, greedy until EOS or 10 tokens, as ``generate``. The
    kvstore reads the family's saved config for its geometry."""
    config = tiny_family_config(family)
    config.save_pretrained(tmp_path)
    model = paged_model(config, seed=10 + FAMILIES.index(family))
    ref = reference_model(model)
    served = {"model": model, "tokenizer": byte_tokenizer(), "ref": ref}
    prompts = prompts_of([5, 17, 33, 40, 70], seed=30 + FAMILIES.index(family))
    greedy = SamplingParams(max_tokens=10, temperature=0.0)  # stops at the config's EOS
    outputs, stats, *_ = run_engine(
        redis_url,
        ["--kv-memory", "0.01GiB"],
        prompts,
        10,
        tuple(served.values()),
        params=dict.fromkeys(prompts, greedy),
        kv_model=str(tmp_path),
    )
    for rid, prompt in prompts.items():
        assert outputs[rid] == generate_greedy(ref, prompt, 10), rid
    assert len({tuple(o) for o in outputs.values()}) == len(prompts)  # not degenerate
    assert stats.gpu.used == 0


def test_prefix_hit_reports_cached_tokens_and_same_output(redis_url: str, tiny: tuple) -> None:
    shared = list(range(40, 88))  # 48 tokens = 3 full blocks
    prompts = prompts_of([4, 9], seed=2, shared=shared)
    # One sequence at a time: req1 is admitted after req0 computed (and freed) the prefix.
    flags = ["--kv-memory", "0.01GiB"]
    outputs, stats, cached, *_ = run_engine(redis_url, flags, prompts, 6, tiny, max_num_seqs=1)
    assert cached == {"req0": 0, "req1": 48}
    assert stats.prefix_hit_tokens == 48
    for rid, prompt in prompts.items():
        assert outputs[rid] == generate_greedy(tiny[2], prompt, 6), rid


def served_order(redis_url: str, rids: list[str]) -> list[str]:
    """``rids`` by their first output record's entry id (Redis orders them in time)."""
    r = redis.Redis.from_url(redis_url)
    first = {}
    for rid in rids:
        entries: Any = r.xrange(queue_keys.output_key(rid), count=1)
        millis, seq = entries[0][0].split(b"-")
        first[rid] = (int(millis), int(seq))
    return sorted(rids, key=first.__getitem__)


def test_read_ahead_lets_a_lower_priority_value_go_first(redis_url: str, tiny: tuple) -> None:
    """One request at a time (--max-num-seqs 1), five queued before the engine starts, the last
    with priority -1: read ahead, it is served first, the others in arrival order (its priority
    moves it 1,024 places); reading only what it runs, the worker serves them as queued."""
    prompts = prompts_of([5, 6, 7, 8, 9], seed=3)
    rids = list(prompts)
    priorities = {rids[-1]: -1}
    run_engine(redis_url, [], prompts, 4, tiny, max_num_seqs=1, priorities=priorities, read_ahead=8)
    assert served_order(redis_url, rids) == [rids[-1], *rids[:-1]]
    run_engine(redis_url, [], prompts, 4, tiny, max_num_seqs=1, priorities=priorities)
    assert served_order(redis_url, rids) == rids


def test_memory_pressure_swaps_and_recomputes_with_identical_output(
    redis_url: str, tiny: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 GPU blocks for 8 requests that need 6-7 each at the end; a CPU tier of 12 blocks: some
    victims are swapped, others recomputed once the CPU tier is full. The kvstore's reply comes
    after the next launch, so victims are preempted while launched steps still compute them
    (their work, gone with their blocks, must not count when they are placed again)."""
    in_flight: list[int] = []  # each victim's chunks in launched, unprocessed steps
    preempted = Scheduler.preempted

    def recording(self: Scheduler, seq: Sequence) -> None:
        in_flight.append(seq.launched_chunks)
        preempted(self, seq)

    monkeypatch.setattr(Scheduler, "preempted", recording)
    prompts = prompts_of([60, 50, 45, 70, 55, 40, 65, 48], seed=3)
    gib = 30 * BLOCK_BYTES / (1 << 30)
    swap = 12 * BLOCK_BYTES / (1 << 30)
    flags = [
        "--kv-memory",
        f"{gib:.9f}GiB",
        "--swap-memory",
        f"{swap:.9f}",
        "--admission-watermark",
        "0",
    ]
    outputs, stats, *_ = run_engine(redis_url, flags, prompts, 40, tiny)
    for rid, prompt in prompts.items():
        assert outputs[rid] == generate_greedy(tiny[2], prompt, 40), rid
    assert stats.preemptions["swap"] > 0 and stats.preemptions["recompute"] > 0, stats.preemptions
    print(f"\nvictims' chunks in flight when preempted: {in_flight}")
    assert max(in_flight) == 2  # the step before the reply and the one launched after it
    assert all(d.predicted_swap_s is not None for d in stats.decisions)
    assert stats.gpu.used == 0 and stats.cpu.used == 0


def test_seeded_sampling_is_reproducible_whatever_the_batch(redis_url: str, tiny: tuple) -> None:
    """A seeded request gives the same tokens alone and among other (unseeded) requests."""
    prompt = prompts_of([20], seed=4)["req0"]
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234)
    flags = ["--kv-memory", "0.01GiB"]
    alone, *_ = run_engine(redis_url, flags, {"s": prompt}, 10, tiny, params={"s": seeded})
    crowd = {
        "a": prompts_of([7], seed=5)["req0"],
        "s": prompt,
        "b": prompts_of([30], seed=6)["req0"],
    }
    noisy = SamplingParams(max_tokens=10, temperature=1.0)
    params = {"a": noisy, "s": seeded, "b": noisy}
    together, *_ = run_engine(redis_url, flags, crowd, 10, tiny, params=params)
    assert alone["s"] == together["s"] and len(alone["s"]) == 10
    other = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=99)
    different, *_ = run_engine(redis_url, flags, {"s": prompt}, 10, tiny, params={"s": other})
    assert different["s"] != alone["s"]  # the seed matters


def test_n4_forks_the_prompt_blocks_and_reproduces_with_a_seed(redis_url: str, tiny: tuple) -> None:
    """n = 4: the prompt's blocks are shared through kvstore fork (the 3-block prompt of 40
    tokens, and 6 more with their two lookahead slots, takes 2 shared full blocks + 4 private
    last blocks = 6, not 12), every sequence streams under its own index, and the seed
    reproduces all four."""
    prompt = prompts_of([40], seed=8)["req0"]
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=7, n=4, ignore_eos=True)
    flags = ["--kv-memory", "0.01GiB"]
    first = run_engine(redis_url, flags, {"n4": prompt}, 6, tiny, params={"n4": params})
    again = run_engine(redis_url, flags, {"n4": prompt}, 6, tiny, params={"n4": params})
    outputs = {i: s.token_ids for i, s in first.streamed["n4"].sequences.items()}
    assert sorted(outputs) == [0, 1, 2, 3] and all(len(t) == 6 for t in outputs.values())
    assert len({tuple(t) for t in outputs.values()}) > 1  # the four draws differ
    assert {i: s.token_ids for i, s in again.streamed["n4"].sequences.items()} == outputs
    assert first.max_used == 6 and first.stats.gpu.used == 0


def test_a_dead_workers_request_is_finished_by_another_without_prefilling_again(
    redis_url: str, tiny: tuple
) -> None:
    """Worker w1 streams part of a request and dies (it stops: no step, no heartbeat, no ack,
    exactly what the kvstore and Redis see of a SIGKILL). Worker w2 takes the request over,
    adopts the kvstore's blocks and finishes it: the output equals an uninterrupted run and w2
    computes only the tokens after the last one w1 reported, not the 96-token prompt."""
    prompt = prompts_of([96], seed=9)["req0"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    run = kill_and_take_over(
        redis_url, tiny, prompt, params, lambda w1, out: len(tokens_of(out, 0)) >= 8
    )
    assert tokens_of(run.streamed, 0) == generate_greedy(tiny[2], prompt, 20)
    # The rest of the output plus the last block at most (the last token is recomputed, its
    # whole block if that block was full and cached), never the 96-token prompt.
    assert run.computed_by_w2 <= 20 - 8 + 16, run.computed_by_w2
    assert run.stats.gpu.used == 0 and not run.stats.requests


def tokens_of(streamed: Streamed, index: int) -> list[int]:
    sequence = streamed.sequences.get(index)
    return sequence.token_ids if sequence else []


def test_an_idle_engines_waits_are_not_steps_and_in_no_phase(redis_url: str, tiny: tuple) -> None:
    """The step timeline (``Engine.steps``, ``phases()``) counts turns that had work: an idle
    engine's waits for requests go to ``idle_s`` only, so the per-step figures of a worker that
    idled between bursts are those of its busy steps. The kvstore phase shows its wait for the
    reply as a part (``kv_wait``), launch its model step's parts (``plan``, ``forward``,
    ``draw``); a rebuilt session's model step goes on from the totals of the one before."""
    model, tokenizer, _ = tiny
    process, endpoint = start_kvstore("--model", "tiny", "--dtype", "float32")
    try:
        r = redis.Redis.from_url(redis_url)
        r.flushdb()
        with KVClient(endpoint) as kv:
            engine = Engine("w-idle", model, tokenizer, kv, r, SchedulerConfig(4, 64), PROFILE)
            for _ in range(3):
                assert not engine.step(block_ms=30)
            assert engine.steps == 0 and engine.idle_s >= 0.08
            phases = engine.phases()
            assert phases.get("redis_in", 0.0) < 0.03 and sum(phases.values()) < 0.05
            greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            submit(redis_url, [RequestRecord("r0", [5, 6, 7], greedy, "tiny")])
            deadline = time.monotonic() + 60
            while not queue_worker.read_streamed(r, "r0").final and time.monotonic() < deadline:
                engine.step(block_ms=30)
            assert queue_worker.read_streamed(r, "r0").sequences[0].token_ids
            phases = engine.phases()
            assert 2 <= engine.steps <= 10 and phases["launch"] > 0
            assert 0 < phases["kv_wait"] < phases["kvstore"]  # a part of it
            parts = phases["plan"] + phases["forward"] + phases["draw"]
            assert 0 < parts <= phases["launch"]
            engine.recover(RuntimeError("rebuilt"), lambda: False)  # a new session
            assert engine.phases() == phases
    finally:
        stop_process(process)
