"""rms_norm, rotary_store and silu_mul against their references (CPU interpreter and GPU), and
their checks."""

from __future__ import annotations

import pytest
import torch

from kernels import rms_norm, rotary_store, silu_mul
from kernels.reference import (
    rms_norm_reference,
    rotary_store_reference,
    silu_mul_reference,
)
from tests.kernels.kernel_cases import randn

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# The CPU cases use fp32 and fp16: Triton's interpreter does not round to bf16 as the GPU does.


def assert_within_rounding(
    got: torch.Tensor, want: torch.Tensor, steps: float = 1, floor: float = 1e-3
) -> None:
    """Every element within ``steps`` rounding steps of the dtype (fp32: float error only),
    relative to the element or, near zero, to ``floor`` times the tensor's largest."""
    assert got.shape == want.shape and got.dtype == want.dtype
    eps = torch.finfo(got.dtype).eps if got.dtype != F32 else 1e-6
    scale = want.float().abs().clamp_min(floor * want.float().abs().max())
    err = (got.float() - want.float()).abs()
    assert (err <= steps * eps * scale).all(), f"max error {float((err / scale).max())}"


def cos_sin(tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """Rows as transformers' rotary modules build them: angles of both halves equal."""
    positions = torch.arange(tokens, dtype=torch.float32)[:, None] * 7 % 1000
    freqs = positions / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def check_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    x = randn(shape, dtype, device, 1) * 3
    weight = randn(shape[-1:], dtype, device, 2)
    before = x.clone()
    got = rms_norm(x, weight, 1e-5)
    want = rms_norm_reference(x, weight, 1e-5)
    assert torch.equal(x, before), "rms_norm wrote its input"
    assert_within_rounding(got, want)  # the reduction's order differs


def pool_for(tokens: int, kv_heads: int, head_dim: int, dtype, device) -> torch.Tensor:
    """A block-major pool [blocks, 2 layers, K/V, 16, kv_heads, D] of random values with room
    for ``tokens`` slots and a spare block."""
    blocks = -(-tokens // 16) + 1
    return randn((blocks, 2, 2, 16, kv_heads, head_dim), dtype, device, 11)


def scattered_slots(tokens: int, pool: torch.Tensor) -> torch.Tensor:
    """Distinct slots in random order over the pool; tokens 1, 4, 7, ... padding (-1)."""
    slots = torch.randperm(pool.shape[0] * 16, generator=torch.Generator().manual_seed(12))
    slots = slots[:tokens].clone()
    slots[1::3] = -1
    return slots.to(pool.device)


def run_rotary_store(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rotary_store`` into layer 1 of a random pool; checks that it wrote nothing but the
    slots' K/V (layer 0 and every other slot unchanged, v copied exactly). Returns (rotated q,
    the rotated k as stored in the written slots, the reference's, the reference's q)."""
    pool = pool_for(q.shape[0], k.shape[1], k.shape[2], k.dtype, k.device)
    slots = scattered_slots(q.shape[0], pool)
    before = pool.clone()
    q_got = rotary_store(q, k, v, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots)
    q_want, k_cache, v_cache = rotary_store_reference(
        q, k, v, cos, sin, before[:, 1, 0], before[:, 1, 1], slots
    )
    assert torch.equal(pool[:, 0], before[:, 0]), "rotary_store wrote another layer"
    assert torch.equal(pool[:, 1, 1], v_cache), "v is copied to its slots, nothing else"
    written = slots >= 0
    blocks, offs = slots[written] // 16, slots[written] % 16
    unwritten = torch.ones(pool.shape[0], 16, dtype=torch.bool, device=pool.device)
    unwritten[blocks, offs] = False
    assert torch.equal(pool[:, 1, 0][unwritten], before[:, 1, 0][unwritten])
    assert q_got.is_contiguous() and q_got.shape == q.shape
    return q_got, pool[:, 1, 0][blocks, offs], k_cache[blocks, offs], q_want


def check_rotary(
    tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> None:
    q = randn((tokens, q_heads, head_dim), dtype, device, 3)
    k = randn((tokens, kv_heads, head_dim), dtype, device, 4)
    v = randn((tokens, kv_heads, head_dim), dtype, device, 9)
    cos, sin = cos_sin(tokens, head_dim, dtype, device)
    q_got, k_got, k_want, q_want = run_rotary_store(q, k, v, cos, sin)
    assert_within_rounding(q_got, q_want)  # a fused multiply-add may round once less
    assert_within_rounding(k_got, k_want)


@pytest.mark.parametrize(
    ("shape", "dtype"), [((5, 64), F32), ((3, 4, 16), F32), ((7, 48), F16), ((2, 100), F16)]
)
def test_rms_norm_matches_reference(shape, dtype, device) -> None:
    check_rms_norm(shape, dtype, device)


@pytest.mark.parametrize(
    ("tokens", "q_heads", "kv_heads", "head_dim", "dtype"),
    [(5, 4, 2, 16, F32), (3, 3, 1, 12, F32), (4, 4, 2, 16, F16), (1, 2, 2, 8, F16)],
)
def test_rotary_matches_reference(tokens, q_heads, kv_heads, head_dim, dtype, device) -> None:
    check_rotary(tokens, q_heads, kv_heads, head_dim, dtype, device)


def test_rotary_is_transformers_apply_rotary_pos_emb(device) -> None:
    """The same function as transformers' own, up to its extra roundings (one per op: where
    the two products nearly cancel, they are large against the result)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    dtype = BF16 if device.type == "cuda" else F16
    q = randn((6, 4, 16), dtype, device, 5)
    k = randn((6, 2, 16), dtype, device, 6)
    cos, sin = cos_sin(6, 16, dtype, device)
    want_q, want_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    pool = pool_for(6, 2, 16, dtype, device)
    slots = torch.arange(6, device=device)
    got_q = rotary_store(q, k, k, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots)
    assert_within_rounding(got_q, want_q[0].transpose(0, 1), steps=2, floor=1.0)
    assert_within_rounding(pool[0, 1, 0, :6], want_k[0].transpose(0, 1), steps=2, floor=1.0)


def test_rotary_store_reads_slices_of_a_fused_projection(device) -> None:
    qkv = randn((5, (4 + 2 + 2) * 16), F32, device, 7)
    q, k, v = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)
    cos, sin = cos_sin(5, 16, F32, device)
    q_got, k_got, k_want, q_want = run_rotary_store(q, k, v, cos, sin)
    assert_within_rounding(q_got, q_want)
    assert_within_rounding(k_got, k_want)


