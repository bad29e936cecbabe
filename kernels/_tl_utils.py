"""Small Triton device helpers shared by the attention kernels, and ``jit`` (``triton.jit`` with a
type: triton ships no annotations, so mypy would see every kernel as an untyped ``Any``).

Parameters of ``@jit`` functions are annotated ``tl.tensor`` (a runtime argument: a pointer or a
scalar, specialised exactly as without an annotation) or ``tl.constexpr`` (a compile-time
constant); triton reads only the ``constexpr`` ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast, overload

import triton
import triton.language as tl

__all__ = ["Kernel", "jit", "load_rows", "mma"]


class Kernel(Protocol):
    """A ``triton.jit`` function: launched from the host as ``kernel[grid](*args, **meta)``,
    called from another kernel as ``kernel(*args)``."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


@overload
def jit(fn: Callable[..., object]) -> Kernel: ...
@overload
def jit(*, varying: tuple[str, ...]) -> Callable[[Callable[..., object]], Kernel]: ...
def jit(
    fn: Callable[..., object] | None = None, *, varying: tuple[str, ...] = ()
) -> Kernel | Callable[[Callable[..., object]], Kernel]:
    """``@triton.jit``, typed; ``@jit(varying=(...))`` names the integer arguments whose value
    changes from one launch to the next (a step's tile count, a block table's width): triton
    would compile a variant per class of their value (1, a multiple of 16, other), and a
    server would stall for a second whenever traffic first met one, so they are never
    specialised (``do_not_specialize``)."""

    def wrap(f: Callable[..., object]) -> Kernel:
        return cast(Kernel, triton.jit(f, do_not_specialize=list(varying)))

    return wrap if fn is None else wrap(fn)


@jit
def load_rows(
    ptrs: tl.tensor,
    row_mask: tl.tensor,
    d_mask: tl.tensor,
    USE_ROW_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,
) -> tl.tensor:
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


@jit
def mma(a: tl.tensor, b: tl.tensor, UPCAST: tl.constexpr) -> tl.tensor:
    """tl.dot(a, b) in fp32 accumulation. UPCAST (set only under TRITON_INTERPRET=1) multiplies
    fp32 copies instead: the interpreter's bf16 dot returns garbage (seen with triton 3.9)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)
