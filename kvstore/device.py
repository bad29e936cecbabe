"""The pool tensors, their export and swap copies (with ``kvstore/peer_copy.py``, the kvstore's
only torch code).

Layout (block-major): ``pool: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads,
head_dim]``. Why: a block (every layer's K and V) is one contiguous run of 0.5 MiB
(Llama-3.2-1B-shaped) to 2 MiB (Llama-3.1-8B-shaped), so a swap moves large runs instead of
16-32 KiB pieces (which cross the host link at ~1-5 GB/s on the H200 against ~55 GB/s for large
copies); attention still reads contiguous ``[block_size, kv_heads, head_dim]`` runs (16-32 KiB)
per (block, layer, K|V), through the per-layer views ``pool[:, layer, 0|1]``.

Swap-out gathers the GPU blocks into a staging buffer on the device (``index_select``, ~TB/s) and
copies it to the pinned CPU pool in one transfer per run of consecutive CPU ids; swap-in mirrors
it. All on the daemon's own CUDA stream, synchronised before the daemon replies.

Copies between two pools of the host (GPU to GPU over NVLink) are ``kvstore/peer_copy.py``'s.

On CPU the pool is ``/dev/shm/pagedserve-kv-<pid>-<random>``, mode 0600 (workers run as the
daemon's user), flock-ed by its daemon for its life. A SIGKILLed daemon leaves it behind: the next
one removes such files (``remove_stale_pool_files``) before it allocates.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Protocol

import torch

from contracts.model_config import KVGeometry
from kvstore.cost_model import SwapCalibration, fit_linear
from kvstore.mapping import map_shm, pool_shape, torch_dtype
from kvstore.protocol import CudaIpcHandle, PoolInfo

log = logging.getLogger("pagedserve.kvstore")
STAGING_BYTES = 256 << 20
GiB = 1 << 30
SHM_DIR = "/dev/shm"
SHM_PREFIX = "pagedserve-kv-"
_POOL_FILE = re.compile(re.escape(SHM_PREFIX) + r"([1-9][0-9]{0,6})-.+")


def parse_memory(spec: str) -> tuple[float, bool]:
    """``(value, is_fraction)``: ``"8"`` and ``"8GiB"`` are 8 GiB; a bare number below 1 is a
    fraction of free memory. Raises ValueError on anything else or a negative value."""
    raw = spec.strip().lower()
    text = raw.removesuffix("gib").removesuffix("gb")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(
            f"memory {spec!r}: expected GiB (e.g. 8) or a fraction (e.g. 0.9)"
        ) from None
    if value < 0:
        raise ValueError(f"memory {spec!r} must not be negative")
    return value, value < 1.0 and text == raw


def blocks_for_memory(spec: str, block_bytes: int, device: str) -> int:
    """Blocks that fit ``spec`` (see ``parse_memory``; a fraction is of the free memory of
    ``device``: ``cudaMemGetInfo`` on a GPU, MemAvailable on CPU). At least one block."""
    value, is_fraction = parse_memory(spec)
    gib = value * free_memory_bytes(device) / GiB if is_fraction else value
    blocks = int(gib * GiB) // block_bytes
    if blocks < 1:
        raise ValueError(f"memory {spec!r} holds no block of {block_bytes} bytes")
    return blocks


def blocks_in_gib(spec: str, block_bytes: int) -> int:
    """Blocks in ``spec`` GiB (no fraction; ``"0"`` is zero blocks)."""
    value, _ = parse_memory(spec)
    return int(value * GiB) // block_bytes


def free_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def contiguous_runs(ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(position in ids, first id, length)`` of each run of consecutive ids."""
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            yield start, ids[start], i - start
            start = i