def check_silu_mul(tokens: int, n: int, dtype: torch.dtype, device: torch.device) -> None:
    gate_up = randn((tokens, 2 * n + 6), dtype, device, 8)[:, : 2 * n] * 4  # a row stride
    got = silu_mul(gate_up)
    want = silu_mul_reference(gate_up)
    assert got.is_contiguous()
    assert_within_rounding(got, want, steps=2)  # exp's implementation differs


@pytest.mark.parametrize(("tokens", "n", "dtype"), [(3, 40, F32), (2, 1500, F32), (4, 64, F16)])
def test_silu_mul_matches_reference(tokens, n, dtype, device) -> None:
    check_silu_mul(tokens, n, dtype, device)


def test_empty_inputs_launch_nothing(device) -> None:
    x = randn((0, 32), F32, device, 1)
    assert rms_norm(x, randn((32,), F32, device, 2), 1e-6).shape == (0, 32)
    q, k, v, cos, sin = (randn(s, F32, device, 3) for s in ((0, 2, 8), (0, 1, 8), (0, 1, 8),
                                                             (0, 8), (0, 8)))  # fmt: skip
    pool = pool_for(0, 1, 8, F32, device)
    before = pool.clone()
    slots = torch.zeros(0, dtype=torch.int64, device=device)
    assert rotary_store(q, k, v, cos, sin, pool[:, 1, 0], pool[:, 1, 1], slots).shape == (0, 2, 8)
    assert torch.equal(pool, before)


def test_launchers_refuse_bad_arguments(device) -> None:
    x = randn((4, 32), BF16, device, 1)
    weight = randn((32,), BF16, device, 2)
    with pytest.raises(TypeError, match="weight must be"):
        rms_norm(x, weight.float(), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, weight[:16], 1e-6)
    with pytest.raises(ValueError, match="x must be contiguous"):
        rms_norm(randn((32, 4), BF16, device, 3).t(), weight, 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, weight, 0.0)
    q, k = randn((3, 4, 16), BF16, device, 4), randn((3, 2, 16), BF16, device, 5)
    cos, sin = cos_sin(3, 16, BF16, device)
    pool = pool_for(3, 2, 16, BF16, device)
    caches = (pool[:, 1, 0], pool[:, 1, 1])
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="k must be"):
        rotary_store(q, k[:2], k, cos, sin, *caches, slots)
    with pytest.raises(ValueError, match="v must be contiguous within a token"):
        rotary_store(q, k, k.transpose(1, 2).contiguous().transpose(1, 2), cos, sin, *caches, slots)
    with pytest.raises(TypeError, match="cos must be"):
        rotary_store(q, k, k, cos.float(), sin, *caches, slots)
    with pytest.raises(ValueError, match="q must be contiguous"):
        rotary_store(q.transpose(0, 1).contiguous().transpose(0, 1), k, k, cos, sin, *caches, slots)
    with pytest.raises(TypeError, match="k_cache must be"):
        rotary_store(q, k, k, cos, sin, pool[:, 1, 0].float(), pool[:, 1, 1].float(), slots)
    with pytest.raises(ValueError, match="head dim must be q's"):
        narrow = pool_for(3, 2, 8, BF16, device)
        rotary_store(q, k, k, cos, sin, narrow[:, 1, 0], narrow[:, 1, 1], slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        rotary_store(q, k, k, cos, sin, *caches, slots[:2])
    with pytest.raises(TypeError, match="slot_mapping must be"):
        rotary_store(q, k, k, cos, sin, *caches, slots.int())
    with pytest.raises(ValueError, match="even"):
        odd = (t[..., :15].contiguous() for t in (q, k, k, cos, sin))
        pool = pool_for(3, 2, 15, BF16, device)
        rotary_store(*odd, pool[:, 1, 0], pool[:, 1, 1], slots)
    with pytest.raises(ValueError, match="even"):
        silu_mul(randn((2, 7), BF16, device, 6))
    with pytest.raises(ValueError, match="gate_up must be contiguous within a row"):
        silu_mul(randn((8, 2), BF16, device, 6).t())


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [64, 2048, 4096, 5120])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_rms_norm_on_the_gpu(hidden, dtype, cuda) -> None:
    check_rms_norm((300, hidden), dtype, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"), [(32, 8, 64), (32, 8, 128), (5, 1, 80)]
)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_rotary_on_the_gpu(q_heads, kv_heads, head_dim, dtype, cuda) -> None:
    check_rotary(257, q_heads, kv_heads, head_dim, dtype, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8192, 14336, 100])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_silu_mul_on_the_gpu(n, dtype, cuda) -> None:
    check_silu_mul(129, n, dtype, cuda)
