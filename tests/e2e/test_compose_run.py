"""`docker compose up` for real: the CPU stack (docker-compose.yml + docker-compose.cpu.yml) in a
real Docker engine, with the `tiny` model, driven over HTTP through the published port.

Steps (each one's time is printed): the engine (.ci/install-docker.sh installs and starts one
where it can: root, Debian), the Debian base image (docker/debian-base.sh, or $BASE_IMAGE), the
build, `up -d --wait` (every healthcheck passes), a streamed completion, the compute container's
main process SIGKILLed (a crash, as the OOM killer does: `docker kill` counts as a deliberate stop,
after which Docker's restart policy does not restart the container) and restarted by Docker with
the next request served, a request queued while no worker runs kept across `docker compose
restart redis` (the append-only file on its volume) and answered once a worker is back, and
`docker compose down` with every container stopped by SIGTERM, inside its stop grace period.

Selected with `-m docker`; skips with one line where no engine can run. The images stay
(pagedserve-test:<worktree hash>, ...): a second run reuses them and the build cache; the
untagged ones the builds leave are removed.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pagedserve.redis_server import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.docker

FILES = ["-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.cpu.yml")]
LOCAL_BASE = "pagedserve-base:bookworm"  # docker/debian-base.sh's
TAG = hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]  # one image per worktree
STEP_TIMEOUT_S = 900  # generous: a cold build on 2 busy cores takes minutes
REQUEST_STREAM = "pagedserve:requests"  # contracts.queue_keys.REQUEST_STREAM


class Steps:
    """Prints each step's time to the terminal as it ends (outside pytest's capture)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys
        self.times: list[tuple[str, float]] = []

    def say(self, line: str) -> None:
        with self.capsys.disabled():
            print(f"\ncompose: {line}", end="", flush=True)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        yield
        took = time.monotonic() - start
        self.times.append((name, took))
        self.say(f"{name}: {took:.1f} s")


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    result = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and result.returncode != 0:
        pytest.fail(f"docker {' '.join(args)}: exit {result.returncode}\n{result.stderr[-3000:]}")
    return result.stdout


def engine_reason() -> str:
    """Empty when an engine and Compose v2 answer, else why not (one line)."""
    if shutil.which("docker") is None:
        return "no docker command"
    probe = ["docker", "compose", "version"], ["docker", "info", "--format", "{{.ServerVersion}}"]
    for argv in probe:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            return f"`{' '.join(argv[:2])}` fails: {last}"
    return ""


def torch_wheel() -> Path | None:
    """The CPU torch wheel of the Dockerfile's TORCH for Debian bookworm's Python 3.11, from the
    directories pip's `find-links` names (pip's configuration or $PIP_FIND_LINKS)."""
    version = re.search(r"ARG TORCH=torch==(\S+)", (ROOT / "Dockerfile").read_text())
    assert version, "the Dockerfile names no TORCH version"
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    places = re.findall(r"find-links='([^']*)'", listed)
    places += [os.environ.get("PIP_FIND_LINKS", "")]
    for place in " ".join(places).split():
        for wheel in sorted(Path(place).glob(f"torch-{version[1]}+cpu-cp311-*.whl")):
            return wheel
    return None


@contextmanager
def wheel_in_context() -> Iterator[str]:
    """Links a local CPU torch wheel into docker/wheels/ (the build's; ignored by git) for the
    build, and removes the link afterwards. Yields where torch comes from."""
    wheel = torch_wheel()
    if wheel is None:
        yield "the PyTorch CPU index (no local wheel)"
        return
    target = ROOT / "docker" / "wheels" / wheel.name
    made = not target.exists()
    if made:
        try:
            os.link(wheel, target)  # no copy on the same filesystem
        except OSError:
            shutil.copy2(wheel, target)
    try:
        yield str(wheel)
    finally:
        if made:
            target.unlink(missing_ok=True)


