"""docker-compose.cpu.yml laid over docker-compose.yml, docker/redis.Dockerfile and the build
pieces they share (the base image argument, the wheel directory, the pip CA secret), checked
without a Docker engine. tests/e2e/test_compose_run.py runs the same files in a real one."""

from __future__ import annotations

import argparse
import re
import subprocess
from typing import Any

import pytest

from kvstore.device import parse_memory
from tests.conftest import ROOT
from tests.e2e.test_compose_files import (
    ENV,
    PAGEDSERVE_SERVICES,
    Reset,
    dockerfile_instructions,
    load_compose,
    pagedserve_parser,
    parse,
)

CPU_FILE = "docker-compose.cpu.yml"


def by_keyword(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for keyword, rest in dockerfile_instructions(name):
        out.setdefault(keyword, []).append(rest)
    return out


def size_bytes(size: str) -> int:
    """Docker's sizes (``2gb``, ``512m``): binary units."""
    match = re.fullmatch(r"(\d+)([kmg]?)b?", size.lower())
    assert match, size
    return int(match[1]) * 1024 ** " kmg".index(match[2] or " ")


@pytest.fixture(scope="module")
def cpu() -> dict[str, Any]:
    services: dict[str, Any] = load_compose(ENV, CPU_FILE)["services"]
    return services


@pytest.fixture(scope="module")
def gpu() -> dict[str, Any]:
    services: dict[str, Any] = load_compose()["services"]
    return services


def commands(cpu: dict[str, Any], env: dict[str, str] = ENV) -> dict[str, argparse.Namespace]:
    services = load_compose(env, CPU_FILE)["services"] if env is not ENV else cpu
    parser = pagedserve_parser()
    return {
        name: parse(parser, [str(a) for a in services[name]["command"]], f"cpu {name}")
        for name in PAGEDSERVE_SERVICES
    }


def test_cpu_commands_match_the_gpu_file(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    """The same stack with ``--device cpu``: every flag the GPU file gives, the same endpoint,
    Redis and model; the GPU reservation removed (``!reset``), the rest (restart, healthchecks,
    IPC and PID sharing, volumes) inherited."""
    parser = pagedserve_parser()
    cpu_ns = commands(cpu)
    for name in PAGEDSERVE_SERVICES:
        gpu_ns = parse(parser, [str(a) for a in gpu[name]["command"]], f"gpu {name}")
        ns = cpu_ns[name]
        differ = {k for k in vars(ns) if getattr(ns, k) != getattr(gpu_ns, k)}
        expected = {"device", "kv_memory", "swap_memory"} if name != "gateway" else set()
        assert differ <= expected, (name, differ)
        assert ns.model == "/model"
        if name != "gateway":
            assert ns.device == "cpu" and isinstance(cpu[name]["deploy"], Reset), name
        for inherited in ("ipc", "pid", "restart", "volumes", "depends_on", "ports"):
            assert inherited not in cpu[name], (name, inherited)


def test_model_tiny(cpu: dict[str, Any]) -> None:
    """MODEL=tiny (the compose test's) reaches every process."""
    for name, ns in commands(cpu, {**ENV, "MODEL": "tiny"}).items():
        assert ns.model == "tiny", name


def test_the_pool_fits_the_shared_memory(cpu: dict[str, Any], gpu: dict[str, Any]) -> None:
    """The pool is a file in the kvstore's /dev/shm, which the workers get through ``ipc:``."""
    kvstore = commands(cpu)["kvstore"]
    gib, is_fraction = parse_memory(kvstore.kv_memory)
    assert not is_fraction, "a size in GiB, not a fraction of the host's memory"
    assert size_bytes(cpu["kvstore"]["shm_size"]) > gib * 2**30
    assert gpu["kvstore"]["ipc"] == "shareable" and gpu["compute"]["ipc"] == "service:kvstore"


def test_images_build_on_one_debian_base(cpu: dict[str, Any]) -> None:
    base = "debian:bookworm-slim"
    images = {cpu[name]["image"] for name in PAGEDSERVE_SERVICES}
    assert images == {"pagedserve:cpu"}, "the GPU file's pagedserve:latest stays the GPU image"
    for name in PAGEDSERVE_SERVICES:
        build = cpu[name]["build"]
        assert build["context"] == "." and build["args"] == {"BASE_IMAGE": base}, name
        assert build["secrets"] == ["pip-cert"], name
    redis = cpu["redis"]["build"]
    assert (ROOT / redis["context"] / redis["dockerfile"]).is_file()
    assert redis["args"] == {"BASE_IMAGE": base}
    local = load_compose({**ENV, "BASE_IMAGE": "pagedserve-base:bookworm"}, CPU_FILE)["services"]
    assert {s["build"]["args"]["BASE_IMAGE"] for s in local.values()} == {
        "pagedserve-base:bookworm"
    }


def test_redis_dockerfile() -> None:
    instructions = dockerfile_instructions("docker/redis.Dockerfile")
    assert instructions[:2] == [
        ("ARG", "BASE_IMAGE=debian:bookworm-slim"),
        ("FROM", "${BASE_IMAGE}"),
    ]
    keywords = by_keyword("docker/redis.Dockerfile")
    assert "redis-server" in " ".join(keywords["RUN"])
    assert keywords["USER"][-1] == "redis" and keywords["WORKDIR"][-1] == "/data"


def test_pip_cert_secret() -> None:
    """Every pip step of the Dockerfile may use the build secret ``pip-cert``, which the GPU
    file defines from $PIP_CERT (empty without it: pip's own bundle then)."""
    secrets = load_compose()["secrets"]
    assert secrets == {"pip-cert": {"file": "/dev/null"}}
    given = load_compose({**ENV, "PIP_CERT": "/etc/ssl/certs/ca.crt"})["secrets"]
    assert given["pip-cert"]["file"] == "/etc/ssl/certs/ca.crt"
    for run in by_keyword("Dockerfile")["RUN"]:
        if "pip install" in run:
            assert "--mount=type=secret,id=pip-cert" in run, run
            assert "export PIP_CERT=/run/secrets/pip-cert" in run, run


def test_base_image_and_wheels() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("ARG", "BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime")
    assert instructions[1] == ("FROM", "${BASE_IMAGE}")
    runs = " ".join(by_keyword("Dockerfile")["RUN"])
    bind = re.search(r"--mount=type=bind,source=(\S+?),", runs)
    assert bind and bind[1] == "docker/wheels"
    tracked = subprocess.run(
        ["git", "ls-files", bind[1]], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert tracked == ["docker/wheels/README.md"], "the bind's source must exist in a clone"
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "docker/wheels/torch-2.13.0+cpu-cp311-x.whl"], cwd=ROOT
    )
    assert ignored.returncode == 0, "wheels there must stay out of git"


def test_the_socket_directory_belongs_to_the_image_user(gpu: dict[str, Any]) -> None:
    """A fresh named volume takes the owner of the image's directory it is mounted on: the
    kvstore (not root) must be able to create its socket there."""
    keywords = by_keyword("Dockerfile")
    user = keywords["USER"][-1]
    mount = next(v for v in gpu["kvstore"]["volumes"] if v.startswith("kvstore-socket:"))
    directory = mount.split(":")[1]
    runs = " ".join(keywords["RUN"])
    assert re.search(rf"install -d -o {user} -g {user} (-m \d+ )?{directory}(\s|$)", runs)
