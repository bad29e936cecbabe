"""docker-compose.gpus2.yml laid over docker-compose.yml, merged by Compose itself (`docker
compose config`: no engine, no GPU needed; skipped where no Compose v2 answers): one kvstore
owning a pool on each of two GPUs, a worker service per GPU bound to its pool, the gateway
waiting for both. Each command goes through the real `pagedserve` parser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.e2e.test_compose_files import ENV, load_compose, pagedserve_parser, parse

FILES = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.gpus2.yml")]


def merged(env: dict[str, str]) -> dict[str, Any]:
    if shutil.which("docker") is None:
        pytest.skip("no docker command")
    command = ["docker", "compose", *FILES, "config", "--format", "json"]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**environment, **env}
    )
    if result.returncode != 0 and "is not a docker command" in result.stderr:
        pytest.skip("no Compose v2")
    assert result.returncode == 0, result.stderr
    services: dict[str, Any] = json.loads(result.stdout)["services"]
    return services


def gpus(service: dict[str, Any]) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    return [gpu for device in devices for gpu in device["device_ids"]]


def test_one_kvstore_two_pools_a_worker_service_per_gpu() -> None:
    services = merged({**ENV, "PAGEDSERVE_GPU": "2", "PAGEDSERVE_GPU_1": "5"})
    parser = pagedserve_parser()
    argv = {name: [str(a) for a in services[name]["command"]] for name in services}
    kvstore = parse(parser, argv["kvstore"], "kvstore")
    assert kvstore.data_parallel_size == 2 and kvstore.device == "cuda"
    assert gpus(services["kvstore"]) == ["2", "5"]  # pool 0 on its first, pool 1 on its second
    workers = {name: parse(parser, argv[name], name) for name in ("compute", "compute-1")}
    assert [workers[n].pool for n in ("compute", "compute-1")] == [0, 1]
    assert [gpus(services[n]) for n in ("compute", "compute-1")] == [["2"], ["5"]]
    same = {k for k in vars(workers["compute"]) if k != "pool"}
    assert all(getattr(workers["compute"], k) == getattr(workers["compute-1"], k) for k in same)
    for name in ("compute", "compute-1"):  # each maps the kvstore's pools through its IPC
        assert services[name]["ipc"] == "service:kvstore"
        assert services[name]["pid"] == "service:kvstore"
        assert services[name]["depends_on"]["kvstore"]["condition"] == "service_healthy"
        assert services[name]["healthcheck"]["test"][4] == "worker"
    assert {"compute", "compute-1"} <= set(services["gateway"]["depends_on"])
    base = load_compose({**ENV, "PAGEDSERVE_GPU": "2"})["services"]
    one_gpu = parse(parser, [str(a) for a in base["gateway"]["command"]], "gateway")
    assert parse(parser, argv["gateway"], "gateway") == one_gpu  # routing needs no flag
    base_kvstore = parse(parser, [str(a) for a in base["kvstore"]["command"]], "kvstore")
    differ = {k for k in vars(kvstore) if getattr(kvstore, k) != getattr(base_kvstore, k)}
    assert differ == {"data_parallel_size"}  # else the one-GPU file's kvstore
    base_worker = parse(parser, [str(a) for a in base["compute"]["command"]], "compute")
    assert base_worker == workers["compute"]
