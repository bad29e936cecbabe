"""store_kv, copy_blocks and copy_blocks_between: exact against their references (CPU
interpreter and GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import copy_blocks, copy_blocks_between, store_kv
from kernels.reference import (
    copy_blocks_between_reference,
    copy_blocks_reference,
    store_kv_reference,
)
from tests.kernels.kernel_cases import randn

F16, BF16 = torch.float16, torch.bfloat16


def random_pool(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> torch.Tensor:
    """pool: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim] of randn."""
    return randn((num_blocks, num_layers, 2, block_size, kv_heads, head_dim), dtype, device, seed)


def check_store(
    num_blocks: int,
    num_layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    strided: bool,
) -> None:
    pool = random_pool(num_blocks, num_layers, block_size, kv_heads, head_dim, dtype, device)
    layer = num_layers - 1
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    gen = torch.Generator().manual_seed(7)
    last = num_blocks * block_size - 1  # the very last slot of the pool is always written
    slots = torch.cat([torch.randperm(last, generator=gen)[: tokens - 1], torch.tensor([last])])
    slots[:-1][torch.rand(tokens - 1, generator=gen) < 0.2] = -1  # padding tokens
    slots = slots.to(device)
    if strided:  # key/value as slices of a fused qkv projection: [T, 3 * kv_heads, D]
        qkv = randn((tokens, 3 * kv_heads, head_dim), dtype, device, 8)
        key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    else:
        key = randn((tokens, kv_heads, head_dim), dtype, device, 8)
        value = randn((tokens, kv_heads, head_dim), dtype, device, 9)
    pool_before = pool.clone()
    k_ref, v_ref = store_kv_reference(key, value, k_cache, v_cache, slots)
    assert torch.equal(pool, pool_before), "the reference mutated its input"
    store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    other = [i for i in range(num_layers) if i != layer]
    assert torch.equal(pool[:, other], pool_before[:, other]), "store_kv wrote another layer"


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(
    ("block_size", "kv_heads", "head_dim", "dtype"),
    [(16, 2, 64, F16), (8, 1, 80, BF16), (32, 3, 96, torch.float32)],
)
def test_store_kv_small(
    device: torch.device,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    strided: bool,
) -> None:
    check_store(12, 3, block_size, kv_heads, head_dim, 40, dtype, device, strided)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_copy_blocks_small(device: torch.device, dtype: torch.dtype) -> None:
    pool = random_pool(10, 3, 16, 2, 64, dtype, device)
    src = torch.tensor([1, 4, 4, 9], dtype=torch.int64, device=device)
    dst = torch.tensor([0, 2, 7, 3], dtype=torch.int64, device=device)
    before = pool.clone()
    ref = copy_blocks_reference(pool, src, dst)
    assert torch.equal(pool, before), "the reference mutated its input"
    copy_blocks(pool, src, dst)
    assert torch.equal(pool, ref)
    assert torch.equal(pool[dst], before[src])


def check_between(src_device: torch.device, dst_device: torch.device, on_src: bool) -> None:
    """Blocks of one pool into another of other size (on another device where there is one),
    run by the source's device (``on_src``: it writes the peer) or the destination's."""
    src_pool = random_pool(9, 3, 16, 2, 64, BF16, src_device, seed=1)
    dst_pool = random_pool(12, 3, 16, 2, 64, BF16, dst_device, seed=2)
    runner = src_device if on_src else dst_device
    src = torch.tensor([8, 0, 3, 3], dtype=torch.int64, device=runner)
    dst = torch.tensor([0, 11, 5, 6], dtype=torch.int64, device=runner)
    src_before, dst_before = src_pool.clone(), dst_pool.clone()
    ref = copy_blocks_between_reference(src_pool, dst_pool, src, dst)
    assert torch.equal(dst_pool, dst_before), "the reference mutated its input"
    with torch.cuda.device(runner) if runner.type == "cuda" else contextlib.nullcontext():
        copy_blocks_between(src_pool, dst_pool, src, dst)
    if runner.type == "cuda":
        torch.cuda.synchronize(runner)
    assert torch.equal(dst_pool, ref)
    assert torch.equal(dst_pool[[0, 11, 5, 6]].cpu(), src_before[[8, 0, 3, 3]].cpu())
    assert torch.equal(src_pool, src_before), "the source was written"


@pytest.mark.parametrize("on_src", [True, False])
def test_copy_blocks_between_small(device: torch.device, on_src: bool) -> None:
    check_between(device, device, on_src)


def test_copy_blocks_between_rejects_bad_inputs(device: torch.device) -> None:
    a = random_pool(4, 2, 16, 2, 64, F16, device)
    ids = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"^dst_pool must be"):  # another block shape
        copy_blocks_between(a, random_pool(4, 2, 16, 1, 64, F16, device), ids, ids)
    with pytest.raises(TypeError, match=r"^dst_pool must be"):  # another dtype
        copy_blocks_between(a, random_pool(4, 2, 16, 2, 64, BF16, device), ids, ids)
    with pytest.raises(ValueError, match=r"^dst "):  # lengths differ
        copy_blocks_between(a, a.clone(), ids, torch.zeros(2, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"^src must be on"):  # ids on a third device
        copy_blocks_between(a, a.clone(), ids.to("meta"), ids.to("meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("on_src", [True, False])
def test_copy_blocks_between_two_gpus(on_src: bool) -> None:
    """Across two GPUs with peer access: each pushes to or pulls from the other."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    first, second = torch.device("cuda:0"), torch.device("cuda:1")
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("the GPUs have no peer access")
    torch.ones(1, device=first).copy_(torch.ones(1, device=second))  # enables peer access
    torch.ones(1, device=second).copy_(torch.ones(1, device=first))
    check_between(first, second, on_src)
    check_between(second, first, on_src)


