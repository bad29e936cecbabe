"""Paged decode attention: one query token per request, GQA-aware, optional split-K.

Each program owns one (request, kv head, split): it loads the query heads of that kv head's group
as the rows of one tile, so every K/V tile read through the block table serves the whole group.
With ``num_splits > 1`` each request cuts its own context (read on the device) into at most
``num_splits`` equal, BLOCK_N-aligned token ranges of at least two tiles (``_split_tokens``), each
program writes its normalised partial output and log-sum-exp, and a second kernel merges them
(flash-decoding). ``num_splits == 1`` writes the output directly (no second stage). Because the
ranges come from the contexts, not from the block table's width, a CUDA graph captured once with
tables as wide as the model's context still splits each replay's short contexts.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels._checks import (
    INTERPRET,
    cdiv,
    check_attention_args,
    check_block_tables,
    check_index,
    check_optional_int,
    check_out,
    next_pow2,
)
from kernels._tl_utils import jit, load_rows, mma

__all__ = ["choose_num_splits", "decode_config", "paged_decode"]

LOG2E = 1.4426950408889634


@jit
def _decode_step(
    q: tl.tensor, acc: tl.tensor, m_i: tl.tensor, l_i: tl.tensor, k_ptr: tl.tensor,
    v_ptr: tl.tensor, bt_row: tl.tensor, n0: tl.tensor, end: tl.tensor, head_off: tl.tensor,
    qk_scale: tl.tensor, stride_cb: tl.tensor, stride_ct: tl.tensor, d: tl.tensor,
    d_mask: tl.tensor,
    EVEN_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:  # fmt: skip
    """One BLOCK_N tile of keys for the group's query rows: online-softmax update. Every tile is
    masked (an unmasked main loop measured 20-25% slower on the H200)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < end
    block = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    tok_off = block * stride_cb + (n % BLOCK_SIZE) * stride_ct + head_off  # [BLOCK_N]
    k = load_rows(k_ptr + tok_off[:, None] + d[None, :], n_mask, d_mask, True, EVEN_D)
    v = load_rows(v_ptr + tok_off[:, None] + d[None, :], n_mask, d_mask, True, EVEN_D)
    s = mma(q, tl.trans(k), UPCAST) * qk_scale  # [GROUP_PAD, BLOCK_N], log2 domain
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
    return acc, m_new, l_i


@jit
def _split_tokens(ctx: tl.tensor, num_splits: tl.tensor, BLOCK_N: tl.constexpr) -> tl.tensor:
    """Tokens per split of a request whose context is ``ctx``: ``ctx`` cut into ``num_splits``
    BLOCK_N-aligned ranges, none shorter than two tiles. The request uses ``cdiv(ctx, that)``
    of its splits (0 for an empty context)."""
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, 2 * BLOCK_N)


@jit(varying=("num_splits", "stride_btb"))
def _decode_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    bt_ptr: tl.tensor,
    cl_ptr: tl.tensor,
    count_ptr: tl.tensor,
    out_ptr: tl.tensor,
    part_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    qk_scale: tl.tensor,
    num_splits: tl.tensor,
    stride_qb: tl.tensor,
    stride_qh: tl.tensor,
    stride_cb: tl.tensor,
    stride_ct: tl.tensor,
    stride_ch: tl.tensor,
    stride_btb: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    IS_SPLIT: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    HAS_COUNT: tl.constexpr,
) -> None:
    if HEADS_FASTEST:  # a request's kv heads run side by side: they read the same blocks
        hkv = tl.program_id(0)
        b = tl.program_id(1)
        kv_heads = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        hkv = tl.program_id(1)
        kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    if HAS_COUNT:  # noqa: SIM102  (a constexpr: the load exists only when it is set)
        if b >= tl.load(count_ptr):
            return  # a row past the step's decodes (a CUDA graph's grid is its bucket's)
    ctx = tl.load(cl_ptr + b)
    start = 0
    end = ctx
    if IS_SPLIT:
        tokens_per_split = _split_tokens(ctx, num_splits, BLOCK_N)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, ctx)
        if start >= ctx:
            return  # this split is past the request's context: the reduce never reads it

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = hkv * GROUP + g
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    # q: [GROUP_PAD, D_PAD]
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    head_off = hkv * stride_ch
    for n0 in range(start, end, BLOCK_N):  # one masked loop pipelines best (see bench notes)
        acc, m_i, l_i = _decode_step(
            q, acc, m_i, l_i, k_ptr, v_ptr, bt_row, n0, end, head_off, qk_scale,
            stride_cb, stride_ct, d, d_mask, EVEN_D, BLOCK_SIZE, BLOCK_N, UPCAST,
        )  # fmt: skip

    out_mask = g_mask[:, None] & d_mask[None, :]
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # context 0: write zeros, not NaN
    o = acc / l_safe[:, None]
    if not IS_SPLIT:
        dst = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # part: [B, q_heads, num_splits, D_PAD] fp32; lse: [B, q_heads, num_splits] fp32 (log2)
        row = (b.to(tl.int64) * (kv_heads * GROUP) + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * D_PAD + d[None, :], o, mask=out_mask)
        tl.store(lse_ptr + row, m_i + tl.log2(l_safe), mask=g_mask)


