"""What ``--model`` names (``contracts.checkpoints``), without converting anything: names, files and
directories; the cache directory's key; the lock that makes processes starting together convert
once; what a failed conversion leaves. The real conversion of SmolLM2's GGUF file, by two
processes at once, is tested with the model itself (``tests/gateway/test_smollm2.py``)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from contracts.checkpoints import (
    SMOLLM2,
    TINY,
    convert_gguf,
    converted_dir,
    gguf_source,
    resolve_model,
)
from pagedserve.redis_server import free_port
from tests.conftest import ROOT


def test_names_files_and_directories(tmp_path: Path) -> None:
    assert resolve_model(TINY) == TINY and gguf_source(TINY) is None
    for name in (SMOLLM2, "SmolLM2"):  # the package `make` installs
        source = gguf_source(name)
        assert source is not None and source.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert source.is_file()
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "other.gguf").write_bytes(b"GGUF")  # config.json wins: a checkpoint
    assert resolve_model(str(checkpoint)) == str(checkpoint)
    holder = tmp_path / "holder"
    holder.mkdir()
    (holder / "model.Q4_0.gguf").write_bytes(b"GGUF")
    assert gguf_source(str(holder)) == holder / "model.Q4_0.gguf"
    assert gguf_source(str(holder / "model.Q4_0.gguf")) == holder / "model.Q4_0.gguf"
    (holder / "model.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"several GGUF files \(model.Q4_0.gguf, model"):
        gguf_source(str(holder))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"neither a config\.json nor a \.gguf file"):
        gguf_source(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="is neither 'tiny', 'smollm2', a checkpoint"):
        resolve_model(str(tmp_path / "missing"))


def test_the_cache_directory_follows_the_files_bytes(tmp_path: Path) -> None:
    one, two = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (one, two):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(100))
    cache = tmp_path / "cache"
    assert converted_dir(one, cache) == converted_dir(two, cache)  # a copy converts once
    assert converted_dir(one, cache).parent == cache / "checkpoints"
    two.write_bytes(b"GGUF" + bytes(101))
    assert converted_dir(one, cache) != converted_dir(two, cache)  # a changed file again


def test_a_process_waiting_on_the_lock_finds_the_others_checkpoint(tmp_path: Path) -> None:
    source, cache = tmp_path / "m.gguf", tmp_path / "cache"
    source.write_bytes(b"not parsed: the checkpoint is there when the lock is released")
    target = converted_dir(source, cache)
    target.parent.mkdir(parents=True)
    found: list[Path] = []
    with open(target.with_name(target.name + ".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting
        waiter = threading.Thread(target=lambda: found.append(convert_gguf(source, cache)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not found  # it waits for the lock
        target.mkdir()  # the other process renames its finished checkpoint into place
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join(30)
    assert found == [target]
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name, f"{target.name}.lock"]


def test_a_failed_conversion_leaves_nothing_half_written(tmp_path: Path) -> None:
    source, cache = tmp_path / "broken.gguf", tmp_path / "cache"
    source.write_bytes(b"GGUF" + bytes(64))
    target = converted_dir(source, cache)
    stale = target.parent / f".{target.name}.killed"  # a killed conversion's temporary directory
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    with pytest.raises(Exception):  # noqa: B017 (whatever the GGUF reader raises on bad bytes)
        convert_gguf(source, cache)
    assert sorted(p.name for p in target.parent.iterdir()) == [f"{target.name}.lock"]


def test_up_refuses_a_model_it_cannot_find_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    command = [sys.executable, "-m", "pagedserve.cli", "up", "--model", str(missing)]
    command += ["--port", str(free_port()), "--redis-dir", str(tmp_path / "redis")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"pagedserve up: model '{missing}' is neither 'tiny', 'smollm2', a checkpoint directory "
        "nor a .gguf file"
    ]
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_a_checkpoint_file_the_process_cannot_read_is_named_in_one_line(tmp_path: Path) -> None:
    """A checkpoint whose weights only their owner may read (0600), loaded by another user (a
    container's): one line naming the file, not transformers' "No such file"."""
    weights = tmp_path / "model.safetensors"
    (tmp_path / "config.json").write_text("{}")
    weights.write_bytes(b"weights")
    if os.getuid() == 0:  # root reads anything: the file is another user's, and the check
        if shutil.which("setpriv") is None:  # runs without root's power to read it
            pytest.skip("as root this needs util-linux's setpriv")
        os.chown(weights, 65534, 65534)
        weights.chmod(0o600)
        check = f"from contracts.checkpoints import gguf_source; gguf_source({str(tmp_path)!r})"
        drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
        run = subprocess.run(
            [*drop, sys.executable, "-c", check],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode != 0, run.stdout
        error = run.stderr.strip().splitlines()[-1]
    else:
        weights.chmod(0o000)
        with pytest.raises(FileNotFoundError) as raised:
            gguf_source(str(tmp_path))
        error = f"FileNotFoundError: {raised.value}"
    assert error.startswith("FileNotFoundError: ") and "cannot read model.safetensors" in error
    assert "config.json" not in error, error
    weights.chmod(0o644)
    assert gguf_source(str(tmp_path)) is None  # readable: a checkpoint directory
