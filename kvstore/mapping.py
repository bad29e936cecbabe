"""How a worker maps the kvstore's pool: the one kvstore module with torch that other processes
import (with ``kvstore.protocol`` and ``kvstore.client``, the kvstore's client side).

The pool is ``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` (block-major:
``kvstore.device`` says why), described by the ``PoolInfo`` of the ``Registered`` reply: a
``/dev/shm`` file on CPU, a CUDA IPC handle (raw handle bytes, offsets, the GPU's UUID) on CUDA.
"""

from __future__ import annotations

import torch

from contracts.model_config import KVGeometry
from kvstore.protocol import PoolInfo


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def pool_shape(geometry: KVGeometry, block_size: int, num_blocks: int) -> list[int]:
    g = geometry
    return [num_blocks, g.num_layers, 2, block_size, g.num_kv_heads, g.head_dim]


def map_shm(path: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``path`` in ``/dev/shm``: every process mapping it sees the same bytes."""
    numel = 1
    for dim in shape:
        numel *= dim
    return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def map_pool(info: PoolInfo) -> torch.Tensor:
    """The pool tensor in a worker process: ``/dev/shm`` mapping or CUDA IPC rebuild."""
    dtype = torch_dtype(info.dtype)
    if info.kind == "shm":
        return map_shm(info.shm_path, info.shape, dtype)
    assert info.cuda is not None, "cuda_ipc pool without a handle"
    h = info.cuda
    index = _device_index_of(h.device_uuid)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle or None,
        h.event_sync_required,
    )
    pool = torch.empty((0,), dtype=dtype, device=f"cuda:{index}")
    return pool.set_(storage, 0, info.shape, torch.empty(info.shape, device="meta").stride())


def _device_index_of(device_uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == device_uuid:
            return i
    raise RuntimeError(f"GPU {device_uuid} of the KV pool is not visible to this process")