class DevicePools:
    """Owns the GPU (or ``/dev/shm``) pool and the CPU swap pool; exports the first, swaps."""

    def __init__(
        self,
        geometry: KVGeometry,
        block_size: int,
        num_blocks: int,
        num_cpu_blocks: int,
        device: str,
    ) -> None:
        self.geometry, self.block_size, self.device = geometry, block_size, torch.device(device)
        self.block_bytes = geometry.block_bytes(block_size)
        self.shm_path = ""
        self._shm_fd = -1
        dtype = torch_dtype(geometry.dtype)
        shape = pool_shape(geometry, block_size, num_blocks)
        log.info(
            "allocating KV pool: %d blocks x %.2f MiB = %.2f GiB on %s",
            num_blocks,
            self.block_bytes / 2**20,
            num_blocks * self.block_bytes / GiB,
            device,
        )
        if self.device.type == "cuda":
            self.pool = torch.empty(shape, dtype=dtype, device=self.device)
            self.stream = torch.cuda.Stream(self.device)
        else:
            self.shm_path = f"{SHM_DIR}/{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            nbytes = num_blocks * self.block_bytes
            self._shm_fd = create_shm_file(self.shm_path, nbytes)
            self.pool = map_shm(self.shm_path, shape, dtype)
        log.info(
            "allocating CPU swap pool: %d blocks = %.2f GiB%s",
            num_cpu_blocks,
            num_cpu_blocks * self.block_bytes / GiB,
            " (pinned)" if self.device.type == "cuda" else "",
        )
        cpu_shape = pool_shape(geometry, block_size, num_cpu_blocks)
        self.cpu_pool = torch.empty(cpu_shape, dtype=dtype, pin_memory=self.device.type == "cuda")
        # swaps and copies to another pool go through it, STAGING_BYTES at a time
        staging_blocks = max(1, min(STAGING_BYTES // self.block_bytes, num_blocks))
        self.staging = torch.empty(
            pool_shape(geometry, block_size, staging_blocks), dtype=dtype, device=self.device
        )

    # ------------------------------------------------------------------ export
    def export(self) -> PoolInfo:
        shape = list(self.pool.shape)
        if self.device.type != "cuda":
            return PoolInfo(
                "shm", shape, self.geometry.dtype, self.block_size, shm_path=self.shm_path
            )
        fields = self.pool.untyped_storage()._share_cuda_()
        _device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
        uuid_str = str(torch.cuda.get_device_properties(self.device).uuid)
        cuda = CudaIpcHandle(
            uuid_str,
            bytes(handle),
            size,
            offset,
            bytes(ref_handle),
            ref_offset,
            bytes(event_handle or b""),
            bool(event_sync),
        )
        return PoolInfo("cuda_ipc", shape, self.geometry.dtype, self.block_size, cuda=cuda)

    def close(self) -> None:
        if self.shm_path and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)
        if self._shm_fd >= 0:
            os.close(self._shm_fd)  # drops the lock
            self._shm_fd = -1

    # ------------------------------------------------------------------ swap
    def swap_out(self, pairs: list[tuple[int, int]]) -> float:
        """Copies GPU blocks to CPU blocks (``(gpu, cpu)`` pairs); returns seconds, synchronised."""
        return self._move(pairs, to_cpu=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> float:
        """Copies CPU blocks to GPU blocks (``(cpu, gpu)`` pairs); returns seconds, synchronised."""
        return self._move([(g, c) for c, g in pairs], to_cpu=False)

    def load_from(self, other: DevicePools, pairs: list[tuple[int, int]]) -> float:
        """Copies ``other``'s CPU-tier blocks into this pool (``(its cpu, our gpu)`` pairs, same
        geometry); returns seconds, synchronised."""
        if other.cpu_pool.shape[1:] != self.cpu_pool.shape[1:]:
            raise ValueError("a load between pools of different geometries")
        return self._move([(g, c) for c, g in pairs], to_cpu=False, host=other.cpu_pool)

    def _move(
        self, pairs: list[tuple[int, int]], to_cpu: bool, host: torch.Tensor | None = None
    ) -> float:
        """``(gpu, cpu)`` pairs between this pool and ``host`` (default: its own CPU tier)."""
        start = time.perf_counter()
        self.issue(pairs, to_cpu, host)
        self.wait()
        return time.perf_counter() - start

    def issue(
        self, pairs: list[tuple[int, int]], to_cpu: bool, host: torch.Tensor | None = None
    ) -> None:
        """Queues ``_move``'s copies on the pool's own stream without waiting for them
        (``wait`` does): the ranks of a group issue theirs, then wait, so that their GPUs'
        host links work at once."""
        if not pairs:
            return
        pairs = sorted(pairs, key=lambda pair: pair[1])  # CPU ids in order: longest runs
        chunk = self.staging.shape[0]
        cpu_pool = self.cpu_pool if host is None else host
        with torch.cuda.stream(self.stream) if self.device.type == "cuda" else nullcontext():
            for lo in range(0, len(pairs), chunk):
                part = pairs[lo : lo + chunk]
                gpu_ids = torch.tensor([g for g, _ in part], device=self.device)
                staging = self.staging[: len(part)]
                cpu_ids = [c for _, c in part]
                if to_cpu:
                    torch.index_select(self.pool, 0, gpu_ids, out=staging)
                for pos, first, n in contiguous_runs(cpu_ids):
                    run = cpu_pool[first : first + n]
                    if to_cpu:
                        run.copy_(staging[pos : pos + n], non_blocking=True)
                    else:
                        staging[pos : pos + n].copy_(run, non_blocking=True)
                if not to_cpu:
                    self.pool.index_copy_(0, gpu_ids, staging)

    def wait(self) -> None:
        """Returns once every copy ``issue`` queued is done."""
        if self.device.type == "cuda":
            self.stream.synchronize()

    def calibrate(self, sizes: tuple[int, ...] = (1, 4, 16, 64)) -> SwapCalibration | None:
        return calibrate_swaps(self, self.pool.shape[0], self.cpu_pool.shape[0], sizes)


class Swaps(Protocol):
    block_bytes: int

    def swap_out(self, pairs: list[tuple[int, int]]) -> float: ...
    def swap_in(self, pairs: list[tuple[int, int]]) -> float: ...


def calibrate_swaps(
    mover: Swaps,
    gpu_blocks: int,
    cpu_blocks: int,
    sizes: tuple[int, ...] = (1, 4, 16, 64),
    repeats: int = 3,
) -> SwapCalibration | None:
    """Times ``mover``'s swap-out and swap-in of ``sizes`` blocks (scattered GPU ids,
    consecutive CPU ids, as the allocators hand them out) and fits ``fixed + n * per_block`` to
    each direction."""
    sizes = tuple(n for n in sizes if n <= min(cpu_blocks, gpu_blocks))
    if not sizes:
        return None
    gen = torch.Generator().manual_seed(0)
    samples: list[tuple[int, float, float]] = []
    for n in sizes:
        gpu_ids = torch.randperm(gpu_blocks, generator=gen)[:n].tolist()
        pairs = list(zip(gpu_ids, range(n), strict=True))
        mover.swap_out(pairs)  # warm-up
        outs = sorted(mover.swap_out(pairs) for _ in range(repeats))
        ins = sorted(mover.swap_in([(c, g) for g, c in pairs]) for _ in range(repeats))
        samples.append((n, outs[repeats // 2], ins[repeats // 2]))
        log.info(
            "calibrating swap: %d blocks out %.3f ms, in %.3f ms",
            n,
            samples[-1][1] * 1e3,
            samples[-1][2] * 1e3,
        )
    return SwapCalibration(
        mover.block_bytes,
        fit_linear([(n, out) for n, out, _ in samples]),
        fit_linear([(n, inn) for n, _, inn in samples]),
        samples,
    )


def create_shm_file(path: str, nbytes: int) -> int:
    """Creates ``path`` (which must not exist; a symlink is refused), mode 0600, ``nbytes`` long,
    and returns an open descriptor holding an exclusive ``flock`` on it: keep it open while the
    file is in use, so that ``remove_stale_pool_files`` never takes it for a dead daemon's."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (in this pid namespace; one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_pool_files(directory: str = SHM_DIR) -> tuple[int, int]:
    """Removes the pool files a dead daemon left in ``directory``: regular files named
    ``pagedserve-kv-<pid>-*``, owned by this user, whose ``pid`` is not alive and which no
    process holds a ``flock`` on (a live daemon in another pid namespace sharing this
    ``/dev/shm`` does). Returns ``(files, bytes of memory freed)``."""
    if not os.path.isdir(directory):
        return 0, 0
    files = freed = 0
    uid = os.getuid()
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _POOL_FILE.fullmatch(entry.name)
            if not match or pid_alive(int(match[1])):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                    continue
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:  # gone meanwhile, or not ours to open
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino != st.st_ino:
                    continue  # replaced between stat and open
                os.unlink(entry.path)
            except OSError:  # BlockingIOError: locked, in use
                continue
            finally:
                os.close(fd)
            files += 1
            freed += st.st_blocks * 512
    return files, freed
