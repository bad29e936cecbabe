"""``pagedserve kvstore``: the KV-cache daemon process.

One thread: a ZeroMQ ROUTER socket polled with a short timeout; each frame is decoded, handled
by ``KVService`` and answered (errors included: a malformed frame, a wrong protocol version or a
handler failure get an ``Error`` reply and the loop goes on). Between frames it expires leases.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvstore import protocol as p
from kvstore.manager import KVCacheManager
from kvstore.service import KVService

if TYPE_CHECKING:
    from kvstore.device import DevicePools

log = logging.getLogger("pagedserve.kvstore")
DEFAULT_ENDPOINT = "ipc:///tmp/pagedserve-kvstore.sock"


@dataclass(frozen=True)
class KVStoreConfig:
    model: str = field(
        default="tiny",
        metadata={
            "help": "local Hugging Face checkpoint directory whose config gives the KV geometry, "
            "or 'tiny' (the random-weight test model)"
        },
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "KV dtype; 'auto' takes the model config's",
            "choices": ["auto", "float32", "float16", "bfloat16"],
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "where the pool lives: 'cuda', 'cuda:N', 'cpu' (a /dev/shm file) or 'auto'"
        },
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (a power of two)"})
    kv_memory: str = field(
        default="auto",
        metadata={
            "help": "GPU pool size: GiB ('8', '8GiB') or a fraction of free memory ('0.5'); 'auto' "
            "is 0.5 of free GPU memory on CUDA and 1 GiB on CPU"
        },
    )
    swap_memory: str = field(
        default="4GiB",
        metadata={
            "help": "CPU swap tier size (pinned host memory on CUDA hosts); '0' disables swapping"
        },
    )
    endpoint: str = field(
        default=DEFAULT_ENDPOINT,
        metadata={"help": "ZeroMQ endpoint to bind: ipc:///path or tcp://host:port"},
    )
    admission_watermark: float = field(
        default=0.01,
        metadata={
            "help": "fraction of GPU blocks that admissions leave free for running requests "
            "to grow into"
        },
    )
    lease_timeout_s: float = field(
        default=10.0,
        metadata={"help": "a worker silent this long is dead; its requests become orphans"},
    )
    orphan_grace_s: float = field(
        default=60.0,
        metadata={
            "help": "orphaned requests keep their blocks this long for another worker to adopt"
        },
    )
    busy_poll: bool = field(
        default=False,
        metadata={
            "help": "spin on the socket instead of sleeping between messages: lower "
            "latency per call (no wake-up), one CPU core kept busy"
        },
    )
    calibrate: bool = field(
        default=True,
        metadata={"help": "measure swap bandwidth at startup (the swap side of the cost model)"},
    )
    log_level: str = field(default="INFO", metadata={"help": "logging level"})


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def disable_expandable_segments() -> None:
    """CUDA IPC cannot export memory from expandable segments: force them off before CUDA starts."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments:True" in conf:
        log.warning("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; turning it off for IPC")
    parts = [x for x in conf.split(",") if x and not x.startswith("expandable_segments")]
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join([*parts, "expandable_segments:False"])


def build_service(config: KVStoreConfig) -> tuple[KVService, DevicePools]:
    """Allocates the pools (the slow part: progress is logged) and wires the service. Raises
    ValueError on a flag that makes no sense (memory sizes, dtype)."""
    disable_expandable_segments()
    from kvstore.device import DevicePools, blocks_for_memory, blocks_in_gib
    from pagedserve.model_config import kv_geometry, load_config, resolve_dtype

    device = resolve_device(config.device)
    model_config = load_config(config.model)
    geometry = kv_geometry(model_config, resolve_dtype(model_config, config.dtype, device))
    block_bytes = geometry.block_bytes(config.block_size)
    kv_memory = config.kv_memory
    if kv_memory == "auto":
        kv_memory = "0.5" if device.startswith("cuda") else "1GiB"
    num_blocks = blocks_for_memory(kv_memory, block_bytes, device)
    num_cpu_blocks = blocks_in_gib(config.swap_memory, block_bytes)
    log.info(
        "model %s: %s, block %d tokens = %d bytes",
        config.model,
        geometry,
        config.block_size,
        block_bytes,
    )
    pools = DevicePools(geometry, config.block_size, num_blocks, num_cpu_blocks, device)
    manager = KVCacheManager(
        num_blocks, num_cpu_blocks, config.block_size, config.admission_watermark
    )
    if config.calibrate and num_cpu_blocks:
        manager.calibration = pools.calibrate()
        if manager.calibration is not None:
            out_bw, in_bw = manager.calibration.bandwidth_gbps()
            log.info("swap calibration: out %.2f GB/s, in %.2f GB/s", out_bw, in_bw)
    service = KVService(manager, pools, config.lease_timeout_s, config.orphan_grace_s)
    return service, pools


class Daemon:
    def __init__(self, service: KVService, endpoint: str, busy_poll: bool = False) -> None:
        self.service = service
        self.endpoint = endpoint
        self.poll_ms = 0 if busy_poll else 100
        self.stopping = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    def reply_to(self, frames: list[bytes]) -> bytes:
        """The encoded reply to one received message (never raises)."""
        call_id = 0
        try:
            if len(frames) != 1:
                raise ValueError(f"expected one payload frame, got {len(frames)}")
            try:
                call = p.decode_call(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError):
                # Only now look at the header: another version, or garbage?
                version, peeked_id = p.peek_header(frames[0])
                call_id = peeked_id or 0
                if version is None or version == p.PROTOCOL_VERSION:
                    raise
                return self._error(
                    call_id, "version", f"protocol version {version} is not {p.PROTOCOL_VERSION}"
                )
            call_id = call.call_id
            if call.version != p.PROTOCOL_VERSION:
                return self._error(
                    call_id,
                    "version",
                    f"protocol version {call.version} is not {p.PROTOCOL_VERSION}",
                )
            body = self.service.handle(call.body)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            body = p.Error("bad_message", f"cannot decode the message: {err}")
        except Exception as err:  # the daemon keeps serving whatever a handler does
            log.exception("handler failed")
            body = p.Error("internal", f"{type(err).__name__}: {err}")
        return p.encode(p.Reply(p.PROTOCOL_VERSION, call_id, body))

    @staticmethod
    def _error(call_id: int, code: str, message: str) -> bytes:
        return p.encode(p.Reply(p.PROTOCOL_VERSION, call_id, p.Error(code, message)))

    def serve_forever(self) -> None:
        log.info("kvstore serving on %s", self.endpoint)
        last_tick = time.monotonic()
        while not self.stopping:
            if self.sock.poll(self.poll_ms):
                identity, *frames = self.sock.recv_multipart()
                self.sock.send_multipart([identity, self.reply_to(frames)])
            if time.monotonic() - last_tick >= 0.5:
                self.service.tick()
                last_tick = time.monotonic()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
        if self.endpoint.startswith("ipc://"):
            path = self.endpoint.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)


def run(config: KVStoreConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        service, pools = build_service(config)
    except ValueError as err:
        raise SystemExit(f"pagedserve kvstore: {err}") from None
    daemon = Daemon(service, config.endpoint, config.busy_poll)

    def stop(signum: int, _frame: object) -> None:
        if not daemon.stopping:  # Ctrl-C reaches us from the terminal and from `pagedserve up`
            log.info("signal %d: shutting down", signum)
        daemon.stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        daemon.serve_forever()
    finally:
        daemon.close()
        pools.close()
        log.info("kvstore stopped")