class Stack:
    """One compose project of the CPU stack."""

    def __init__(self, tmp: Path, base: str) -> None:
        self.project = f"pagedserve-test-{TAG}"  # one worktree's runs: one project
        self.port = free_port()
        empty = tmp / "empty"
        empty.mkdir()
        (tmp / "env").write_text("")  # not the checkout's .env
        self.env_file = str(tmp / "env")
        self.env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("PAGEDSERVE_") and not k.startswith("COMPOSE_")
        }
        self.env |= {
            "BASE_IMAGE": base,
            "MODEL": "tiny",
            "MODEL_DIR": str(empty),  # mounted at /model, unused by `tiny`
            "PAGEDSERVE_PORT": str(self.port),
            "PAGEDSERVE_IMAGE": f"pagedserve-test:{TAG}",
            "REDIS_IMAGE": f"pagedserve-test-redis:{TAG}",
        }

    def argv(self, *args: str) -> list[str]:
        return ["docker", "compose", "--env-file", self.env_file, "-p", self.project, *FILES, *args]

    def run(self, *args: str, timeout: float = STEP_TIMEOUT_S) -> str:
        result = subprocess.run(
            self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            pytest.fail(
                f"docker compose {' '.join(args)}: exit {result.returncode}\n"
                f"{result.stderr[-3000:]}\n{self.logs()}"
            )
        return result.stdout

    def build(self, steps: Steps, log: Path) -> None:
        """`docker compose build`, its output in ``log``; a line every 30 s saying where it is."""
        with log.open("w") as out:
            process = subprocess.Popen(
                self.argv("build", "--progress", "plain"),
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            assert process.stdout is not None
            start = last = time.monotonic()
            for line in process.stdout:
                out.write(line)
                if re.match(r"#\d+ \[", line) and time.monotonic() - last > 30:
                    last = time.monotonic()
                    steps.say(f"  building, {last - start:.0f} s: {line.strip()[:100]}")
            rc = process.wait()
        if rc != 0:
            pytest.fail(
                f"docker compose build: exit {rc}; the end of {log}:\n{log.read_text()[-4000:]}"
            )

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service, timeout=60).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def state(self, container: str) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(docker("inspect", "-f", "{{json .}}", container))
        return state

    def logs(self) -> str:
        result = subprocess.run(
            self.argv("logs", "--no-color", "--tail", "40"),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return f"--- docker compose logs --tail 40\n{result.stdout[-8000:]}"

    def redis(self, *command: str) -> str:
        return self.run("exec", "-T", "redis", "redis-cli", *command, timeout=60).strip()

    def completion(self, prompt: str, timeout_s: float = 60) -> str:
        """A streamed completion through the published port: its text, once [DONE] came with a
        finished choice (the SSE keep-alives, every 15 s, keep a queued request's socket busy)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        body = {"model": "pagedserve", "prompt": prompt, "max_tokens": 8, "stream": True}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200, (response.status, response.read()[:500])
        text, finish, done = "", None, False
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
        conn.close()
        assert done and finish in ("length", "stop"), (text, finish, done)
        return text

    def wait_healthy(
        self, container: str, restarts: int, timeout_s: float = STEP_TIMEOUT_S
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state(container)
            health = state["State"].get("Health", {}).get("Status")
            if state["RestartCount"] >= restarts and health == "healthy":
                return
            time.sleep(2)
        pytest.fail(
            f"{container} not healthy after {restarts} restarts in {timeout_s} s\n{self.logs()}"
        )


def crash(stack: Stack, container: str) -> int:
    """SIGKILLs the container's main process from inside (its PID in the kvstore's PID
    namespace, which the compute containers share); returns its host PID."""
    pid = int(stack.state(container)["State"]["Pid"])
    status = Path(f"/proc/{pid}/status").read_text()
    ns_pid = re.search(r"^NSpid:\s.*?(\d+)\s*$", status, re.M)
    assert ns_pid, status
    docker("exec", "-u", "0", container, "sh", "-c", f"kill -KILL {ns_pid[1]}")
    return pid


def base_image(steps: Steps) -> str:
    """$BASE_IMAGE, else the locally made Debian base (made now when missing, where mmdebstrap
    can), else debian:bookworm-slim from Docker Hub."""
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    inspect = subprocess.run(["docker", "image", "inspect", LOCAL_BASE], capture_output=True)
    if inspect.returncode == 0:
        return LOCAL_BASE
    if shutil.which("mmdebstrap") is None:
        return "debian:bookworm-slim"
    with steps.step(f"base image {LOCAL_BASE} (mmdebstrap)"):
        script = [str(ROOT / "docker" / "debian-base.sh"), LOCAL_BASE]
        made = subprocess.run(script, timeout=STEP_TIMEOUT_S).returncode == 0
    if not made:
        steps.say("docker/debian-base.sh failed: the build takes debian:bookworm-slim")
    return LOCAL_BASE if made else "debian:bookworm-slim"


def test_cpu_stack_under_compose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = Steps(capsys)
    with steps.step("engine"):
        reason = engine_reason()
        if reason:  # installs and starts one where it can (root, Debian); says why not
            subprocess.run(
                ["bash", str(ROOT / ".ci" / "install-docker.sh")], timeout=STEP_TIMEOUT_S
            )
            reason = engine_reason()
    if reason:
        pytest.skip(
            f"no Docker engine with Compose v2 ({reason}): "
            "sudo bash .ci/install-docker.sh installs and starts one"
        )
    base = base_image(steps)
    stack = Stack(tmp_path, base)
    try:
        with wheel_in_context() as torch_from:
            steps.say(f"base {base}, torch from {torch_from}, project {stack.project}")
            with steps.step("build"):
                stack.build(steps, tmp_path / "build.log")
        with steps.step("up -d --wait (every service healthy)"):
            stack.run("up", "-d", "--wait", "--wait-timeout", str(STEP_TIMEOUT_S))
        with steps.step("a streamed completion through the published port"):
            stack.completion("Hello")

        compute = stack.container("compute")
        with steps.step("compute crashed (SIGKILL), restarted by Docker, healthy"):
            old_pid = crash(stack, compute)
            stack.wait_healthy(compute, restarts=1)
        assert stack.state(compute)["State"]["Pid"] != old_pid
        with steps.step("the next request"):
            stack.completion("After the crash")

        with steps.step("stop compute"):
            stack.run("stop", "compute")
        answer: dict[str, Any] = {}

        def queued() -> None:
            try:
                answer["text"] = stack.completion("Queued", timeout_s=120)
            except BaseException as err:  # pytest.fail's exception too: reported below
                answer["error"] = err

        client = threading.Thread(target=queued, daemon=True)
        client.start()
        deadline = time.monotonic() + 60
        while stack.redis("XLEN", REQUEST_STREAM) != "1" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert stack.redis("XLEN", REQUEST_STREAM) == "1", "the request never reached the queue"
        with steps.step("restart redis with a request queued"):
            stack.run("restart", "redis")
        assert stack.redis("XLEN", REQUEST_STREAM) == "1", "the restart lost the queued request"
        with steps.step("start compute; the queued request answered"):
            stack.run("start", "compute")
            client.join(STEP_TIMEOUT_S)
        assert "error" not in answer, (
            f"the queued request failed: {answer['error']}\n{stack.logs()}"
        )
        assert "text" in answer, f"no answer to the queued request\n{stack.logs()}"
        deadline = time.monotonic() + 30  # acked (and deleted) in the worker's next step
        while stack.redis("XLEN", REQUEST_STREAM) != "0" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert stack.redis("XLEN", REQUEST_STREAM) == "0", "the answered request stayed queued"

        since = str(int(time.time()) - 1)
        with steps.step("down"):
            stack.run("down", "--volumes")
        events = docker(
            "events", "--since", since, "--until", str(int(time.time()) + 1),
            "--filter", f"label=com.docker.compose.project={stack.project}",
            "--filter", "type=container", "--format", "{{json .}}",
        )  # fmt: skip
        died = {}
        for line in events.splitlines():
            event = json.loads(line)
            attrs = event["Actor"]["Attributes"]
            assert not (event["Action"] == "kill" and attrs.get("signal") == "9"), (
                f"docker SIGKILLed {attrs['name']}: its stop grace period ran out"
            )
            if event["Action"] == "die":
                died[attrs["com.docker.compose.service"]] = attrs.get("exitCode")
        steps.say(f"exit codes on down: {died}")
        assert set(died) == {"redis", "kvstore", "compute", "gateway"}, died
        assert "137" not in died.values(), died
    finally:
        subprocess.run(
            stack.argv("down", "--volumes", "--remove-orphans", "--timeout", "5"),
            env=stack.env,
            capture_output=True,
            timeout=300,
            check=False,
        )
        # The images each service's build left untagged (all three build the one image).
        label = f"label=com.docker.compose.project={stack.project}"
        docker("image", "prune", "--force", "--filter", label, check=False)
        steps.say(
            "times: " + ", ".join(f"{name} {took:.0f} s" for name, took in steps.times) + "\n"
        )