def test_cache_ops_reject_bad_inputs(device: torch.device) -> None:
    pool = random_pool(4, 2, 16, 2, 64, F16, device)
    k, v = pool[:, 0, 0], pool[:, 0, 1]
    key = randn((3, 2, 64), F16, device, 0)
    with pytest.raises(TypeError, match=r"^slot_mapping "):  # int32 slots
        store_kv(key, key, k, v, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"^key "):  # wrong head count
        store_kv(key[:, :1], key[:, :1], k, v, torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"^pool must be contiguous"):  # non-contiguous block
        copy_blocks(
            pool.transpose(1, 3),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.ones(1, dtype=torch.int64, device=device),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize(("block_size", "kv_heads"), [(16, 8), (32, 1), (16, 32)])
def test_store_kv_grid(
    cuda: torch.device, block_size: int, kv_heads: int, head_dim: int, strided: bool
) -> None:
    dtype = BF16 if head_dim % 32 else F16
    check_store(700, 2, block_size, kv_heads, head_dim, 3000, dtype, cuda, strided)


@pytest.mark.gpu
def test_cache_ops_pool_32768_blocks(cuda: torch.device) -> None:
    """Block stride 4*2*16*8*128 = 131072 elements: offsets pass 2**31."""
    pool = torch.empty((32768, 4, 2, 16, 8, 128), dtype=BF16, device=cuda)
    pool.view(torch.int16).random_()
    high = torch.arange(32768 - 64, 32768, device=cuda)
    src, dst = high[:32].clone(), high[32:].flip(0).clone()
    expect = pool[src].clone()
    others = pool[32768 - 200 : 32768 - 64].clone()
    copy_blocks(pool, src, dst)
    bits = pool.view(torch.int16)  # random bits include NaN patterns: compare bit-exactly
    assert torch.equal(bits[dst], expect.view(torch.int16))
    assert torch.equal(bits[32768 - 200 : 32768 - 64], others.view(torch.int16))
    k, v = pool[:, 3, 0], pool[:, 3, 1]
    key = randn((50, 8, 128), BF16, cuda, 1)
    val = randn((50, 8, 128), BF16, cuda, 2)
    slots = (32767 * 16 - torch.arange(0, 500, 10, device=cuda)).long()
    store_kv(key, val, k, v, slots)
    assert torch.equal(k[slots // 16, slots % 16], key)
    assert torch.equal(v[slots // 16, slots % 16], val)
