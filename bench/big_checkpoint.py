"""A random-weight checkpoint too large to build as a model first (the 70B shape: 141 GB of bf16,
more than one GPU holds and more than one disk of a lent machine has room for): its config and
word-level tokenizer, then its tensors drawn on a GPU (normal of std ``initializer_range``; the
norms ones) and written, several files at once, as safetensors files of about 4 GiB with their
index, as ``save_pretrained`` lays a checkpoint out; a run cut short resumes. The files fill the
directories in order, each up to its free space (a tmpfs such as ``/dev/shm`` counts); those not
in the first are linked into it, which is the checkpoint the servers load
(``compute.parallel.sharding`` reads it).

    python bench/big_checkpoint.py --shape 70b /root/ck70 /dev/shm/ck70
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shapes import SHAPES, save_word_level_tokenizer  # noqa: E402

FILE_BYTES = 4 << 30
RESERVE_BYTES = 2 << 30  # left free in each directory
# files drawn and written at once: one writer wrote ~1 GB/s to a tmpfs, 8 of 32 cores 1 GB/s each
WRITERS = max(1, min(16, (os.cpu_count() or 8) // 4))
INDEX = "model.safetensors.index.json"


def tensor_shapes(config: PretrainedConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's tensors (as ``state_dict`` names them), from the model built on the
    meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()]


def files_of(
    shapes: list[tuple[str, tuple[int, ...]]], file_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors grouped into files of about ``file_bytes``, in order."""
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in shapes:
        nbytes = 2 * torch.Size(dims).numel()
        if files[-1] and size + nbytes > file_bytes:
            files.append([])
            size = 0
        files[-1].append((name, dims))
        size += nbytes
    return files


def free_space(directory: Path) -> int:
    return shutil.disk_usage(directory).free - RESERVE_BYTES


def write_checkpoint(
    config: PretrainedConfig,
    dirs: list[Path],
    device: str = "cuda",
    file_bytes: int = FILE_BYTES,
    room: Callable[[Path], int] = free_space,
) -> Path:
    """Writes the checkpoint of a Llama-family ``config`` over ``dirs`` (a file goes to the
    first directory with ``room`` for it), ``WRITERS`` files at a time; a file written whole
    before (a run cut short) is kept. Returns ``dirs[0]``."""
    home = dirs[0]
    for directory in dirs:
        directory.mkdir(parents=True, exist_ok=True)
    files = files_of(tensor_shapes(config), file_bytes)
    planned: list[tuple[Path, list[tuple[str, tuple[int, ...]]]]] = []
    taken = dict.fromkeys(dirs, 0)  # bytes planned into each directory
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(files):
        filename = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        nbytes = sum(2 * torch.Size(d).numel() for _, d in tensors)
        weight_map.update((name, filename) for name, _ in tensors)
        total += nbytes
        if (home / filename).exists():
            planned.append((home / filename, []))  # written whole before (renamed when done)
            continue
        target = next((d for d in dirs if room(d) - taken[d] >= nbytes), None)
        if target is None:
            raise SystemExit(f"no room for {filename} ({nbytes / 1e9:.1f} GB) in {dirs}")
        taken[target] += nbytes
        planned.append((target / filename, tensors))
    std, started = float(config.initializer_range), time.monotonic()
    done = 0

    def write(path: Path, tensors: list[tuple[str, tuple[int, ...]]]) -> None:
        nonlocal done
        if not tensors:
            return
        drawn = []
        for name, dims in tensors:
            tensor = torch.empty(dims, dtype=torch.bfloat16, device=device)
            tensor.fill_(1.0) if name.endswith("norm.weight") else tensor.normal_(0.0, std)
            drawn.append((name, tensor.cpu()))
        save_safetensors(path, drawn)
        if path.parent != home:
            (home / path.name).unlink(missing_ok=True)
            (home / path.name).symlink_to(path)
        done += sum(t.numel() * 2 for _, t in drawn)
        seconds = time.monotonic() - started
        print(f"wrote {path} ({done / 1e9:.0f} GB, {done / 1e9 / seconds:.1f} GB/s)", flush=True)

    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(lambda job: write(*job), planned))
    config.save_pretrained(home)
    save_word_level_tokenizer(home, config.vocab_size)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (home / INDEX).write_text(json.dumps(index, indent=2))
    return home


def save_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """``tensors`` (bf16, on the CPU) as a safetensors file: an 8-byte little-endian header
    length, the JSON header (each tensor's dtype, shape and byte range; padded to 8 bytes), then
    the bytes, written straight from the tensors' memory; under a ``.partial`` name until
    whole."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": "BF16", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for _, tensor in tensors:
            out.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
    partial.rename(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="70b")
    parser.add_argument("--device", default="cuda", help="where the tensors are drawn")
    parser.add_argument("dirs", nargs="+", type=Path, help="the first holds the checkpoint")
    args = parser.parse_args()
    print(write_checkpoint(SHAPES[args.shape](), args.dirs, args.device))


if __name__ == "__main__":
    main()
