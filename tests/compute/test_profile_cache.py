"""The on-disk cache of cost-model profiles: its key, hits and misses, and files it must ignore."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec
import pytest
from transformers import PreTrainedModel

from compute.model import profile_cache as pc
from compute.model.profile import Profiles, RecomputeProfile
from kvstore import protocol as p

PROFILES = Profiles(
    [(16, 0.0123), (256, 0.0456)],
    RecomputeProfile([(16, 0, 0.0123), (16, 2048, 0.0789)], [64, 128]),
    3,
    4.5,
)


@pytest.fixture(scope="module")
def tiny() -> PreTrainedModel:
    from compute.model.models import load_model

    model, _ = load_model("tiny", "float32", "cpu")
    return model


def key(**changes: object) -> pc.ProfileKey:
    base = pc.ProfileKey("tiny", "tiny", "cpu X", "float32", "abc", 16, 2048)
    return msgspec.structs.replace(base, **changes)


def test_cache_dir_setting_environment_and_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(pc.CACHE_ENV, str(tmp_path / "env"))
    assert pc.cache_dir(str(tmp_path / "flag")) == tmp_path / "flag"  # the flag wins
    assert pc.cache_dir("") == tmp_path / "env"
    assert pc.cache_dir("off") is None and pc.cache_dir("none") is None
    monkeypatch.setenv(pc.CACHE_ENV, "off")
    assert pc.cache_dir("") is None
    monkeypatch.delenv(pc.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pc.cache_dir("") == tmp_path / "xdg" / "pagedserve" / "profiles"


def test_the_key_tells_model_device_dtype_code_and_settings_apart(
    tiny: PreTrainedModel, tmp_path: Path
) -> None:
    same = pc.profile_key("tiny", tiny, 16, 2048)
    assert same == pc.profile_key("tiny", tiny, 16, 2048)
    assert same.device.startswith("cpu ") and same.dtype == "float32" and same.model == "tiny"
    names = {same.file_name()}
    for field in ("model", "model_files", "device", "dtype", "code"):
        names.add(msgspec.structs.replace(same, **{field: "other"}).file_name())
    names.add(pc.profile_key("tiny", tiny, 32, 2048).file_name())  # block size
    names.add(pc.profile_key("tiny", tiny, 16, 512).file_name())  # graph tokens
    assert len(names) == 8


def test_a_checkpoint_rewritten_in_place_is_another_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"1234")
    before = pc.model_files(str(tmp_path))
    assert pc.model_files(str(tmp_path)) == before
    os.utime(weights, ns=(1, 1))  # same size, another modification time
    assert pc.model_files(str(tmp_path)) != before
    assert pc.model_files("tiny") == "tiny"


def test_the_code_version_follows_the_forward_paths_sources() -> None:
    assert pc.code_version() == pc.code_version() and len(pc.code_version()) == 16
    assert pc._CODE_PACKAGES == ("compute", "kernels")


def test_a_saved_profile_is_found_under_its_key_only(tmp_path: Path) -> None:
    path = pc.save(tmp_path, key(), PROFILES, 1_700_000_000.0, 10.0)
    assert path == tmp_path / key().file_name()
    cached = pc.load(tmp_path, key())
    assert cached is not None
    assert (cached.prefill, cached.recompute) == (PROFILES.prefill, PROFILES.recompute.points)
    assert (cached.graph_buckets, cached.skipped, cached.measure_s) == ([64, 128], 3, 4.5)
    assert cached.budget_s == 10.0
    assert cached.measured_at == 1_700_000_000.0
    assert pc.load(tmp_path, key(dtype="bfloat16")) is None  # a miss: another file
    assert pc.load(tmp_path, key(code="newer")) is None
    assert [f.name for f in tmp_path.iterdir()] == [key().file_name()]  # no temporary left


def ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes) -> str:
    """Writes ``content`` where ``key()``'s profile lives; asserts ``load`` ignores it with one
    log line, and returns that line."""
    (tmp_path / key().file_name()).write_bytes(content)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.compute"):
        assert pc.load(tmp_path, key()) is None
    [record] = caplog.records
    return record.getMessage()


def valid(**changes: object) -> bytes:
    cached = pc.CachedProfile(pc.FORMAT, key(), 1.0, 2.0, 10.0, 0, [(16, 0.01)], [], [])
    return msgspec.json.encode(msgspec.structs.replace(cached, **changes))


def test_corrupt_old_or_foreign_files_are_ignored_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert "corrupt" in ignored(tmp_path, caplog, b"\x00not json")
    assert "corrupt" in ignored(tmp_path, caplog, valid()[:-5])  # truncated
    assert "corrupt" in ignored(tmp_path, caplog, b'{"format": 1}')  # fields missing
    assert "corrupt" in ignored(tmp_path, caplog, valid(prefill=[(16, -1.0)]))
    assert "corrupt" in ignored(tmp_path, caplog, valid().replace(b"0.01", b"NaN"))
    assert "another format" in ignored(tmp_path, caplog, valid(format=pc.FORMAT + 1))
    assert "another model" in ignored(tmp_path, caplog, valid(key=key(model="/elsewhere")))
    (tmp_path / key().file_name()).write_bytes(valid())
    assert pc.load(tmp_path, key()) is not None  # the same bytes, valid: a hit


def test_an_unwritable_cache_does_not_stop_the_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="pagedserve.compute"):
        assert pc.save(blocker / "profiles", key(), PROFILES, 1.0, 10.0) is None
    assert "could not cache" in caplog.text


def test_obtain_measures_once_then_reads_the_cache_and_replaces_a_corrupt_one(
    tiny: PreTrainedModel,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """First start: measured (within a small budget) and cached; second: the cached numbers
    and their date, nothing measured; a corrupted file: ignored, measured again, replaced."""
    with caplog.at_level(logging.INFO, logger="pagedserve.compute"):
        first, origin = pc.obtain("tiny", tiny, 16, 0, 1.0, str(tmp_path))
    assert origin.source == "measured" and origin.measured_at > 0 and first.prefill
    assert "profile: 16 tokens after 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve.compute"):
        second, again = pc.obtain("tiny", tiny, 16, 0, 1.0, str(tmp_path))
    assert again == p.ProfileOrigin("cached", origin.measured_at, origin.measure_s, first.skipped)
    assert (second.prefill, second.recompute) == (first.prefill, first.recompute)
    assert "profile from the cache" in caplog.text and "tokens after" not in caplog.text
    [path] = tmp_path.iterdir()
    path.write_bytes(b"{garbage")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve.compute"):
        _, third = pc.obtain("tiny", tiny, 16, 0, 1.0, str(tmp_path))
    assert third.source == "measured" and "corrupt" in caplog.text
    assert pc.load(tmp_path, pc.profile_key("tiny", tiny, 16, 0)) is not None  # rewritten


def test_no_budget_and_no_cache_is_the_prior(tiny: PreTrainedModel, tmp_path: Path) -> None:
    profiles, origin = pc.obtain("tiny", tiny, 16, 0, 0.0, str(tmp_path))
    assert origin == p.ProfileOrigin("prior", 0.0, 0.0, 0)
    assert profiles.prefill == [] and profiles.recompute.points == []
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing cached


def test_a_cut_profile_is_measured_again_only_within_a_larger_budget(
    tiny: PreTrainedModel, tmp_path: Path
) -> None:
    """A profile that left 3 points out within 0.5 s: a worker with no budget or the same one
    registers it; one given 1 s measures (and replaces it)."""
    pc.save(tmp_path, pc.profile_key("tiny", tiny, 16, 0), PROFILES, 5.0, 0.5)
    for budget in (0.0, 0.5):
        profiles, origin = pc.obtain("tiny", tiny, 16, 0, budget, str(tmp_path))
        assert origin == p.ProfileOrigin("cached", 5.0, 4.5, 3)
        assert profiles.prefill == PROFILES.prefill
    profiles, origin = pc.obtain("tiny", tiny, 16, 0, 1.0, str(tmp_path))
    assert origin.source == "measured" and profiles.prefill != PROFILES.prefill
    cached = pc.load(tmp_path, pc.profile_key("tiny", tiny, 16, 0))
    assert cached is not None and (cached.budget_s, cached.measured_at) == (1.0, origin.measured_at)
