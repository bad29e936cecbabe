"""The decoder layer's small ops, fused: ``rms_norm`` (one kernel instead of seven), ``rotary``
(q and k rotated in one kernel instead of ten, written token-major for attention) and
``silu_mul`` (the gated MLP's activation: one kernel instead of two).

Each computes in fp32 and rounds once, to the input dtype. transformers' ``LlamaRMSNorm``,
``apply_rotary_pos_emb`` and ``LlamaMLP`` round after every torch op instead (the GPU compiler
folds such intermediate roundings in a Triton kernel anyway), so in fp16/bf16 the fused ops are
at least as accurate and differ from transformers' by about a rounding step.
``kernels.reference`` holds their references.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels._checks import CACHE_DTYPES, check_dense, check_tensor, next_pow2
from kernels._tl_utils import jit

__all__ = ["rms_norm", "rotary", "silu_mul"]


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
    x_ptr: tl.tensor,
    o_ptr: tl.tensor,
    t: tl.tensor,
    stride_xt: tl.tensor,
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
    """Rotates the [HEADS, 2 * HALF] row of token ``t``: out = x * cos + rotate_half(x) * sin,
    with rotate_half(x) = cat(-x2, x1)."""
    h = tl.arange(0, HEADS_PAD)
    mask = (h < HEADS)[:, None] & j_mask[None, :]
    offs = h[:, None] * (2 * HALF) + j[None, :]
    src = x_ptr + t * stride_xt + offs
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = o_ptr.dtype.element_ty
    dst = o_ptr + t * (HEADS * 2 * HALF) + offs
    tl.store(dst, (x1 * c1[None, :] - x2 * s1[None, :]).to(dt), mask=mask)
    tl.store(dst + HALF, (x2 * c2[None, :] + x1 * s2[None, :]).to(dt), mask=mask)


@jit(varying=("stride_qt", "stride_kt"))
def _rotary_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    qo_ptr: tl.tensor,
    ko_ptr: tl.tensor,
    stride_qt: tl.tensor,
    stride_kt: tl.tensor,
    Q_HEADS: tl.constexpr,
    Q_PAD: tl.constexpr,
    K_HEADS: tl.constexpr,
    K_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
) -> None:
    """One program per token: its cos/sin row read once, every q and k head rotated."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_mask = j < HALF
    row = t * (2 * HALF)
    c1 = tl.load(cos_ptr + row + j, mask=j_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + j, mask=j_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + j, mask=j_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, t, stride_qt, c1, c2, s1, s2, j, j_mask, Q_HEADS, Q_PAD, HALF)
    _rotate_heads(k_ptr, ko_ptr, t, stride_kt, c1, c2, s1, s2, j, j_mask, K_HEADS, K_PAD, HALF)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k (the "rotate half" layout of Llama-family models); returns
    new (q, k), contiguous and shaped like the inputs.

    q: [T, q_heads, D]; k: [T, kv_heads, D], each contiguous within a token (any token stride:
    slices of a fused qkv projection); cos, sin: [T, D] contiguous (a row per token, both
    halves, as transformers' rotary modules build them); D even; one dtype (fp16/bf16/fp32),
    one device.
    """
    check_tensor("q", q, "[T, q_heads, D]", (None, None, None), CACHE_DTYPES)
    tokens, q_heads, head_dim = q.shape
    dtypes = (q.dtype,)
    check_tensor("k", k, "[T, kv_heads, D]", (tokens, None, head_dim), dtypes, q.device, "q", "q")
    check_tensor("cos", cos, "[T, D]", (tokens, head_dim), dtypes, q.device, "q", "q")
    check_tensor("sin", sin, "[T, D]", (tokens, head_dim), dtypes, q.device, "q", "q")
    check_dense("q", q, 1, "contiguous within a token")
    check_dense("k", k, 1, "contiguous within a token")
    check_dense("cos", cos, 0, "contiguous")
    check_dense("sin", sin, 0, "contiguous")
    if head_dim % 2:
        raise ValueError(f"q's head dim must be even, got {head_dim}")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if tokens == 0 or head_dim == 0:
        return q_out, k_out
    kv_heads, half = k.shape[1], head_dim // 2
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, q_out, k_out, q.stride(0), k.stride(0),
        Q_HEADS=q_heads, Q_PAD=next_pow2(q_heads), K_HEADS=kv_heads, K_PAD=next_pow2(kv_heads),
        HALF=half, HALF_PAD=next_pow2(half), num_warps=4,
    )  # fmt: skip
    return q_out, k_out


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
    _silu_mul_kernel[(tokens, -(-n // block))](gate_up, out, gate_up.stride(0), n, BLOCK=block)
    return out
