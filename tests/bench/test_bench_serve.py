"""``bench/serve.py``'s loop (``serve_jobs``) on the tiny model through a real kvstore daemon and
Redis: what it counts, and the per-step trace that ``--step-trace`` writes."""

from __future__ import annotations

import redis

from bench.serve import serve_jobs
from compute.batch.scheduler import SchedulerConfig
from compute.loop.engine import Engine
from kvstore.client import KVClient
from tests.compute.serving import PROFILE
from tests.conftest import start_kvstore, stop_process


def test_serve_jobs_counts_every_token_and_traces_every_processed_step(
    redis_url: str, tiny: tuple
) -> None:
    """Four requests (prompts 5-70 tokens, 3-9 outputs) under a 64-token budget. Every step
    the engine processed is one trace entry, in order; the entries add up to the run's own
    totals per forward path; and the tokens they computed are every prompt token plus every
    output token but the one each prefill yields."""
    model, tokenizer, _ = tiny
    jobs = [([7] * 5, 3), ([9] * 70, 9), ([11] * 33, 4), ([13] * 17, 6)]
    process, endpoint = start_kvstore("--model", "tiny", "--dtype", "float32")
    try:
        redis.Redis.from_url(redis_url).flushdb()
        with KVClient(endpoint) as kv:
            engine = Engine(
                "w-bench",
                model,
                tokenizer,
                kv,
                redis.Redis.from_url(redis_url),
                SchedulerConfig(8, 64),
                PROFILE,
            )
            trace: list[tuple[str, int, float]] = []
            result = serve_jobs(engine, redis_url, jobs, "t", trace=trace)
    finally:
        stop_process(process)
    assert result["tokens"] == 3 + 9 + 4 + 6
    assert set(result["device_by_path"]) == {"eager"}  # no CUDA graphs on the CPU
    steps, device_s, computed = result["device_by_path"]["eager"]
    assert len(trace) == steps > 0
    assert {path for path, _, _ in trace} == {"eager"}
    assert all(ms >= 0 for _, _, ms in trace)
    assert abs(sum(ms for _, _, ms in trace) / 1e3 - device_s) < 1e-3 + 1e-6 * steps
    assert sum(tokens for _, tokens, _ in trace) == computed
    prompts, outputs = sum(len(p) for p, _ in jobs), sum(m for _, m in jobs)
    assert computed == prompts + outputs - len(jobs)
    # the first step prefills the first 64 prompt tokens: the 5-token prompt and 59 of the 70
    assert trace[0][1] == 64
