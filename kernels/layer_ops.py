"""The decoder layer's small ops, fused: ``rms_norm`` (one kernel instead of seven),
``rotary_store`` (q and k rotated, q written token-major for attention, k and v stored in their
cache slots: one kernel instead of ten and the K/V store) and ``silu_mul`` (the gated MLP's
activation: one kernel instead of two).

Each computes in fp32 and rounds once, to the input dtype. transformers' ``LlamaRMSNorm``,
``apply_rotary_pos_emb`` and ``LlamaMLP`` round after every torch op instead (the GPU compiler
folds such intermediate roundings in a Triton kernel anyway), so in fp16/bf16 the fused ops are
at least as accurate and differ from transformers' by about a rounding step.
``kernels.reference`` holds their references.
"""

from __future__ import annotations

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

__all__ = ["rms_norm", "rotary_store", "silu_mul"]


@jit
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    n_cols: tl.tensor,
    eps: tl.tensor,
    BLOCK: tl.constexpr,
) -> None:
    """One program per row: out = w * x * rsqrt(mean(x^2) + eps)."""
    row = tl.program_id(0).to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, 0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = w * (x * tl.rsqrt(mean_sq + eps))
    tl.store(out_ptr + row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; returns a new tensor shaped like ``x``.

    x: [..., H] fp16/bf16/fp32, contiguous; weight: [H], x's dtype and device; eps > 0.
    """
    check_tensor("x", x, "[..., H]", (None,) * x.dim(), CACHE_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim, got a scalar")
    hidden = x.shape[-1]
    check_dense("x", x, 0, "contiguous")
    check_tensor("weight", weight, "[H]", (hidden,), (x.dtype,), x.device, "x", "x")
    check_dense("weight", weight, 0, "contiguous")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"eps must be a float > 0, got {eps!r}")
    out = torch.empty_like(x)
    rows = x.numel() // max(hidden, 1)
    if rows == 0 or hidden == 0:
        return out
    block = next_pow2(hidden)
    _rms_norm_kernel[(rows,)](
        x, weight, out, hidden, eps, BLOCK=block, num_warps=4 if block <= 4096 else 8
    )
    return out


@jit
def _rotate_heads(
    src: tl.tensor,
    dst: tl.tensor,
    c1: tl.tensor,
    c2: tl.tensor,
    s1: tl.tensor,
    s2: tl.tensor,
    j: tl.tensor,
    j_mask: tl.tensor,
    HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
) -> None:
    """Rotates one token's [HEADS, 2 * HALF] row at ``src`` into ``dst`` (both contiguous within
    the token): out = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1)."""
    h = tl.arange(0, HEADS_PAD)
    mask = (h < HEADS)[:, None] & j_mask[None, :]
    offs = h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = dst.dtype.element_ty
    tl.store(dst + offs, (x1 * c1[None, :] - x2 * s1[None, :]).to(dt), mask=mask)
    tl.store(dst + offs + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(dt), mask=mask)


@jit(varying=("stride_qt", "stride_kt", "stride_vt"))
def _rotary_store_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    qo_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_qt: tl.tensor,
    stride_kt: tl.tensor,
    stride_vt: tl.tensor,
    stride_cb: tl.tensor,
    Q_HEADS: tl.constexpr,
    Q_PAD: tl.constexpr,
    K_HEADS: tl.constexpr,
    K_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
) -> None:
    """One program per token: its cos/sin row read once, every q head rotated into ``qo``, every
    k head rotated and every v head copied into the token's cache slot (none for slot -1)."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_mask = j < HALF
    row = t * (2 * HALF)
    c1 = tl.load(cos_ptr + row + j, mask=j_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + j, mask=j_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    q_dst = qo_ptr + t * (Q_HEADS * 2 * HALF)
    _rotate_heads(q_ptr + t * stride_qt, q_dst, c1, c2, s1, s2, j, j_mask, Q_HEADS, Q_PAD, HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * (K_HEADS * 2 * HALF)
        k_src = k_ptr + t * stride_kt
        _rotate_heads(k_src, k_cache_ptr + dst, c1, c2, s1, s2, j, j_mask, K_HEADS, K_PAD, HALF)
        h = tl.arange(0, K_PAD)
        d = tl.arange(0, 2 * HALF_PAD)
        offs = h[:, None] * (2 * HALF) + d[None, :]
        mask = (h < K_HEADS)[:, None] & (d < 2 * HALF)[None, :]
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(v_cache_ptr + dst + offs, v, mask=mask)


def rotary_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The rotary embedding of q and k (the "rotate half" layout of Llama-family models) and
    the paged forward's K/V store, in one kernel. Returns the rotated q, new and contiguous;
    writes the rotated k[t] and v[t] into slot ``slot_mapping[t]`` of k_cache / v_cache (in
    place; slot -1 is padding: nothing written). Reads q, k, v, cos, sin; writes nothing else.

    q: [T, q_heads, D]; k, v: [T, kv_heads, D], each contiguous within a token (any token
    stride: slices of a fused qkv projection); cos, sin: [T, D] contiguous (a row per token,
    both halves, as transformers' rotary modules build them); D even; k_cache, v_cache:
    [num_blocks, block_size, kv_heads, D] (``check_cache_pair``); slot_mapping: [T] int64,
    contiguous, slot = block * block_size + offset. One dtype (fp16/bf16/fp32), one device.
    Not checked (values, no device sync): slots below num_blocks * block_size and distinct.
    """
    check_tensor("q", q, "[T, q_heads, D]", (None, None, None), CACHE_DTYPES)
    tokens, q_heads, head_dim = q.shape
    block_size, kv_heads, cache_dim = check_cache_pair(k_cache, v_cache, (q.dtype,), q.device, "q")
    dtypes, kv_shape = (q.dtype,), (tokens, kv_heads, head_dim)
    for name, x in (("k", k), ("v", v)):
        check_tensor(name, x, "[T, kv_heads, D]", kv_shape, dtypes, q.device, "q", "q")
        check_dense(name, x, 1, "contiguous within a token")
    check_tensor("cos", cos, "[T, D]", (tokens, head_dim), dtypes, q.device, "q", "q")
    check_tensor("sin", sin, "[T, D]", (tokens, head_dim), dtypes, q.device, "q", "q")
    check_dense("q", q, 1, "contiguous within a token")
    check_dense("cos", cos, 0, "contiguous")
    check_dense("sin", sin, 0, "contiguous")
    if cache_dim != head_dim:
        raise ValueError(f"k_cache's head dim must be q's {head_dim}, got {cache_dim}")
    check_index("slot_mapping", slot_mapping, "[T]", tokens, torch.int64, q.device, "q")
    if head_dim % 2:
        raise ValueError(f"q's head dim must be even, got {head_dim}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0 or head_dim == 0:
        return q_out
    half = head_dim // 2
    _rotary_store_kernel[(tokens,)](
        q, k, v, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0),
        Q_HEADS=q_heads, Q_PAD=next_pow2(q_heads), K_HEADS=kv_heads, K_PAD=next_pow2(kv_heads),
        HALF=half, HALF_PAD=next_pow2(half), BLOCK_SIZE=block_size, num_warps=4,
    )  # fmt: skip
    return q_out


@jit(varying=("stride_xt",))
def _silu_mul_kernel(
    x_ptr: tl.tensor, out_ptr: tl.tensor, stride_xt: tl.tensor, n: tl.tensor, BLOCK: tl.constexpr
) -> None:
    """Grid (T, cdiv(n, BLOCK)): out[t, i] = silu(x[t, i]) * x[t, n + i]."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    gate = tl.load(x_ptr + t * stride_xt + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + n + i, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * n + i, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat(gate, up) along the last dim (a fused gate/up
    projection's output); returns a new contiguous [T, I].

    gate_up: [T, 2 * I] fp16/bf16/fp32, contiguous within a row (any row stride).
    """
    check_tensor("gate_up", gate_up, "[T, 2 * I]", (None, None), CACHE_DTYPES)
    check_dense("gate_up", gate_up, 1, "contiguous within a row")
    tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up), got {width}")
    n = width // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if tokens == 0 or n == 0:
        return out
    block = min(1024, next_pow2(n))
    _silu_mul_kernel[(tokens, cdiv(n, block))](gate_up, out, gate_up.stride(0), n, BLOCK=block)
    return out
