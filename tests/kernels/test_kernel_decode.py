"""paged_decode against the fp32 reference: CPU (interpreter) cases and the H200 grid."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_decode
from kernels.decode import choose_num_splits, compile_variants
from kernels.reference import paged_decode_reference
from tests.kernels.kernel_cases import (
    EDGE_HEAD_DIMS,
    GRID_HEAD_DIMS,
    GRID_HEADS,
    TOL,
    PagedCase,
    fp32_caches,
    grid_dtype,
    make_case,
    randn,
    rel_err,
)

F16, BF16 = torch.float16, torch.bfloat16


def check_decode(case: PagedCase, q_heads: int, num_splits: int | None, seed: int = 1) -> None:
    """Kernel vs fp32 reference; NaN in unowned slots must not change the result (bitwise)."""
    batch = case.block_tables.shape[0]
    kv_heads, head_dim = case.pool.shape[4], case.pool.shape[5]
    dtype = case.pool.dtype
    q = randn((batch, q_heads, head_dim), dtype, case.pool.device, seed)
    scale = head_dim**-0.5
    args = (case.block_tables, case.context_lens, scale)
    out = paged_decode(q, case.k_cache, case.v_cache, *args, num_splits=num_splits)
    k32, v32 = fp32_caches(case)
    ref = paged_decode_reference(q.float(), k32, v32, *args)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out.isnan().any(), "NaN leaked from an unowned slot"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"rel err {err:.2e} (kv_heads={kv_heads}, splits={num_splits})"
    clean = case.repoison(0.0)
    out2 = paged_decode(q, clean.k_cache, clean.v_cache, *args, num_splits=num_splits)
    assert torch.equal(out, out2), "result depends on slots the requests do not own"


# ---------------------------------------------------------------- CPU (TRITON_INTERPRET=1)

CPU_SHAPES = [  # (q_heads, kv_heads, head_dim, block_size, dtype)
    (4, 2, 64, 16, F16),
    (5, 1, 80, 8, BF16),
    (2, 2, 96, 32, F16),
    (4, 1, 64, 64, BF16),
    (4, 2, 9, 16, F16),  # the smallest supported head dim (padded to 16)
    (2, 1, 40, 8, BF16),  # padded to 64
]


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "block_size", "dtype"), CPU_SHAPES)
def test_decode_small(
    device: torch.device,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None,
) -> None:
    case = make_case([1, 17, 150], kv_heads, head_dim, block_size, dtype, device)
    check_decode(case, q_heads, num_splits)


def test_decode_zero_context_gives_zeros(device: torch.device) -> None:
    case = make_case([0, 9], 2, 64, 16, F16, device)
    q = randn((2, 4, 64), F16, device, 3)
    for splits in (1, 2):
        out = paged_decode(
            q,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.context_lens,
            0.125,
            num_splits=splits,
        )
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        ref = paged_decode_reference(
            q.float(), *fp32_caches(case), case.block_tables, case.context_lens, 0.125
        )
        assert rel_err(out, ref) < TOL[F16]


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_decode_splits_each_context_in_a_table_wider_than_it(
    device: torch.device, num_splits: int
) -> None:
    """A CUDA graph's tables are as wide as the model's context; each request still cuts its
    own context into splits of at least two 64-token tiles: context 0 uses none, 1 and 17 one,
    150 two, 300 up to three (128 + 128 + 44), 1000 up to eight."""
    case = make_case([0, 1, 17, 150, 300, 1000], 2, 64, 16, F16, device, extra_table_cols=200)
    assert case.block_tables.shape[1] * 16 > 4 * 1000  # the table, not a context, is widest
    check_decode(case, 4, num_splits)


def test_split_heuristic() -> None:
    assert choose_num_splits(64, 8, 4096, 132, 64) == 1  # 512 programs already fill the GPU
    assert choose_num_splits(1, 8, 32768, 132, 64) > 8  # one long request must be split
    assert choose_num_splits(1, 8, 64, 132, 64) == 1  # nothing to split


def test_decode_rejects_bad_inputs(device: torch.device) -> None:
    case = make_case([5], 2, 64, 16, F16, device)
    q = randn((1, 4, 64), F16, device, 0)
    bt, cl = case.block_tables, case.context_lens
    with pytest.raises(TypeError, match=r"^k_cache "):  # cache dtype != query dtype
        paged_decode(q.to(BF16), case.k_cache, case.v_cache, bt, cl, 1.0)
    with pytest.raises(TypeError, match=r"^block_tables "):
        paged_decode(q, case.k_cache, case.v_cache, bt.long(), cl, 1.0)
    with pytest.raises(ValueError, match=r"^k_cache "):  # inner dims not contiguous
        k_bad = case.k_cache.transpose(1, 2)
        paged_decode(q, k_bad, k_bad, bt, cl, 1.0)
    with pytest.raises(ValueError, match=r"^query heads "):  # 3 query heads over 2 kv heads
        paged_decode(randn((1, 3, 64), F16, device, 0), case.k_cache, case.v_cache, bt, cl, 1.0)


# ---------------------------------------------------------------- GPU grid

CONTEXTS = [1, 17, 463, 1025, 2011, 16384]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("q_heads", "kv_heads"), GRID_HEADS)
@pytest.mark.parametrize("head_dim", GRID_HEAD_DIMS)
def test_decode_grid(
    cuda: torch.device, head_dim: int, q_heads: int, kv_heads: int, block_size: int
) -> None:
    dtype = grid_dtype(head_dim, q_heads, block_size)
    case = make_case(CONTEXTS, kv_heads, head_dim, block_size, dtype, cuda, seed=head_dim)
    for splits in (1, 7, None):
        check_decode(case, q_heads, splits, seed=splits or 0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", EDGE_HEAD_DIMS)
def test_decode_head_dim_edges(cuda: torch.device, head_dim: int) -> None:
    """The ends of the supported head dims and odd paddings, GQA 32/8, both dtypes."""
    for dtype in (F16, BF16):
        case = make_case(CONTEXTS, 8, head_dim, 16, dtype, cuda, seed=head_dim)
        for splits in (1, 7, None):
            check_decode(case, 32, splits, seed=splits or 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_decode_big_batch_both_dtypes(cuda: torch.device, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 3000, (64,), generator=gen).tolist()
    case = make_case(lens, 8, 128, 16, dtype, cuda)
    for splits in (1, None, 16):
        check_decode(case, 32, splits)


@pytest.mark.gpu
def test_decode_pool_32768_blocks(cuda: torch.device) -> None:
    """Offsets past 2**31 elements: block stride 4*2*16*8*128 = 131072 elements."""
    case = make_case(
        [1, 463, 2011], 8, 128, 16, BF16, cuda, num_blocks=32768, num_layers=4, high_blocks=True
    )
    assert case.block_tables.max().item() * case.k_cache.stride(0) > 2**31
    for splits in (1, 4):
        check_decode(case, 32, splits)


def test_compile_variants_launches_every_split_count_and_writes_no_cache(
    device: torch.device,
) -> None:
    case = make_case([5], 2, 64, 16, torch.float16, device)
    before = case.pool.clone()
    assert compile_variants(case.k_cache, case.v_cache, 4) == 8  # 1, 2, 4, ..., 128 splits
    assert torch.equal(case.pool.isnan(), before.isnan())
    assert torch.equal(case.pool.nan_to_num(), before.nan_to_num())
