"""paged_prefill (varlen, cached context, mixed decode rows) against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from kernels import paged_decode, paged_prefill, prefill_tile_tokens, prefill_tiles
from kernels.reference import paged_decode_reference, paged_prefill_reference
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


def check_prefill(
    case: PagedCase, q_heads: int, q_lens: list[int], pad_rows: int = 3, seed: int = 1
) -> None:
    """Kernel vs fp32 reference over the valid rows; NaN in unowned slots and in padding query
    rows past cu_seqlens_q[-1] must not change the valid rows (bitwise)."""
    device, dtype = case.pool.device, case.pool.dtype
    head_dim = case.pool.shape[5]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = randn((total + pad_rows, q_heads, head_dim), dtype, device, seed)
    q[total:] = float("nan")
    cu = cu.to(device)
    scale = head_dim**-0.5
    args = (case.block_tables, cu, case.context_lens, scale)
    out = paged_prefill(q, case.k_cache, case.v_cache, *args)
    k32, v32 = fp32_caches(case)
    ref = paged_prefill_reference(q.float(), k32, v32, *args)
    assert out.shape == q.shape and out.dtype == dtype
    assert not out[:total].isnan().any(), "NaN leaked into a valid row"
    err = rel_err(out[:total], ref[:total])
    assert err < TOL[dtype], f"rel err {err:.2e} (q_lens={q_lens})"
    clean = case.repoison(0.0)
    q2 = q.clone()
    q2[total:] = 0.0
    out2 = paged_prefill(q2, clean.k_cache, clean.v_cache, *args, max_query_len=max(q_lens))
    assert torch.equal(out[:total], out2[:total]), "result depends on memory it does not own"


# ---------------------------------------------------------------- CPU (TRITON_INTERPRET=1)

CPU_SHAPES = [  # (q_heads, kv_heads, head_dim, block_size, dtype)
    (4, 2, 64, 16, F16),
    (5, 1, 80, 8, BF16),
    (2, 2, 96, 32, F16),
    (4, 2, 9, 16, F16),  # the smallest supported head dim (padded to 16)
    (2, 1, 40, 8, BF16),  # padded to 64
]


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim", "block_size", "dtype"), CPU_SHAPES)
def test_prefill_small_mixed(
    device: torch.device,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> None:
    # (q_len, context): decode row, fresh prompt, chunk over a cached prefix, tiny prompt, and a
    # chunk whose first position is 62 (the unmasked/masked key-loop boundary is off by one)
    reqs = [(1, 40), (33, 33), (29, 90), (1, 1), (3, 65)]
    case = make_case([c for _, c in reqs], kv_heads, head_dim, block_size, dtype, device)
    check_prefill(case, q_heads, [q for q, _ in reqs])


def test_prefill_single_long_chunk(device: torch.device) -> None:
    case = make_case([150], 1, 64, 16, BF16, device)
    check_prefill(case, 4, [140])


def test_prefill_rejects_bad_inputs(device: torch.device) -> None:
    case = make_case([5], 2, 64, 16, F16, device)
    q = randn((5, 4, 64), F16, device, 0)
    cu = torch.tensor([0, 5], dtype=torch.int32, device=device)
    with pytest.raises(TypeError, match=r"^cu_seqlens_q "):
        paged_prefill(
            q, case.k_cache, case.v_cache, case.block_tables, cu.long(), case.context_lens, 1.0
        )
    with pytest.raises(ValueError, match=r"^query "):  # head_dim 32 over a cache of 64
        paged_prefill(
            q[:, :, :32], case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 1.0
        )


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_decodes_and_prefills_of_one_step_write_into_one_out(
    device: torch.device, kernels: str
) -> None:
    """A mixed step as ``compute.model.attention.attend`` runs it: the two leading decodes through
    the decode launcher into out[:2], the chunks after them through the prefill launcher
    (``first=2``) into the same ``out``. Every row matches one prefill over the whole step;
    rows past the step keep what ``out`` held."""
    decode, prefill = paged_decode, paged_prefill
    if kernels == "reference":
        decode, prefill = paged_decode_reference, paged_prefill_reference
    reqs = [(1, 40), (1, 7), (33, 33), (29, 90)]
    case = make_case([c for _, c in reqs], 2, 64, 16, BF16, device)
    cu = torch.tensor([0, 1, 2, 35, 64], dtype=torch.int32, device=device)
    q = randn((66, 4, 64), BF16, device, 3)
    out = torch.full_like(q, float("nan"))
    tables, lens = case.block_tables, case.context_lens
    got = decode(q[:2], case.k_cache, case.v_cache, tables[:2], lens[:2], 0.125, out=out[:2])
    assert got.data_ptr() == out.data_ptr()
    assert out[2:].isnan().all()
    got = prefill(q, case.k_cache, case.v_cache, tables, cu, lens, 0.125, 33, out=out, first=2)
    assert got is out
    k32, v32 = fp32_caches(case)
    ref = paged_prefill_reference(q.float(), k32, v32, tables, cu, lens, 0.125)
    assert rel_err(out[:64], ref[:64]) < TOL[BF16]
    assert out[64:].isnan().all(), "a row past the step was written"
    if kernels == "triton":
        with pytest.raises(TypeError, match=r"^out must be"):
            decode(q[:2], case.k_cache, case.v_cache, tables[:2], lens[:2], 0.1, out=out[:2].half())
        with pytest.raises(ValueError, match=r"^out must be \[rows, q_heads, head_dim\]"):
            prefill(q, case.k_cache, case.v_cache, tables, cu, lens, 0.1, out=out[1:], first=2)
        with pytest.raises(ValueError, match=r"^first must be at most"):
            prefill(q, case.k_cache, case.v_cache, tables, cu, lens, 0.1, out=out, first=5)


def test_graph_forms_of_a_mixed_step_match_the_launch_forms(device: torch.device) -> None:
    """The forms a CUDA graph captures once for every step: the decodes launched over more rows
    than the step has (``count`` says how many are real), the prompt chunks as a list of
    (chunk, tile) pairs in a larger buffer (``num_tiles`` says how many are real). Each written
    row equals the launch form's bitwise; rows past the counts keep what ``out`` held."""
    reqs = [(1, 40), (1, 7), (70, 75), (5, 5), (1, 130), (29, 90)]  # a 1-token chunk after d
    case = make_case([c for _, c in reqs], 2, 64, 16, BF16, device)
    q_lens, ctx = [q for q, _ in reqs], [c for _, c in reqs]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    tables, lens = case.block_tables, case.context_lens
    q = randn((int(cu[-1]) + 4, 4, 64), BF16, device, 5)
    cu = cu.to(device)
    want = torch.full_like(q, float("nan"))
    paged_decode(q[:2], case.k_cache, case.v_cache, tables[:2], lens[:2], 0.125, out=want[:2])
    paged_prefill(q, case.k_cache, case.v_cache, tables, cu, lens, 0.125, 70, out=want, first=2)

    got = torch.full_like(q, float("nan"))
    two = torch.tensor([2], dtype=torch.int32, device=device)
    paged_decode(q[:6], case.k_cache, case.v_cache, tables, lens, 0.125, out=got[:6], count=two)
    assert got[2:].isnan().all(), "a decode row past count was written"
    pairs = prefill_tiles(q_lens, ctx, 2, prefill_tile_tokens(64, 2))
    assert sorted(pairs) == [(2, 0), (2, 1), (3, 0), (4, 0), (5, 0)]  # 64-token tiles
    tiles = torch.zeros(len(pairs) + 5, 2, dtype=torch.int32)
    tiles[: len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
    tiles[len(pairs) :] = torch.tensor([0, 0], dtype=torch.int32)  # never read: past num_tiles
    tiles, n = tiles.to(device), torch.tensor([len(pairs)], dtype=torch.int32, device=device)
    paged_prefill(q, case.k_cache, case.v_cache, tables, cu, lens, 0.125, out=got, tiles=tiles,
                  num_tiles=n)  # fmt: skip
    rows = int(cu[-1])
    assert torch.equal(got[:rows], want[:rows])
    assert got[rows:].isnan().all(), "a row past the step was written"
    with pytest.raises(ValueError, match=r"^count needs num_splits"):
        paged_decode(q[:2], case.k_cache, case.v_cache, tables[:2], lens[:2], 0.1, 2, count=two)
    with pytest.raises(ValueError, match=r"^tiles and num_tiles go together"):
        paged_prefill(q, case.k_cache, case.v_cache, tables, cu, lens, 0.1, tiles=tiles)
    with pytest.raises(ValueError, match=r"^tiles "):
        paged_prefill(q, case.k_cache, case.v_cache, tables, cu, lens, 0.1, tiles=tiles[:, :1],
                      num_tiles=n)  # fmt: skip


# ---------------------------------------------------------------- GPU grid

MIXED = [(1, 1328), (5, 18), (129, 463), (1, 1), (17, 17), (300, 2011), (64, 16384), (1, 1025)]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("q_heads", "kv_heads"), GRID_HEADS)
@pytest.mark.parametrize("head_dim", GRID_HEAD_DIMS)
def test_prefill_grid(
    cuda: torch.device, head_dim: int, q_heads: int, kv_heads: int, block_size: int
) -> None:
    dtype = grid_dtype(head_dim, q_heads, block_size)
    case = make_case(
        [c for _, c in MIXED], kv_heads, head_dim, block_size, dtype, cuda, seed=head_dim + 1
    )
    check_prefill(case, q_heads, [q for q, _ in MIXED])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", EDGE_HEAD_DIMS)
