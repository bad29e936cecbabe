"""``pagedserve kvstore``'s flags: ``KVStoreConfig``, one frozen dataclass (its argparse is
generated from it: ``pagedserve.config``)."""

from __future__ import annotations

from dataclasses import dataclass

from contracts import options
from contracts.endpoints import DEFAULT_ENDPOINT, TOKEN_ENV
from contracts.options import flag
from kvstore import protocol as p


@dataclass(frozen=True)
class KVStoreConfig:
    model: str = options.model(": its config gives the KV geometry")
    dtype: str = options.dtype("KV dtype; 'auto' takes the model config's")
    device: str = options.device(
        "where the pool lives: 'cuda', 'cuda:N', 'cpu' (a /dev/shm file of mode 0600, for workers "
        "of this user; files dead kvstores left there are removed at startup) or 'auto'"
    )
    block_size: int = flag(16, "tokens per KV block (a power of two)")
    kv_memory: str = flag(
        "auto",
        "GPU pool size: GiB ('8', '8GiB') or a fraction of free memory ('0.5'); 'auto' "
        "is 0.5 of free GPU memory on CUDA and 1 GiB on CPU",
    )
    swap_memory: str = flag(
        "4GiB",
        "CPU swap tier size (pinned host memory on CUDA hosts); '0' disables swapping",
    )
    endpoint: str = flag(
        DEFAULT_ENDPOINT,
        "ZeroMQ endpoint to bind: ipc:///path or tcp://host:port. The default is "
        "a socket in $XDG_RUNTIME_DIR/pagedserve (else <tmp>/pagedserve-<uid>), a directory "
        "of mode 0700; an ipc socket is made 0600, a stale one (no daemon answers on it) is "
        f"replaced. tcp:// needs ${TOKEN_ENV} set: with it, every call must carry that "
        "shared secret (clients read the same variable)",
    )
    admission_watermark: float = flag(
        0.01,
        "fraction of GPU blocks that admissions leave free for running requests to grow into",
    )
    lease_timeout_s: float = flag(
        p.LEASE_TIMEOUT_S,
        "a worker silent this long is dead; its requests become orphans, which "
        "other workers take over (their --claim-idle-ms follows this by default)",
    )
    orphan_grace_s: float = flag(
        60.0,
        "orphaned requests keep their blocks this long for another worker to adopt",
    )
    busy_poll: bool = flag(
        False,
        "spin on the socket instead of sleeping between messages: lower "
        "latency per call (no wake-up), one CPU core kept busy",
    )
    cpu_prefix_cache: bool = flag(
        True,
        "keep cached prefix blocks evicted from the GPU in the CPU tier (the "
        "--swap-memory pool, shared with swapped requests, which always win space); a later "
        "hit loads them back or recomputes them, whichever the cost model prices lower",
    )
    write_back_ahead: int = flag(
        256,
        "with --cpu-prefix-cache, copy this many of the GPU's next eviction victims "
        "to the CPU tier between calls, ahead of their eviction (0: copy only at eviction, "
        "inside the call that evicts)",
    )
    demote_at_eviction_ms: float = flag(
        5.0,
        "with --cpu-prefix-cache, the longest a batch of copies may take to save evicted prefix "
        "blocks in the CPU tier at their eviction (copies the call waits for), by the calibrated "
        "swap-out line; victims past it are dropped (counted 'over_budget'); 0: none saved at "
        "eviction; without a calibration, no limit. Write-back between calls copies ahead of "
        "evictions without it",
    )
    calibrate: bool = flag(
        True,
        "measure swap bandwidth at startup (the swap side of the cost model)",
    )
    data_parallel_size: int = flag(
        1,
        "pools (GPUs) this daemon owns: pool i on cuda:i (of the visible devices) or, on CPU, "
        "its own /dev/shm file; --kv-memory and --swap-memory are per pool. Workers register "
        "with one pool (their --pool)",
    )
    tensor_parallel_size: int = flag(
        1,
        "ranks of each worker group (tensor parallelism): each pool is split by KV heads into "
        "that many rank pools with the same block ids, rank r of pool i on cuda:(i*N + r) (on "
        "CPU a /dev/shm file each); rank r of a group maps rank pool r. Swaps and copies move a "
        "block in every rank",
    )
    peer_copy: str = flag(
        "auto",
        "with several pools, a prefix another pool caches (on its GPU, or only in its CPU "
        "tier) is copied into the pool of the request that wants it ('auto': when the cost "
        "model prices the copy below recomputing it; 'always'; 'never')",
        choices=["auto", "always", "never"],
    )
    log_level: str = options.log_level()
