"""Paged prefill / extend attention over packed variable-length chunks.

The new tokens of request b (rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of the packed query) sit at the
end of its context_lens[b] keys, which are all in the paged cache already (store_kv ran first), so
one causal pass through the block table covers the cached prefix and the chunk itself. A program
owns one (request, kv head, tile of tokens); the rows of its query tile are (token, head-of-group)
pairs, so every K/V tile it loads serves all query heads of the group (GQA). Keys below the tile's
first position are visible to every row and go through an unmasked loop; only the diagonal
stretch is masked. Decode rows (q_len 1) mix freely into the batch.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels._checks import (
    INTERPRET,
    cdiv,
    check_attention_args,
    check_block_tables,
    check_dense,
    check_index,
    check_optional_int,
    check_out,
    check_tensor,
    next_pow2,
)
from kernels._tl_utils import jit, load_rows, mma

__all__ = ["paged_prefill", "prefill_config", "prefill_tile_tokens", "prefill_tiles"]

LOG2E = 1.4426950408889634


@jit
def _tile_step(
    q: tl.tensor,
    acc: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    bt_row: tl.tensor,
    n0: tl.tensor,
    kv_end: tl.tensor,
    pos: tl.tensor,
    head_off: tl.tensor,
    qk_scale: tl.tensor,
    stride_cb: tl.tensor,
    stride_ct: tl.tensor,
    d: tl.tensor,
    d_mask: tl.tensor,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One BLOCK_N tile of keys: online-softmax update of (acc, m_i, l_i)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < kv_end
    if MASKED:
        block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        block = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
    tok_off = block * stride_cb + (n % BLOCK_SIZE) * stride_ct + head_off  # [BLOCK_N]
    k = load_rows(k_ptr + tok_off[:, None] + d[None, :], n_mask, d_mask, MASKED, EVEN_D)
    s = mma(q, tl.trans(k), UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        visible = (n[None, :] <= pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_rows(v_ptr + tok_off[:, None] + d[None, :], n_mask, d_mask, MASKED, EVEN_D)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
    return acc, m_new, l_i


@jit(varying=("first", "num_m_tiles", "stride_btb"))
def _prefill_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    bt_ptr: tl.tensor,
    cu_ptr: tl.tensor,
    cl_ptr: tl.tensor,
    tiles_ptr: tl.tensor,
    num_tiles_ptr: tl.tensor,
    out_ptr: tl.tensor,
    qk_scale: tl.tensor,
    kv_heads: tl.tensor,
    first: tl.tensor,
    num_m_tiles: tl.tensor,
    stride_qt: tl.tensor,
    stride_qh: tl.tensor,
    stride_cb: tl.tensor,
    stride_ct: tl.tensor,
    stride_ch: tl.tensor,
    stride_btb: tl.tensor,
    stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    TILE_LIST: tl.constexpr,
) -> None:
    """Grid ((B - first) * kv_heads, num_m_tiles); tiles with the most keys are scheduled
    first. ``TILE_LIST``: grid (capacity * kv_heads, 1), program p works on the (chunk, tile)
    pair p // kv_heads of ``tiles_ptr`` if it is below ``num_tiles_ptr[0]``."""
    hkv = tl.program_id(0) % kv_heads
    if TILE_LIST:
        item = tl.program_id(0) // kv_heads
        if item >= tl.load(num_tiles_ptr):
            return
        b = tl.load(tiles_ptr + 2 * item)
        tile = tl.load(tiles_ptr + 2 * item + 1)
    else:
        b = first + tl.program_id(0) // kv_heads
        tile = num_m_tiles - 1 - tl.program_id(1)
    tokens_per_tile: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    tok0 = tile * tokens_per_tile
    if tok0 >= q_len:
        return
    ctx = tl.load(cl_ptr + b)
    base = ctx - q_len  # absolute position of the chunk's first token

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    g = r % GROUP
    row_mask = (r < tokens_per_tile * GROUP) & (tok < q_len)
    pos = base + tok  # [BLOCK_M] absolute position of each row
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + (hkv * GROUP + g) * stride_qh
    # q: [BLOCK_M, D_PAD]
    q = tl.load(
        q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    head_off = hkv * stride_ch
    # keys 0..base+tok0 are visible to every row of the tile
    full_end = ((base + tok0 + 1) // BLOCK_N) * BLOCK_N
    kv_end = base + tl.minimum(q_len, tok0 + tokens_per_tile)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _tile_step(
            q,
            acc,
            m_i,
            l_i,
            k_ptr,
            v_ptr,
            bt_row,
            n0,
            kv_end,
            pos,
            head_off,
            qk_scale,
            stride_cb,
            stride_ct,
            d,
            d_mask,
            False,
            HEAD_DIM == D_PAD,
            BLOCK_SIZE,
            BLOCK_N,
            UPCAST,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _tile_step(
            q,
            acc,
            m_i,
            l_i,
            k_ptr,
            v_ptr,
            bt_row,
            n0,
            kv_end,
            pos,
            head_off,
            qk_scale,
            stride_cb,
            stride_ct,
            d,
            d_mask,
            True,
            HEAD_DIM == D_PAD,
            BLOCK_SIZE,
            BLOCK_N,
            UPCAST,
        )
    o = acc / l_i[:, None]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + (hkv * GROUP + g) * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def prefill_config(head_dim: int, group: int) -> dict[str, int]:
    """Tile and launch parameters (chosen on the H200, see bench/kernels.py)."""
    d_pad = next_pow2(head_dim)
    if d_pad <= 64:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    elif d_pad <= 128:
        cfg = {"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    else:
        cfg = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
    while cfg["BLOCK_M"] < group:  # a tile holds at least one token's whole group
        cfg["BLOCK_M"] *= 2
    return cfg


def prefill_tile_tokens(head_dim: int, group: int) -> int:
    """Query tokens per tile of the prefill kernel (a tile holds ``group`` heads per token)."""
    return prefill_config(head_dim, group)["BLOCK_M"] // group


def prefill_tiles(
    q_lens: list[int], context_lens: list[int], first: int, tile_tokens: int
) -> list[tuple[int, int]]:
    """The (chunk, tile) pairs of ``paged_prefill(tiles=...)`` for chunks ``first..`` of a step
    (their query lengths and context lengths, chunk included), the tiles with the most keys
    first, as the kernel's own grid orders them."""
    pairs = [
        (b, tile) for b in range(first, len(q_lens)) for tile in range(cdiv(q_lens[b], tile_tokens))
    ]
    pairs.sort(key=lambda bt: -(context_lens[bt[0]] - q_lens[bt[0]] + bt[1] * tile_tokens))
    return pairs


def paged_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    first: int = 0,
    tiles: torch.Tensor | None = None,
    num_tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed chunks over their paged context; out [T, q_heads, D].

    query: [T, q_heads, D] fp16/bf16 packed, last dim contiguous (rows past cu_seqlens_q[-1] are
    left unwritten); k_cache, v_cache: [num_blocks, block_size, kv_heads, D] views of the
    query's dtype (see ``check_cache_pair``); block_tables: [B, max_blocks] int32, rows
    contiguous; cu_seqlens_q: [B+1] int32, contiguous; context_lens: [B] int32, contiguous; all
    on one device (``kernels._checks`` refuses anything else before launching). Not checked
    (values, no device sync): cu_seqlens_q is non-decreasing from 0 up to at most T,
    context_lens[b] >= that request's q_len (it counts the chunk's own tokens, already stored)
    and its blocks are in the table. max_query_len: largest q_len in the batch (a smaller one
    leaves rows unwritten); None reads it from cu_seqlens_q (one device sync). out: where to
    write (``check_out``: the query's shape and dtype; only the chunks' rows are written); None
    allocates it. first: attend chunks first..B-1 only (the others' rows are left unwritten: a
    step's leading decodes go to ``paged_decode``). An offset rather than sliced index tensors:
    Triton specialises a kernel on its pointers' 16-byte alignment, and slices at every offset
    would compile up to eight variants in the middle of traffic.
    tiles, num_tiles: the work as a list instead (``first`` and ``max_query_len`` unused), so a
    CUDA graph captured once serves any step: tiles [capacity, 2] int32, rows (chunk, query tile
    of ``prefill_tile_tokens`` tokens) as ``prefill_tiles`` lists them, of which the first
    num_tiles[0] ([1] int32) are attended; both on the query's device, contiguous. Not checked
    (values): the pairs name chunks of the batch and tiles inside their chunks, each at most once.
    The caller checks the bucket's capacity: a step with more tiles would leave rows unwritten.
    """
    q, (block_size, q_heads, kv_heads, head_dim) = check_attention_args(
        query, k_cache, v_cache, scale
    )
    batch = check_block_tables(block_tables, None, q.device).shape[0]
    device = q.device
    check_index("cu_seqlens_q", cu_seqlens_q, "[B + 1]", batch + 1, torch.int32, device, "query")
    check_index("context_lens", context_lens, "[B]", batch, torch.int32, device, "query")
    check_optional_int("max_query_len", max_query_len, 0)
    check_optional_int("first", first, 0)
    if first > batch:
        raise ValueError(f"first must be at most the batch's {batch} chunks, got {first}")
    if (tiles is None) != (num_tiles is None):
        raise ValueError("tiles and num_tiles go together")
    if tiles is not None and num_tiles is not None:
        check_index("num_tiles", num_tiles, "[1]", 1, torch.int32, device, "query")
        check_tensor("tiles", tiles, "[N, 2]", (None, 2), (torch.int32,), device, "query", "query")
        check_dense("tiles", tiles, 0, "contiguous")
    out = torch.empty_like(query) if out is None else check_out(out, q)
    if batch == first or query.shape[0] == 0:
        return out
    group = q_heads // kv_heads
    cfg = prefill_config(head_dim, group)
    num_m_tiles = 1
    if tiles is not None:
        grid = (tiles.shape[0] * kv_heads, 1)
    else:
        if max_query_len is None:
            max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max().item())
        num_m_tiles = cdiv(max_query_len, cfg["BLOCK_M"] // group)
        grid = ((batch - first) * kv_heads, num_m_tiles)
    if grid[0] * grid[1] == 0:
        return out
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        context_lens,
        context_lens if tiles is None else tiles,
        context_lens if num_tiles is None else num_tiles,
        out,
        scale * LOG2E,
        kv_heads,
        first,
        num_m_tiles,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        UPCAST=INTERPRET,
        TILE_LIST=tiles is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