def test_prefill_head_dim_edges(cuda: torch.device, head_dim: int) -> None:
    """The ends of the supported head dims and odd paddings, GQA 32/8, both dtypes."""
    for dtype in (F16, BF16):
        case = make_case([c for _, c in MIXED], 8, head_dim, 16, dtype, cuda, seed=head_dim)
        check_prefill(case, 32, [q for q, _ in MIXED])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_prefill_long_prompts(cuda: torch.device, dtype: torch.dtype) -> None:
    """Whole prompts (no cache) and chunks over long prefixes, 32/8 heads, d 128."""
    reqs = [(2048, 2048), (1000, 3048), (2011, 2011), (1, 4000)]
    case = make_case([c for _, c in reqs], 8, 128, 16, dtype, cuda)
    check_prefill(case, 32, [q for q, _ in reqs])


@pytest.mark.gpu
def test_prefill_pool_32768_blocks(cuda: torch.device) -> None:
    reqs = [(1, 1328), (5, 18), (129, 463)]
    case = make_case(
        [c for _, c in reqs],
        8,
        128,
        16,
        F16,
        cuda,
        num_blocks=32768,
        num_layers=4,
        high_blocks=True,
    )
    assert case.block_tables.max().item() * case.k_cache.stride(0) > 2**31
    check_prefill(case, 32, [q for q, _ in reqs])
