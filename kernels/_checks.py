"""Argument checks shared by every Triton launcher (torch only: importing this needs no triton).

Every launcher checks every tensor it reads or writes before it launches anything, so a bad
argument raises before a byte is written: ``TypeError`` for a non-tensor or a wrong dtype,
``ValueError`` for a wrong shape, device or layout, each message starting with the argument's
name. The checks read tensor metadata only (no device sync, no ``.item()``): they are cheap enough
for every forward and safe inside CUDA-graph capture. What they cannot see (slot, block and
length *values*) is the caller's contract, documented on each launcher.

What the kernels support, as enforced here:

- ``head_dim``: the attention tiles pad it to the next power of two ``D_PAD`` (``tl.arange``
  needs a power of two; the rest is masked), ``tl.dot`` needs ``D_PAD >= 16`` and the tile
  configs go up to ``D_PAD = 256``: every head dim in ``SUPPORTED_HEAD_DIMS`` (9..256).
- ``block_size``: a power of two in ``BLOCK_SIZES`` (8..64).
- dtypes: attention takes fp16/bf16 (``ATTN_DTYPES``); ``store_kv`` and ``copy_blocks`` also
  fp32 caches and pools (``CACHE_DTYPES``).
"""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "ATTN_DTYPES",
    "BLOCK_SIZES",
    "CACHE_DTYPES",
    "INTERPRET",
    "MAX_D_PAD",
    "MIN_D_PAD",
    "SUPPORTED_HEAD_DIMS",
    "AttentionShape",
    "cdiv",
    "check_attention_args",
    "check_block_tables",
    "check_cache_pair",
    "check_dense",
    "check_head_dim",
    "check_index",
    "check_optional_int",
    "check_scale",
    "check_tensor",
    "next_pow2",
]

# True when kernels run in Triton's CPU interpreter (CI); read once, as triton.jit does
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