@jit(varying=("num_splits",))
def _reduce_kernel(
    part_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    cl_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_splits: tl.tensor,
    stride_ob: tl.tensor,
    stride_oh: tl.tensor,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
) -> None:
    """Merge the partial outputs of the splits a request actually used. Grid (B, q_heads)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(cl_ptr + b)
    n_used = tl.cdiv(ctx, _split_tokens(ctx, num_splits, BLOCK_N))
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < n_used
    row0 = (b.to(tl.int64) * tl.num_programs(1) + h) * num_splits
    lse = tl.load(lse_ptr + row0 + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(n_used > 0, m, 0.0)
    w = tl.where(s_mask, tl.exp2(lse - m), 0.0)  # [SPLITS_PAD]
    part = tl.load(
        part_ptr + (row0 + s)[:, None] * D_PAD + d[None, :],
        mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    denom = tl.sum(w, 0)
    denom = tl.where(denom > 0.0, denom, 1.0)
    o = tl.sum(part * w[:, None], 0) / denom
    dst = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


MAX_SPLITS = 128
MAX_GRID_YZ = 65535  # CUDA's limit on a grid's second and third dims


def decode_config(head_dim: int, group: int) -> dict[str, int]:
    """Tile and launch parameters of the split kernel (chosen on the H200, see bench);
    ``HEADS_FASTEST``: 1 orders the grid (kv head, request, split), 0 (request, kv head, split)."""
    d_pad = next_pow2(head_dim)
    block_n = 64 if d_pad <= 128 else 32
    stages = 3 if d_pad <= 128 else 2
    warps = 2 if d_pad <= 64 else 4  # d 64, B=128, context 600: 3.75 TB/s against 3.05 with 4
    return {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "HEADS_FASTEST": 1}


def choose_num_splits(
    batch: int, kv_heads: int, max_context: int, num_sms: int, block_n: int
) -> int:
    """Measured heuristic (bench/kernels.py split sweep, H200): no split once the grid has
    2.5 programs per SM; otherwise the power of two that brings it to ~4 per SM, never giving a
    split fewer than 2 tiles (2*BLOCK_N tokens), at most ``MAX_SPLITS``."""
    programs = batch * kv_heads
    if 2 * programs >= 5 * num_sms:
        return 1
    want = 1 << (cdiv(4 * num_sms, programs).bit_length() - 1)  # round down to 2^k
    cap = max(1, max_context // (2 * block_n))
    return max(1, min(want, cap, MAX_SPLITS))


def compile_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, q_heads: int) -> int:
    """Launches ``paged_decode`` once per variant a batch over these caches can need (the
    single-pass kernel, and the split kernel with its reduction for every power-of-two split
    count up to ``MAX_SPLITS``: a constexpr of the reduction), on one request of one token.
    Triton compiles a variant at its first launch, which stalls the caller for ~0.3 s: a
    worker does this before traffic (a mixed step's split count depends on its batch). Reads
    block 0 of the caches, writes nothing to them. Returns the number of launches."""
    head_dim, device = k_cache.shape[3], k_cache.device
    query = torch.zeros(1, q_heads, head_dim, dtype=k_cache.dtype, device=device)
    context = torch.ones(1, dtype=torch.int32, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)  # block 0
    splits = [1 << k for k in range(MAX_SPLITS.bit_length())]  # 1, 2, 4, ..., MAX_SPLITS
    for n in splits:  # a request uses one split of its one token; the others exit at once
        paged_decode(query, k_cache, v_cache, table, context, 1.0, num_splits=n)
    return len(splits)


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention; returns out [B, q_heads, head_dim] in query.dtype.

    query: [B, q_heads, D] fp16/bf16, last dim contiguous; k_cache, v_cache: [num_blocks,
    block_size, kv_heads, D] views of the query's dtype (see ``check_cache_pair``); block_tables:
    [B, max_blocks] int32, rows contiguous; context_lens: [B] int32, contiguous (0 gives zeros);
    all on one device (``kernels._checks`` refuses anything else before launching). Not checked
    (values, no device sync): context_lens[b] <= max_blocks * block_size and the table entries
    it covers are blocks of the cache; entries past a request's context are never read. Each
    request splits its own context (``_split_tokens``), so a graph-captured call splits the
    contexts of every replay.
    num_splits: None = heuristic (``choose_num_splits``, capped by the table's width), 1 =
    single-pass path, else >= 1 (the splits a request's context does not need exit at once).
    out: where to write (``check_out``: the query's shape and dtype); None allocates it.
    count: [1] int32 on the query's device, or None: only requests ``b < count[0]`` are attended
    (the other rows of ``out`` are left unwritten), so a CUDA graph captured for B rows serves
    any step of at most B decodes; it needs the single-pass path (``num_splits`` None or 1).
    """
    q, (block_size, q_heads, kv_heads, head_dim) = check_attention_args(
        query, k_cache, v_cache, scale
    )
    batch = q.shape[0]
    check_block_tables(block_tables, batch, q.device)
    check_index("context_lens", context_lens, "[B]", batch, torch.int32, q.device, "query")
    check_optional_int("num_splits", num_splits, 1)
    if count is not None:
        check_index("count", count, "[1]", 1, torch.int32, q.device, "query")
        if num_splits not in (None, 1):
            raise ValueError(f"count needs num_splits None or 1, got {num_splits}")
        num_splits = 1
    out = torch.empty_like(query) if out is None else check_out(out, q)
    if batch == 0:
        return out
    group = q_heads // kv_heads
    d_pad = next_pow2(head_dim)
    cfg = decode_config(head_dim, group)
    block_n = cfg["BLOCK_N"]
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        sms = _num_sms(query.device)
        num_splits = choose_num_splits(batch, kv_heads, max_context, sms, block_n)
    if num_splits > 1:
        part = torch.empty(
            (batch, q_heads, num_splits, d_pad), device=query.device, dtype=torch.float32
        )
        lse = torch.empty((batch, q_heads, num_splits), device=query.device, dtype=torch.float32)
    else:
        part = lse = out  # unused by the single-pass kernel
    # a grid's second and third dims stop at 65535: a larger batch goes first
    heads_fastest = bool(cfg.get("HEADS_FASTEST", 0)) and batch <= MAX_GRID_YZ
    grid = (kv_heads, batch, num_splits) if heads_fastest else (batch, kv_heads, num_splits)
    _decode_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        context_lens if count is None else count,
        out,
        part,
        lse,
        scale * LOG2E,
        num_splits,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        IS_SPLIT=num_splits > 1,
        GROUP=group,
        GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        UPCAST=INTERPRET,
        HEADS_FASTEST=heads_fastest,
        HAS_COUNT=count is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if num_splits > 1:
        _reduce_kernel[(batch, q_heads)](
            part,
            lse,
            context_lens,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            SPLITS_PAD=next_pow2(num_splits),
            BLOCK_N=block_n,
            num_warps=4,
        )
    return out
