"""The embedded Redis: durable in a directory (append-only file, same port next time, kept on
stop), ephemeral for the tests' fixture (directory removed on stop), and the external Redis
watch. Real redis-server processes."""

from __future__ import annotations

import logging
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pagedserve.redis_server import EmbeddedRedis, RedisServer, RedisWatch


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[EmbeddedRedis]]:
    """Embedded servers a test starts (REDIS_URL unset: a real child each); stopped at the end."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    started: list[EmbeddedRedis] = []
    yield started
    for server in started:
        server.stop()


def test_durable_redis_keeps_its_data_and_port_across_a_kill(
    tmp_path: Path, servers: list[EmbeddedRedis]
) -> None:
    directory = tmp_path / "state" / "redis"
    first = EmbeddedRedis.start(directory=directory)
    servers.append(first)
    assert first.process is not None and first.server is not None
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    port = first.server.port
    assert (directory / "port").read_text().strip() == str(port)
    assert first.url == f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(first.url)
    client.set("kept", "yes")
    client.xadd("req:stream", {"n": "1"})
    assert client.config_get("appendonly")["appendonly"] == "yes"
    assert client.config_get("appendfsync")["appendfsync"] == "everysec"
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    time.sleep(1.5)  # everysec: the AOF has it within about a second
    first.process.send_signal(signal.SIGKILL)
    first.process.wait()
    # Another `up` cannot take the directory while the first one holds it.
    with pytest.raises(RuntimeError, match="in use by another pagedserve up"):
        RedisServer.durable_in(directory)
    first.server.close()  # what `up` does when it exits: releases the directory
    second = EmbeddedRedis.start(directory=directory)
    servers.append(second)
    assert second.url == first.url  # the recorded port, free again
    client = redis.Redis.from_url(second.url)
    assert client.get("kept") == b"yes"
    assert client.xlen("req:stream") == 1
    second.stop()
    assert (directory / "appendonly.aof").stat().st_size > 0  # stop deletes nothing
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(second.url, socket_connect_timeout=1).ping()


def test_the_recorded_port_in_use_gives_another_port(
    tmp_path: Path, servers: list[EmbeddedRedis]
) -> None:
    directory = tmp_path / "redis"
    first = EmbeddedRedis.start(directory=directory)
    servers.append(first)
    first.stop()
    assert first.server is not None
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", first.server.port))
        squatter.listen()
        second = EmbeddedRedis.start(directory=directory)
        servers.append(second)
        assert second.server is not None and second.server.port != first.server.port
        assert (directory / "port").read_text().strip() == str(second.server.port)
        with pytest.raises(RuntimeError, match="is in use; pass another --redis-port"):
            RedisServer.durable_in(tmp_path / "other", port=first.server.port)


def test_ephemeral_redis_removes_its_directory(servers: list[EmbeddedRedis]) -> None:
    server = EmbeddedRedis.start()
    servers.append(server)
    assert server.server is not None and not server.server.durable
    directory = server.server.directory
    assert directory.is_dir()
    assert redis.Redis.from_url(server.url).config_get("appendonly")["appendonly"] == "no"
    server.stop()
    assert not directory.exists()


def test_external_redis_watch_logs_once_down_and_once_back(
    tmp_path: Path, servers: list[EmbeddedRedis], caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "redis"
    server = EmbeddedRedis.start(directory=directory)
    servers.append(server)
    watch = RedisWatch(server.url, interval_s=0.0)
    caplog.set_level(logging.INFO, "pagedserve.redis")
    watch.check()
    server.stop()
    for _ in range(3):
        watch.check()
    server = EmbeddedRedis.start(directory=directory)
    servers.append(server)
    for _ in range(3):
        watch.check()
    messages = [r.getMessage() for r in caplog.records if "redis redis://" in r.getMessage()]
    assert len(messages) == 2, messages
    assert " is down: " in messages[0] and " is back after " in messages[1]
