"""The launchers' argument checks (``kernels._checks``): every bad tensor argument of every
launcher is refused, by name, before anything is written; supported head dims; honoured strides.

The refusal cases never launch a kernel, so they are cheap under TRITON_INTERPRET=1. Every
case runs on the ``device`` fixture (CUDA when present, as the other CPU-marked kernel tests).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kernels._checks
from kernels import copy_blocks, paged_decode, paged_prefill, store_kv
from kernels._checks import (
    BLOCK_SIZES,
    MAX_D_PAD,
    MIN_D_PAD,
    SUPPORTED_HEAD_DIMS,
    check_attention_args,
    next_pow2,
)
from kernels.reference import (
    copy_blocks_reference,
    paged_decode_reference,
    paged_prefill_reference,
    store_kv_reference,
)
from tests.kernels.kernel_cases import make_case, randn

F16, BF16, I32, I64 = torch.float16, torch.bfloat16, torch.int32, torch.int64
KERNELS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"

Args = dict[str, Any]


def valid_args(launcher: str, device: torch.device) -> Args:
    """A small valid call (fp16, head_dim 16, block_size 8) of ``launcher``, by keyword.

    pool: [6 blocks, 2 layers, K/V, 8 slots, 2 kv heads, 16]; requests of 5 and 9 tokens in
    blocks [0, 1] and [2, 3] (4 and 5 are no request's); 4 query heads.
    """

    def ints(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    pool = randn((6, 2, 2, 8, 2, 16), F16, device, 0)
    caches: Args = {"k_cache": pool[:, 1, 0], "v_cache": pool[:, 1, 1]}
    tables, lens = ints([[0, 1], [2, 3]], I32), ints([5, 9], I32)
    if launcher == "store_kv":
        key, value = randn((3, 2, 16), F16, device, 1), randn((3, 2, 16), F16, device, 2)
        return {"key": key, "value": value, **caches, "slot_mapping": ints([3, 17, 40], I64)}
    if launcher == "copy_blocks":
        return {"pool": pool, "src": ints([1, 4], I64), "dst": ints([0, 2], I64)}
    if launcher == "paged_decode":
        q = randn((2, 4, 16), F16, device, 3)
        return {"query": q, **caches, "block_tables": tables, "context_lens": lens, "scale": 0.25}
    assert launcher == "paged_prefill"
    q = randn((3, 4, 16), F16, device, 4)
    lengths = {"cu_seqlens_q": ints([0, 1, 3], I32), "context_lens": lens}
    return {"query": q, **caches, "block_tables": tables, **lengths, "scale": 0.25}


LAUNCHERS: dict[str, Callable[..., object]] = {
    "store_kv": store_kv,
    "copy_blocks": copy_blocks,
    "paged_decode": paged_decode,
    "paged_prefill": paged_prefill,
}
FIRST = {"store_kv": "k_cache", "copy_blocks": "pool"}  # the device the others must share
ATTN_DTYPE = {"query": torch.float32, "k_cache": BF16, "v_cache": BF16}
INDEX_DTYPE = {"block_tables": I64, "cu_seqlens_q": I64, "context_lens": I64}
WRONG_DTYPE: dict[str, dict[str, torch.dtype]] = {  # k/v_cache: fp32 is a cache dtype, not key's
    "store_kv": {"key": I32, "value": BF16, "k_cache": torch.float64, "v_cache": torch.float32},
    "copy_blocks": {"pool": torch.int16, "src": I32, "dst": I32},
    "paged_decode": {**ATTN_DTYPE, **INDEX_DTYPE},
    "paged_prefill": {**ATTN_DTYPE, **INDEX_DTYPE},
}
WRONG_DTYPE["store_kv"]["slot_mapping"] = I32
WRONG_SHAPE: dict[
    str, Callable[[torch.Tensor], torch.Tensor]
] = {  # by argument name; the same for every launcher
    "key": lambda t: t[:, :1],  # one kv head of the cache's two
    "value": lambda t: t[:-1],  # one row short of key's
    "query": lambda t: t[:, :, :8],  # head_dim 8 over a cache of 16
    "k_cache": lambda t: t[0],  # 3-d
    "v_cache": lambda t: t[:-1],  # one block short of k_cache's
    "pool": lambda t: t[0],  # 5-d
    "block_tables": lambda t: t[0],  # 1-d
    "src": lambda t: t[None],  # 2-d
    "dst": lambda t: t[:-1],  # shorter than src
    "slot_mapping": lambda t: t[:-1],
    "cu_seqlens_q": lambda t: t[:-1],
    "context_lens": lambda t: t[:-1],
}


def spread(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last dim's stride doubled (``x[..., ::2]`` of a buffer whose
    other half is poison: -1 for ints, NaN for floats), so a kernel that assumed stride 1 would
    read or write the wrong elements."""
    buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), -1, dtype=t.dtype, device=t.device)
    if t.is_floating_point():
        buf.fill_(float("nan"))
    buf[..., ::2] = t
    return buf[..., ::2]


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values in column-major order (``.t()`` of a contiguous transpose)."""
    dims = list(range(t.dim()))[::-1]
    return t.permute(dims).contiguous().permute(dims)


# kind -> (the error, (launcher, argument, valid tensor) -> the bad argument)
MUTATIONS: dict[str, tuple[type[Exception], Callable[[str, str, torch.Tensor], object]]] = {
    "spread": (ValueError, lambda launcher, arg, t: spread(t)),
    "column_major": (ValueError, lambda launcher, arg, t: column_major(t)),
    "shape": (ValueError, lambda launcher, arg, t: WRONG_SHAPE[arg](t)),
    "dtype": (TypeError, lambda launcher, arg, t: t.to(WRONG_DTYPE[launcher][arg])),
    "meta_device": (ValueError, lambda launcher, arg, t: t.to("meta")),
    "list": (TypeError, lambda launcher, arg, t: t.tolist()),
}


def cases() -> list[tuple[str, str, str]]:
    """(launcher, argument, mutation) for every tensor argument of every launcher."""
    out = []
    for launcher in LAUNCHERS:
        for arg, value in valid_args(launcher, torch.device("cpu")).items():
            if not isinstance(value, torch.Tensor):
                continue
            for kind in MUTATIONS:
                if kind == "column_major" and value.dim() < 2:
                    continue  # a 1-d tensor has one layout; "spread" covers its stride
                if kind == "meta_device" and FIRST.get(launcher, "query") == arg:
                    continue  # the device every other argument is compared with
                out.append((launcher, arg, kind))
    return out


def tensors_of(args: Args) -> list[torch.Tensor]:
    return [a for a in args.values() if isinstance(a, torch.Tensor) and a.device.type != "meta"]


@pytest.mark.parametrize(("launcher", "arg", "kind"), cases())
def test_bad_argument_refused_by_name_before_any_write(
    device: torch.device, launcher: str, arg: str, kind: str
) -> None:
    args = valid_args(launcher, device)
    good = args[arg]
    assert isinstance(good, torch.Tensor)
    error, mutate = MUTATIONS[kind]
    bad = mutate(launcher, arg, good)
    if kind in ("spread", "column_major"):
        assert isinstance(bad, torch.Tensor) and torch.equal(bad, good), "same values"
        assert bad.shape == good.shape and bad.stride() != good.stride()
    args[arg] = bad
    before = [t.clone() for t in tensors_of(args)]
    with pytest.raises(error, match=f"^{arg} ") as info:
        LAUNCHERS[launcher](**args)
    if kind in ("spread", "column_major"):
        assert re.search(r"contiguous|strides", str(info.value)), info.value
    after = tensors_of(args)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_cases_cover_every_tensor_argument() -> None:
    """Each launcher's every tensor argument meets every mutation that applies to it."""
    got = cases()
    assert len(got) == len(set(got))
    for launcher in LAUNCHERS:
        for arg, value in valid_args(launcher, torch.device("cpu")).items():
            if isinstance(value, torch.Tensor):
                kinds = {k for la, a, k in got if (la, a) == (launcher, arg)}
                assert {"spread", "shape", "dtype", "list"} <= kinds, (launcher, arg)


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_valid_args_run_and_match_the_reference(device: torch.device, launcher: str) -> None:
    """The baseline of the refusal cases is a valid call (so each refusal is its argument's)."""
    args = valid_args(launcher, device)
    if launcher == "store_kv":
        k_ref, v_ref = store_kv_reference(**args)
        store_kv(**args)
        assert torch.equal(args["k_cache"], k_ref) and torch.equal(args["v_cache"], v_ref)
    elif launcher == "copy_blocks":
        ref = copy_blocks_reference(**args)
        copy_blocks(**args)
        assert torch.equal(args["pool"], ref)
    else:
        decode = launcher == "paged_decode"
        out = (paged_decode if decode else paged_prefill)(**args)
        fp32 = {k: v.float() for k, v in args.items() if k in ("query", "k_cache", "v_cache")}
        oracle = paged_decode_reference if decode else paged_prefill_reference
        ref = oracle(**{**args, **fp32})
        assert torch.allclose(out.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(
    ("launcher", "arg", "value", "error"),
    [
        ("paged_decode", "scale", torch.tensor(0.25), TypeError),  # would be passed as a pointer
        ("paged_decode", "scale", float("nan"), ValueError),
        ("paged_decode", "num_splits", 0, ValueError),
        ("paged_decode", "num_splits", 2.0, TypeError),
        ("paged_prefill", "scale", "0.25", TypeError),
        ("paged_prefill", "max_query_len", -1, ValueError),
    ],
)
def test_bad_host_argument_refused(
    device: torch.device, launcher: str, arg: str, value: object, error: type[Exception]
) -> None:
    args = {**valid_args(launcher, device), arg: value}
    with pytest.raises(error, match=f"^{arg} "):
        LAUNCHERS[launcher](**args)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRITON_INTERPRET=1 the kernels run on CUDA only: the first tensor says so."""
    monkeypatch.setattr(kernels._checks, "INTERPRET", False)
    for launcher, run in LAUNCHERS.items():
        first = FIRST.get(launcher, "query")
        with pytest.raises(ValueError, match=f"^{first} must be on a CUDA device"):
            run(**valid_args(launcher, torch.device("cpu")))


# ---------------------------------------------------------------- supported head dims


def test_supported_head_dims_are_those_the_tiles_pad_to() -> None:
    """D_PAD = next_pow2(head_dim) must be >= 16 (tl.dot) and <= 256 (the largest tile)."""
    assert (MIN_D_PAD, MAX_D_PAD) == (16, 256)
    supported = SUPPORTED_HEAD_DIMS
    assert (supported.start, supported.stop, supported.step) == (9, 257, 1)
    assert [d for d in range(1, 1025) if 16 <= next_pow2(d) <= 256] == list(SUPPORTED_HEAD_DIMS)


def test_head_dim_check_accepts_exactly_the_supported_range(device: torch.device) -> None:
    """The launchers' own check path (no kernel launch) on every head dim 1..320."""
    for head_dim in range(1, 321):
        query = torch.zeros((1, 2, head_dim), dtype=F16, device=device)
        cache = torch.zeros((1, 8, 1, head_dim), dtype=F16, device=device)
        if head_dim in SUPPORTED_HEAD_DIMS:
            _, shape = check_attention_args(query, cache, cache, 1.0)
            assert shape == (8, 2, 1, head_dim)
        else:
            with pytest.raises(ValueError, match=r"^head_dim must be in 9\.\.256 "):
                check_attention_args(query, cache, cache, 1.0)


@pytest.mark.parametrize("head_dim", [8, 257, 512])
def test_launchers_refuse_an_unsupported_head_dim(device: torch.device, head_dim: int) -> None:
    case = make_case([5], 1, head_dim, 8, F16, device)
    q = torch.zeros((1, 2, head_dim), dtype=F16, device=device)
    cu = torch.tensor([0, 1], dtype=I32, device=device)
    common = (case.k_cache, case.v_cache, case.block_tables)
    with pytest.raises(ValueError, match=r"^head_dim "):
        paged_decode(q, *common, case.context_lens, 1.0)
    with pytest.raises(ValueError, match=r"^head_dim "):
        paged_prefill(q, *common, cu, case.context_lens, 1.0)


def test_the_kernels_page_states_what_the_checks_enforce() -> None:
    section = KERNELS_PAGE.read_text().split("\n## What they take\n", 1)[1].split("\n## ", 1)[0]
    section = " ".join(section.split())
    lo, hi = SUPPORTED_HEAD_DIMS[0], SUPPORTED_HEAD_DIMS[-1]
    assert f"head dims {lo}-{hi}" in section
    assert f"power of two, {MIN_D_PAD}-{MAX_D_PAD}" in section
    assert f"power-of-two block sizes {BLOCK_SIZES[0]}-{BLOCK_SIZES[-1]}" in section
    assert "fp16 / bf16" in section and "fp32" in section


# ---------------------------------------------------------------- strides the kernels take


def test_strides_the_kernels_take_are_honoured(device: torch.device) -> None:
    """Row and head strides of query, key and value, the row stride of block_tables and the
    cache's block stride (spanning layers) are passed to the kernels: strided views of the same
    values give bit-identical results to contiguous copies."""
    args = valid_args("paged_decode", device)
    fused = randn((2, 3 * 4, 16), F16, device, 9)  # [B, q|k|v heads, D], as a fused projection
    wide = torch.full((2, 5), 5, dtype=I32, device=device)  # 5: a block no request owns
    wide[:, :2] = args["block_tables"]
    strided = {**args, "query": fused[:, 4:8], "block_tables": wide[:, :2]}
    dense = {**args, "query": fused[:, 4:8].contiguous()}
    for splits in (1, 2):
        got = paged_decode(**strided, num_splits=splits)
        assert torch.equal(got, paged_decode(**dense, num_splits=splits))

    args = valid_args("paged_prefill", device)
    fused = randn((3, 3 * 4, 16), F16, device, 10)
    strided = {**args, "query": fused[:, :4], "block_tables": wide[:, :2]}
    dense = {**args, "query": fused[:, :4].contiguous()}
    assert torch.equal(paged_prefill(**strided), paged_prefill(**dense))

    args = valid_args("store_kv", device)
    fused = randn((3, 3 * 2, 16), F16, device, 11)
    k_want, v_want = store_kv_reference(
        fused[:, 2:4], fused[:, 4:], args["k_cache"], args["v_cache"], args["slot_mapping"]
    )
    store_kv(fused[:, 2:4], fused[:, 4:], args["k_cache"], args["v_cache"], args["slot_mapping"])
    assert torch.equal(args["k_cache"], k_want) and torch.equal(args["v_cache"], v_want)
