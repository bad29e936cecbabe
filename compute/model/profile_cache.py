"""The worker's cost-model profiles kept on disk, so a restarted worker registers without measuring.

One JSON file per ``ProfileKey`` (model files, device, dtype, code version, the settings the
profile depends on) under the cache directory. A file that does not decode, was written by
another format, or holds another key (an older code version writes under another name, so this
is a changed model whose path was reused, or a hash clash) is ignored with one log line and
replaced by the next measurement. Nothing here can stop a worker from starting: a cache that
cannot be read or written is logged and left alone.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import tempfile
import time
from importlib import metadata
from pathlib import Path

import msgspec
import torch
from transformers import PreTrainedModel

from compute.model.profile import Budget, Profiles, RecomputeProfile, measure_profiles
from compute.parallel.layers import TPGroup
from kvstore import protocol as p

log = logging.getLogger("pagedserve.compute")
FORMAT = 1
CACHE_ENV = "PAGEDSERVE_PROFILE_CACHE"
OFF = ("off", "none")
_CODE_PACKAGES = ("compute", "kernels")  # their sources decide what a forward costs
_VERSIONED = ("pagedserve", "torch", "transformers", "triton")


class ProfileKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a profile was measured for: ``model`` (the checkpoint's path, or ``tiny``),
    ``model_files`` (a digest of its files' names, sizes and modification times), ``device``
    (``describe_device``), ``dtype``, ``code`` (a digest of the package versions and of the
    forward path's sources), the block size, the tokens of the worker's graphs of prefill
    steps and the ranks of its tensor-parallel group."""

    model: str
    model_files: str
    device: str
    dtype: str
    code: str
    block_size: int
    graph_tokens: int
    ranks: int = 1

    def file_name(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:24] + ".json"


class CachedProfile(msgspec.Struct, forbid_unknown_fields=True):
    format: int
    key: ProfileKey
    measured_at: float  # unix time
    measure_s: float
    budget_s: float  # the budget it was measured within
    skipped: int  # points that budget left out
    prefill: list[tuple[int, float]]
    recompute: list[tuple[int, int, float]]
    graph_buckets: list[int]


def cache_dir(setting: str) -> Path | None:
    """The directory ``--profile-cache`` names: ``off``/``none``: None; '' the default,
    ``$PAGEDSERVE_PROFILE_CACHE`` (``off`` there too), else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``pagedserve/profiles``."""
    chosen = setting or os.environ.get(CACHE_ENV, "")
    if chosen.lower() in OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve" / "profiles"


