"""Cache writes: ``store_kv`` (scatter new K/V into slots) and ``copy_blocks`` (copy-on-write)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._checks import check_cache_pair, next_pow2

__all__ = ["copy_blocks", "store_kv"]


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    N_ELEM: tl.constexpr,
    CHUNK: tl.constexpr,
):
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

    key, value: [T, kv_heads, head_dim] (last dim contiguous, any token/head strides);
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] views (inner dims contiguous);
    slot_mapping: [T] int64, slot = block * block_size + offset, -1 = padding (skipped).
    Slots must be distinct (two tokens writing one slot is a race).
    """
    block_size, kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    assert key.dim() == 3 and key.shape[1:] == (kv_heads, head_dim), (
        f"key {tuple(key.shape)} does not match cache (*, {kv_heads}, {head_dim})"
    )
    assert value.shape == key.shape, "key and value shapes differ"
    assert key.stride(2) == 1 and value.stride(2) == 1, "key/value last dim must be contiguous"
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] == key.shape[0], (
        f"slot_mapping must be [{key.shape[0]}], got {tuple(slot_mapping.shape)}"
    )
    assert slot_mapping.dtype == torch.int64, "slot_mapping must be int64"
    for t in (value, k_cache, slot_mapping):
        assert t.device == key.device, "all tensors must be on one device"
    n_tokens = key.shape[0]
    if n_tokens == 0:
        return
    n_elem = kv_heads * head_dim
    chunk = min(next_pow2(n_elem), 2048)
    grid = (n_tokens, triton.cdiv(n_elem, chunk))
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


@triton.jit
def _copy_blocks_kernel(
    pool_ptr,
    src_ptr,
    dst_ptr,
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program per (pair, chunk of CHUNK elements of a block)."""
    i = tl.program_id(0)
    src = tl.load(src_ptr + i).to(tl.int64)
    dst = tl.load(dst_ptr + i).to(tl.int64)
    idx = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = idx < BLOCK_NUMEL
    x = tl.load(pool_ptr + src * stride_block + idx, mask=mask)
    tl.store(pool_ptr + dst * stride_block + idx, x, mask=mask)


def copy_blocks(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool[dst[i]] = pool[src[i]] for every i: whole blocks, every layer, K and V (in place).

    pool: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim], each block contiguous;
    src, dst: [N] int64. No dst may repeat or appear in src (copy-on-write targets are fresh
    blocks); otherwise the result depends on program order.
    """
    assert pool.dim() == 6, f"pool must be 6-d, got {tuple(pool.shape)}"
    block_numel = math.prod(pool.shape[1:])
    inner = torch.empty(pool.shape[1:], device="meta").stride()
    assert pool.stride()[1:] == inner, f"each block of the pool must be contiguous: {pool.stride()}"
    assert src.dim() == 1 and src.shape == dst.shape, "src and dst must be [N]"
    assert src.dtype == torch.int64 and dst.dtype == torch.int64, "src/dst must be int64"
    assert src.device == pool.device and dst.device == pool.device, "tensors on different devices"
    n = src.shape[0]
    if n == 0:
        return
    chunk = min(next_pow2(block_numel), 8192)
    grid = (n, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        pool,
        src,
        dst,
        pool.stride(0),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=4,
    )
