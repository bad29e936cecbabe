"""Launcher-side contract checks shared by every kernel family (torch only)."""

from __future__ import annotations

import torch

ATTN_DTYPES = (torch.float16, torch.bfloat16)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Assert the per-layer cache views are usable; return (block_size, kv_heads, head_dim).

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], inner three dims contiguous,
    any block stride (the pool is block-major, so the block stride spans every layer), same strides.
    """
    assert k_cache.dim() == 4, f"k_cache must be 4-d, got {tuple(k_cache.shape)}"
    assert k_cache.shape == v_cache.shape, "k_cache and v_cache shapes differ"
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ"
    assert k_cache.device == v_cache.device, "k_cache and v_cache devices differ"
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ"
    _, block_size, kv_heads, head_dim = k_cache.shape
    inner = (kv_heads * head_dim, head_dim, 1)
    assert k_cache.stride()[1:] == inner, (
        f"cache inner dims must be contiguous: strides {k_cache.stride()}, want (*, {inner})"
    )
    assert block_size & (block_size - 1) == 0 and 8 <= block_size <= 64, (
        f"block_size must be a power of two in [8, 64], got {block_size}"
    )
    return block_size, kv_heads, head_dim


def check_attention_args(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int, int, int]:
    """Checks common to decode and prefill; return (block_size, q_heads, kv_heads, head_dim)."""
    block_size, kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    assert query.dim() == 3, f"query must be [tokens, q_heads, head_dim], got {tuple(query.shape)}"
    q_heads = query.shape[1]
    assert query.shape[2] == head_dim, f"query head_dim {query.shape[2]} != cache {head_dim}"
    assert q_heads % kv_heads == 0, f"q_heads {q_heads} not a multiple of kv_heads {kv_heads}"
    assert query.dtype in ATTN_DTYPES, f"query dtype must be fp16/bf16, got {query.dtype}"
    assert k_cache.dtype == query.dtype, f"cache dtype {k_cache.dtype} != query {query.dtype}"
    assert query.stride(2) == 1, "query's last dim must be contiguous"
    assert 16 <= head_dim <= 256, f"head_dim must be in [16, 256], got {head_dim}"
    assert block_tables.dim() == 2 and block_tables.dtype == torch.int32, (
        "block_tables must be a 2-d int32 tensor"
    )
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    for t in (k_cache, block_tables):
        assert t.device == query.device, "all tensors must be on one device"
    return block_size, q_heads, kv_heads, head_dim
