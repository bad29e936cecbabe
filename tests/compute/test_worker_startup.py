"""A real worker process's start-up: a cached cost-model profile is registered without measuring,
and the start-up's phases are logged in one line (real kvstore, Redis and worker processes)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from compute.batch.scheduler import SchedulerConfig
from compute.model import profile_cache as pc
from compute.model.models import load_model
from compute.model.profile import Profiles, RecomputeProfile
from compute.worker import ComputeConfig
from kvstore import protocol as p
from kvstore.client import KVClient
from pagedserve.procs import spawn_process, wait_for_workers
from tests.conftest import start_kvstore, stop_process

DB = 9
# numbers no measurement gives: what the kvstore holds can only come from the file
CACHED = Profiles(
    [(16, 0.0123456), (512, 0.0654321)],
    RecomputeProfile([(16, 0, 0.0123456), (256, 2048, 0.0777777)], []),
    7,
    3.25,
)


def test_a_worker_with_a_cached_profile_registers_without_measuring(
    redis_url: str, tmp_path: Path
) -> None:
    config, scheduling = ComputeConfig(), SchedulerConfig()
    model, _ = load_model("tiny", config.dtype, "cpu")  # the worker's model, as it loads it
    graph_tokens = min(config.cuda_graph_max_tokens, scheduling.max_num_batched_tokens)
    key = pc.profile_key("tiny", model, 16, graph_tokens)
    cache = tmp_path / "profiles"
    assert pc.save(cache, key, CACHED, 1_700_000_000.0, config.profile_budget_s) is not None
    kvstore, endpoint = start_kvstore("--model", "tiny")
    log = tmp_path / "worker.log"
    url = redis_url.rsplit("/", 1)[0] + f"/{DB}"
    flags = ["--model", "tiny", "--device", "cpu", "--kvstore", endpoint, "--redis-url", url]
    flags += ["--worker-id", "cached", "--profile-cache", str(cache)]
    with log.open("wb") as out:
        worker = spawn_process("compute", flags, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_workers(endpoint, 1, [worker, kvstore], 120)
        with KVClient(endpoint) as client:
            stats = client.call(p.GetStats(0))
        [row] = stats.workers
        assert row.profile_origin == p.ProfileOrigin("cached", 1_700_000_000.0, 3.25, 7)
        assert row.prefill_profile == CACHED.prefill
        assert row.recompute_profile == CACHED.recompute.points
    finally:
        stop_process(worker)
        stop_process(kvstore)
    text = log.read_text()
    assert "cost-model profile from the cache" in text
    assert "prefill profile:" not in text and "recompute profile:" not in text  # no forward
    [phases] = re.findall(r"start-up phases: (.*)", text)
    assert re.fullmatch(
        r"python [\d.]+ s, imports [\d.]+ s, model [\d.]+ s, "
        r"profile [\d.]+ s \(cached, 7 points past its budget\), "
        r"register [\d.]+ s, gc [\d.]+ s; [\d.]+ s in all",
        phases,
    ), phases