def describe_device(device: torch.device) -> str:
    """The device as its speed depends on it: the GPU's name, memory, SM count and capability;
    the CPU's model name, its logical cores and the threads torch uses."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"cuda {props.name} {props.total_memory >> 20} MiB {props.multi_processor_count} SMs "
            f"sm_{props.major}{props.minor}"
        )
    return f"cpu {_cpu_name()} x{os.cpu_count()} threads {torch.get_num_threads()}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def code_version() -> str:
    """A digest of the versions of pagedserve, torch, transformers and triton and of every
    source file of the forward path (``compute``, ``kernels``)."""
    digest = hashlib.sha256()
    for name in _VERSIONED:
        try:
            digest.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=-;".encode())
    root = Path(__file__).resolve().parents[2]  # compute/model/ -> the repository
    for package in _CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_files(model: str) -> str:
    """A digest of the names, sizes and modification times of the checkpoint's files (``tiny``:
    its name: its weights come from a fixed seed)."""
    path = Path(model)
    if not path.is_dir():
        return model
    digest = hashlib.sha256()
    for entry in sorted(path.iterdir()):
        if entry.is_file():
            stat = entry.stat()
            digest.update(f"{entry.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def profile_key(
    model_name: str, model: PreTrainedModel, block_size: int, graph_tokens: int, ranks: int = 1
) -> ProfileKey:
    path = Path(model_name)
    return ProfileKey(
        str(path.resolve()) if path.is_dir() else model_name,
        model_files(model_name),
        describe_device(model.device),
        str(model.dtype).removeprefix("torch."),
        code_version(),
        block_size,
        graph_tokens,
        ranks,
    )


def load(directory: Path, key: ProfileKey) -> CachedProfile | None:
    """The profile cached for ``key``; None when there is none, or (logged) when the file is
    unreadable, corrupt, of another format or of another key."""
    path = directory / key.file_name()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("ignoring the cached cost-model profile %s: cannot read it (%s)", path, err)
        return None
    try:
        cached = msgspec.json.decode(raw, type=CachedProfile)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        log.warning("ignoring the cached cost-model profile %s: corrupt (%s)", path, err)
        return None
    if cached.format != FORMAT or cached.key != key:
        log.warning(
            "ignoring the cached cost-model profile %s: written for another %s",
            path,
            "format" if cached.format != FORMAT else "model, device or code",
        )
        return None
    seconds = [s for _, s in cached.prefill] + [s for *_, s in cached.recompute]
    if not all(math.isfinite(s) and s >= 0 for s in seconds):
        log.warning("ignoring the cached cost-model profile %s: corrupt (bad seconds)", path)
        return None
    return cached


def save(
    directory: Path, key: ProfileKey, profiles: Profiles, measured_at: float, budget_s: float
) -> Path | None:
    """Writes ``profiles`` for ``key``, measured within ``budget_s`` (atomically: a reader sees
    the old file or the new one); its path, or None (logged) if it could not be written."""
    cached = CachedProfile(
        FORMAT,
        key,
        measured_at,
        profiles.seconds,
        budget_s,
        profiles.skipped,
        profiles.prefill,
        profiles.recompute.points,
        profiles.recompute.graph_buckets,
    )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".profile-", suffix=".tmp")
        with os.fdopen(fd, "wb") as out:
            out.write(msgspec.json.encode(cached))
        path = directory / key.file_name()
        os.replace(tmp, path)
    except OSError as err:
        log.warning("could not cache the cost-model profile in %s: %s", directory, err)
        return None
    return path


def obtain(
    model_name: str,
    model: PreTrainedModel,
    block_size: int,
    graph_tokens: int,
    budget_s: float,
    cache: str,
    group: TPGroup | None = None,
) -> tuple[Profiles, p.ProfileOrigin]:
    """The profiles a worker registers with and where they came from: the cache's for this
    key (unless a budget left points out of it and ``budget_s`` is larger: measured again),
    else measured now within ``budget_s`` (and cached), else none (a budget of 0: the
    kvstore's priors). ``group``: the worker is rank 0 of this tensor-parallel group, whose
    other ranks follow the measured forwards."""
    directory = cache_dir(cache)
    ranks = group.size if group is not None else 1
    key = profile_key(model_name, model, block_size, graph_tokens, ranks)
    cached = load(directory, key) if directory is not None else None
    if cached is not None and cached.skipped and budget_s > cached.budget_s:
        log.info(
            "the cached cost-model profile left %d points out within %.0f s: measuring again "
            "within %.0f s",
            cached.skipped,
            cached.budget_s,
            budget_s,
        )
        cached = None
    if cached is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(cached.measured_at))
        log.info(
            "cost-model profile from the cache (measured %s in %.1f s): %s",
            when,
            cached.measure_s,
            directory / key.file_name() if directory is not None else "",
        )
        recompute = RecomputeProfile(cached.recompute, cached.graph_buckets)
        profiles = Profiles(cached.prefill, recompute, cached.skipped, cached.measure_s)
        origin = p.ProfileOrigin("cached", cached.measured_at, cached.measure_s, cached.skipped)
        return profiles, origin
    if budget_s <= 0:
        log.info("cost-model profile: none measured (--profile-budget-s 0): the kvstore's priors")
        empty = Profiles([], RecomputeProfile([], []), 0, 0.0)
        return empty, p.ProfileOrigin("prior", 0.0, 0.0, 0)
    log.info("cost-model profile: measuring forwards for at most %.0f s", budget_s)
    measured_at = time.time()
    profiles = measure_profiles(model, block_size, graph_tokens, Budget(budget_s), group)
    points = len(profiles.prefill) + len(profiles.recompute.points)
    log.info(
        "cost-model profile measured in %.1f s: %d prefill and %d recompute points, %d left out "
        "by the budget",
        profiles.seconds,
        len(profiles.prefill),
        len(profiles.recompute.points),
        profiles.skipped,
    )
    source: p.ProfileSource = "measured" if points else "prior"
    if points and directory is not None:
        save(directory, key, profiles, measured_at, budget_s)
    at = measured_at if points else 0.0
    return profiles, p.ProfileOrigin(source, at, profiles.seconds, profiles.skipped)
