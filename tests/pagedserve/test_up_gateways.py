"""`pagedserve up --gateways 2`: two gateway processes on one port (SO_REUSEPORT), /metrics
summing their request metrics whichever one answers, and the port still served while one of
them is killed and restarted."""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedserve.redis_server import free_port
from tests.pagedserve.test_up import stream_one_completion, up_command
from tests.pagedserve.test_up_supervised import child_pids, start_logged, wait_for


def gateway_pids(up: subprocess.Popen[bytes]) -> set[int]:
    return child_pids(up, "gateway")


def finished_requests(url: str) -> float:
    """``request_success_total`` summed over its labels, from one scrape of /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    counts = re.findall(r"^pagedserve:request_success_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(c) for c in counts)


def stream_all(example: str, n: int, log: Callable[[], str]) -> None:
    """``n`` completions streamed at once, 6 connections at a time; a failed one names the
    stack's log (a gateway that died says why there)."""
    try:
        with ThreadPoolExecutor(6) as pool:
            assert len(list(pool.map(lambda _: stream_one_completion(example), range(n)))) == n
    except OSError as err:
        raise AssertionError(f"{err!r}; the log of up:\n{log()[-8000:]}") from err


def test_two_gateways_share_the_port_sum_their_metrics_and_survive_a_kill(
    tmp_path: Path,
) -> None:
    endpoint = f"ipc:///tmp/pagedserve-up-{uuid.uuid4().hex[:8]}.sock"
    port, log_path = free_port(), tmp_path / "up.log"
    flags = ["--gateways", "2", "--restart-backoff-s", "0.5"]
    up, log = start_logged(up_command(port, endpoint, tmp_path / "redis", *flags), log_path)
    try:
        wait_for("the banner", lambda: "ids (" in log(), 180, up)
        banner = log()[log().index("pagedserve is up") :].splitlines()
        assert "2 gateway process(es)" in banner[0], banner
        url = banner[0].split(" at ")[1].split(" ")[0]
        example = banner[2].removeprefix("try: ")
        first = gateway_pids(up)
        assert len(first) == 2, log()
        wait_for("both gateways", lambda: log().count("with SO_REUSEPORT") == 2, 60, up)
        # Each stream ends with [DONE] (stream_one_completion checks; its text may be empty:
        # the random model may stop at once), a connection each: the kernel spreads them.
        stream_all(example, 12, log)
        # Each scrape lands on either process and counts the requests of both.
        assert [finished_requests(url) for _ in range(4)] == [12.0] * 4
        killed = min(first)
        subprocess.run(["kill", "-9", str(killed)], check=True)
        # Until every thread of it has exited (reaped: a zombie leader's threads may still hold
        # its socket), connections the kernel hands that socket are reset with it (sysctl
        # net.ipv4.tcp_migrate_req=1 passes them to the other one).
        wait_for("the kill", lambda: not Path(f"/proc/{killed}").exists(), 30, up)
        for _ in range(6):  # the other gateway keeps the port served meanwhile
            stream_one_completion(example)
        wait_for("the gateway restarted", lambda: len(gateway_pids(up) - {killed}) == 2, 60, up)
        wait_for("it listens", lambda: log().count("with SO_REUSEPORT") == 3, 60, up)
        before = finished_requests(url)
        assert before == 18.0  # the killed process's counts stay in
        stream_all(example, 6, log)
        assert [finished_requests(url) for _ in range(4)] == [before + 6] * 4
        assert "Traceback" not in log(), log()
    finally:
        up.send_signal(signal.SIGINT)
        try:
            assert up.wait(90) == 0, log()
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert log().count("gateway stopped") == 2, log()  # both drained at Ctrl-C
