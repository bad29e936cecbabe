"""Cache writes: ``store_kv`` (scatter new K/V into slots) and ``copy_blocks`` (copy-on-write), and
``copy_blocks_between`` (blocks from one GPU's pool into another's)."""

from __future__ import annotations

import math

import torch
import triton.language as tl

from kernels._checks import (
    CACHE_DTYPES,
    cdiv,
    check_cache_pair,
    check_dense,
    check_index,
    check_tensor,
    next_pow2,
)
from kernels._tl_utils import jit

__all__ = ["copy_blocks", "copy_blocks_between", "store_kv"]


@jit(varying=("stride_kt", "stride_vt"))
def _store_kv_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_cb: tl.tensor,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    N_ELEM: tl.constexpr,
    CHUNK: tl.constexpr,
) -> None:
    """One program per (token, chunk of kv_heads*head_dim elements)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    idx = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)  # flat index into [kv_heads, head_dim]
    mask = idx < N_ELEM
    h = idx // HEAD_DIM
    d = idx % HEAD_DIM
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + off * N_ELEM + idx
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[t]/value[t] into slot slot_mapping[t] of k_cache/v_cache (in place).

    key, value: [T, kv_heads, head_dim] fp16/bf16/fp32 (converted to the cache dtype), last dim
    contiguous, any token/head strides; k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim] fp16/bf16/fp32 views, inner dims contiguous (see ``check_cache_pair``);
    slot_mapping: [T] int64, contiguous; slot = block * block_size + offset, -1 = padding
    (skipped). Every tensor on one device. Not checked (values, no device sync): slots must be
    below num_blocks * block_size and distinct (two tokens writing one slot is a race).
    """
    block_size, kv_heads, head_dim = check_cache_pair(k_cache, v_cache, CACHE_DTYPES)
    device = k_cache.device
    dims = "[T, kv_heads, head_dim]"
    check_tensor("key", key, dims, (None, kv_heads, head_dim), CACHE_DTYPES, device, "k_cache")
    check_dense("key", key, 2, "contiguous along head_dim")
    n_tokens = key.shape[0]
    shape = (n_tokens, kv_heads, head_dim)
    check_tensor("value", value, dims, shape, (key.dtype,), device, "k_cache", "key")
    check_dense("value", value, 2, "contiguous along head_dim")
    check_index("slot_mapping", slot_mapping, "[T]", n_tokens, torch.int64, device, "k_cache")
    if n_tokens == 0:
        return
    n_elem = kv_heads * head_dim
    chunk = min(next_pow2(n_elem), 2048)
    grid = (n_tokens, cdiv(n_elem, chunk))
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        N_ELEM=n_elem,
        CHUNK=chunk,
        num_warps=4,
    )


@jit
def _copy_blocks_kernel(
    src_pool_ptr: tl.tensor,
    dst_pool_ptr: tl.tensor,
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    src_stride_block: tl.tensor,
    dst_stride_block: tl.tensor,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
) -> None:
    """One program per (pair, chunk of CHUNK elements of a block); the pools may be one."""
    i = tl.program_id(0)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    idx = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = idx < BLOCK_NUMEL
    x = tl.load(src_pool_ptr + src * src_stride_block + idx, mask=mask)
    tl.store(dst_pool_ptr + dst * dst_stride_block + idx, x, mask=mask)


POOL_DIMS = "[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]"


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] for every i: whole blocks, every layer, K and V (in place).

    pool: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] fp16/bf16/fp32, each block
    contiguous (any block stride); src, dst: [N] int64, contiguous, on the pool's device. Not
    checked (values, no device sync): ids below num_blocks, no dst repeated or in src
    (copy-on-write targets are fresh blocks); otherwise the result depends on program order.
    """
    check_tensor("pool", pool, POOL_DIMS, (None,) * 6, CACHE_DTYPES)
    check_dense("pool", pool, 1, "contiguous within a block")
    device = pool.device
    check_index("src", src, "[N]", None, torch.int64, device, "pool")
    check_index("dst", dst, "[N] (src's length)", src.shape[0], torch.int64, device, "pool")
    _launch_copies(pool, pool, src, dst, chunk=8192, num_warps=4)


def copy_blocks_between(
    src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """dst_pool[dst[i]] = src_pool[src[i]] for every i, the pools on two devices of one process
    (a GPU to another over NVLink, each reading or writing the other's memory directly): whole
    blocks, one kernel, no staging.

    src_pool, dst_pool: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] of one dtype
    and block shape (any number of blocks), each block contiguous; src, dst: [N] int64,
    contiguous, both on the device that runs the copy: ``src_pool``'s (it writes the peer's
    memory) or ``dst_pool``'s (it reads it). The kernel runs on that device's current stream;
    the caller orders it after the writes of the source blocks and before any read of the
    destination's, on both devices. The devices must have peer access to each other (enabled by
    the caller, e.g. by a first peer ``copy_``). Not checked (values): ids in range, no dst
    repeated.
    """
    src_pool = check_tensor("src_pool", src_pool, POOL_DIMS, (None,) * 6, CACHE_DTYPES)
    check_dense("src_pool", src_pool, 1, "contiguous within a block")
    block_shape = (None, *src_pool.shape[1:])
    dtypes = (src_pool.dtype,)
    dst_pool = check_tensor(
        "dst_pool", dst_pool, POOL_DIMS, block_shape, dtypes, None, "", "src_pool"
    )
    check_dense("dst_pool", dst_pool, 1, "contiguous within a block")
    device = src.device if isinstance(src, torch.Tensor) else src_pool.device
    if device not in (src_pool.device, dst_pool.device):
        raise ValueError(
            f"src must be on src_pool's device {src_pool.device} or dst_pool's {dst_pool.device}"
            f", got {device}"
        )
    check_index("src", src, "[N]", None, torch.int64, device, "the copying pool")
    check_index("dst", dst, "[N] (src's length)", src.shape[0], torch.int64, device, "src")
    _launch_copies(src_pool, dst_pool, src, dst, chunk=16384, num_warps=8)


def _launch_copies(
    src_pool: torch.Tensor,
    dst_pool: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    chunk: int,
    num_warps: int,
) -> None:
    block_numel = math.prod(src_pool.shape[1:])
    n = src.shape[0]
    if n == 0:
        return
    chunk = min(next_pow2(block_numel), chunk)
    grid = (n, cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        src_pool,
        dst_pool,
        src,
        dst,
        src_pool.stride(0),
        dst_pool.stride(0),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=num_warps,
    )
