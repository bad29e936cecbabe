"""Small Triton device helpers shared by the attention kernels."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# True when kernels run in Triton's CPU interpreter (CI); read at launch time
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def load_rows(ptrs, row_mask, d_mask, USE_ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a [rows, D_PAD] tile; masked-out elements read 0. Masks are only emitted when needed
    so that full tiles keep 16-byte vector loads."""
    if USE_ROW_MASK:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:  # noqa: SIM108
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    return x


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """tl.dot(a, b) in fp32 accumulation. UPCAST (set only under TRITON_INTERPRET=1) multiplies
    fp32 copies instead: the interpreter's bf16 dot returns garbage (seen with triton 3.9)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)