ATTN_DTYPES = (torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_SIZES = (8, 16, 32, 64)
MIN_D_PAD, MAX_D_PAD = 16, 256  # tl.dot's smallest dimension; the largest tile config
SUPPORTED_HEAD_DIMS = range(MIN_D_PAD // 2 + 1, MAX_D_PAD + 1)  # next_pow2 in [16, 256]

AttentionShape = tuple[int, int, int, int]  # (block_size, q_heads, kv_heads, head_dim)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (``triton.cdiv`` without the untyped import)."""
    return -(-a // b)


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return " or ".join(str(d) for d in dtypes)


def _shape_text(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_tensor(
    name: str,
    t: object,
    dims: str,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    like: str = "",
    dtype_of: str = "",
) -> torch.Tensor:
    """``t`` is a tensor of one of ``dtypes``, of ``shape`` (None: any size) and on ``device``;
    returns it. ``dims`` names the dimensions in messages (``"[T, kv_heads, head_dim]"``);
    ``like`` and ``dtype_of`` name the arguments ``device`` and ``dtypes`` come from, if any.
    ``device=None``: the first tensor of a launcher, which must be on CUDA (any device under
    TRITON_INTERPRET=1).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        of = f" ({dtype_of}'s dtype)" if dtype_of else ""
        raise TypeError(f"{name} must be {_dtype_names(dtypes)}{of}, got {t.dtype}")
    got = t.shape
    if None not in shape:  # written for speed: this runs on every forward
        bad = got != shape
    else:
        bad = len(got) != len(shape)
        if not bad:
            for want, size in zip(shape, got, strict=True):
                if want is not None and want != size:
                    bad = True
    if bad:
        sizes = "" if all(s is None for s in shape) else f" = {_shape_text(shape)}"
        raise ValueError(f"{name} must be {dims}{sizes}, got {list(got)}")
    if device is None:
        if t.device.type != "cuda" and not INTERPRET:
            raise ValueError(
                f"{name} must be on a CUDA device (TRITON_INTERPRET=1 runs the kernels on the "
                f"CPU), got {t.device}"
            )
    elif t.device != device:
        raise ValueError(f"{name} must be on {device} ({like}'s device), got {t.device}")
    return t


def check_dense(name: str, t: torch.Tensor, from_dim: int, where: str) -> None:
    """Dims ``from_dim:`` of ``t`` have the strides of a contiguous tensor (the kernel indexes
    them with assumed strides; it is given the strides of the dims before). Size-1 dims may have
    any stride (never stepped over); an empty tensor is never read."""
    if t.is_contiguous():  # a cached flag: the common case costs nothing more
        return
    sizes, strides = t.shape, t.stride()
    expect = 1
    bad = False
    for d in range(len(sizes) - 1, from_dim - 1, -1):
        size = sizes[d]
        if size != 1 and strides[d] != expect:
            bad = True
        expect *= size
    if bad and expect != 0:
        want = [1] * t.dim()
        for d in range(t.dim() - 2, -1, -1):
            want[d] = want[d + 1] * t.shape[d + 1]
        text = ", ".join("*" if d < from_dim else str(want[d]) for d in range(t.dim()))
        stride = "stride" if t.dim() == 1 else "strides"
        raise ValueError(f"{name} must be {where} ({stride} ({text})), got {stride} {t.stride()}")


def check_index(
    name: str,
    t: object,
    dims: str,
    length: int | None,
    dtype: torch.dtype,
    device: torch.device,
    like: str,
) -> torch.Tensor:
    """A 1-D index tensor the kernel reads as ``ptr + i``: ``[length]`` of ``dtype``, on
    ``device``, contiguous."""
    t = check_tensor(name, t, dims, (length,), (dtype,), device, like)
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride 1), got stride {t.stride()}")
    return t


def check_head_dim(head_dim: int) -> None:
    """Refuse a head dim the attention kernels cannot tile (see the module docstring)."""
    if not MIN_D_PAD <= next_pow2(head_dim) <= MAX_D_PAD:
        lo, hi = SUPPORTED_HEAD_DIMS[0], SUPPORTED_HEAD_DIMS[-1]
        raise ValueError(
            f"head_dim must be in {lo}..{hi} (tiles pad it to a power of two in "
            f"{MIN_D_PAD}..{MAX_D_PAD}), got {head_dim}"
        )


def check_cache_pair(
    k_cache: object,
    v_cache: object,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    like: str = "",
) -> tuple[int, int, int]:
    """Per-layer cache views; returns (block_size, kv_heads, head_dim).

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] of one dtype among ``dtypes``,
    the inner three dims contiguous (the pool's layout), any block stride (it spans every layer
    of the block-major pool), both with the same strides (the kernels index V with K's strides).
    """
    dims = "[num_blocks, block_size, kv_heads, head_dim]"
    k = check_tensor("k_cache", k_cache, dims, (None,) * 4, dtypes, device, like, like)
    v = check_tensor(
        "v_cache", v_cache, dims, tuple(k.shape), (k.dtype,), k.device, "k_cache", "k_cache"
    )
    check_dense("k_cache", k, 1, "contiguous within a block")
    if v.stride() != k.stride():
        raise ValueError(f"v_cache must have k_cache's strides {k.stride()}, got {v.stride()}")
    _, block_size, kv_heads, head_dim = k.shape
    if block_size not in BLOCK_SIZES:
        raise ValueError(
            f"k_cache block_size must be a power of two in {BLOCK_SIZES[0]}..{BLOCK_SIZES[-1]}, "
            f"got {block_size}"
        )
    if kv_heads < 1:
        raise ValueError(f"k_cache must have at least one kv head, got shape {list(k.shape)}")
    return block_size, kv_heads, head_dim


def check_scale(scale: object) -> None:
    """The softmax scale is a host number (a tensor would be passed as a pointer)."""
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def check_optional_int(name: str, value: object, minimum: int) -> None:
    """A host int option: None or an int >= ``minimum``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be None or an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be None or >= {minimum}, got {value}")


def check_block_tables(
    block_tables: object, batch: int | None, device: torch.device
) -> torch.Tensor:
    """[B, max_blocks] int32; rows contiguous (the kernels take the row stride)."""
    dims = "[B, max_blocks]"
    bt = check_tensor(
        "block_tables", block_tables, dims, (batch, None), (torch.int32,), device, "query"
    )
    check_dense("block_tables", bt, 1, "contiguous along each row")
    return bt


def check_out(out: object, query: torch.Tensor) -> torch.Tensor:
    """An attention output given by the caller: the query's shape, dtype and device, last dim
    contiguous (the kernels take the row and head strides)."""
    dims = "[rows, q_heads, head_dim] (the query's shape)"
    t = check_tensor("out", out, dims, tuple(query.shape), (query.dtype,), query.device, "query")
    check_dense("out", t, 2, "contiguous along head_dim")
    return t


def check_attention_args(
    query: object, k_cache: object, v_cache: object, scale: object
) -> tuple[torch.Tensor, AttentionShape]:
    """Checks common to decode and prefill; returns (query, (block_size, q_heads, kv_heads,
    head_dim)).

    query: [rows, q_heads, head_dim] fp16/bf16, last dim contiguous (row and head strides are
    passed); caches as in ``check_cache_pair`` with the query's dtype and device, a head dim in
    ``SUPPORTED_HEAD_DIMS``; scale: a finite number. The block tables and lengths are checked
    by each launcher (``check_block_tables``, ``check_index``).
    """
    dims = "[rows, q_heads, head_dim]"
    q = check_tensor("query", query, dims, (None, None, None), ATTN_DTYPES)
    check_dense("query", q, 2, "contiguous along head_dim")
    block_size, kv_heads, head_dim = check_cache_pair(
        k_cache, v_cache, (q.dtype,), q.device, "query"
    )
    if q.shape[2] != head_dim:
        raise ValueError(f"query must be {dims} = [*, *, {head_dim}], got {list(q.shape)}")
    check_head_dim(head_dim)
    q_heads = q.shape[1]
    if q_heads < 1 or q_heads % kv_heads:
        raise ValueError(
            f"query heads must be a positive multiple of k_cache's {kv_heads} kv heads, "
            f"got {q_heads}"
        )
    check_scale(scale)
    return q, (block_size, q_heads, kv_heads, head_dim)
