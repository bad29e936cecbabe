"""rms_norm and rotary against their references (CPU interpreter and GPU), and their checks."""

from __future__ import annotations

import pytest
import torch

from kernels import rms_norm, rotary, silu_mul
from kernels.reference import rms_norm_reference, rotary_reference, silu_mul_reference
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


def check_rotary(
    tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device
) -> None:
    q = randn((tokens, q_heads, head_dim), dtype, device, 3)
    k = randn((tokens, kv_heads, head_dim), dtype, device, 4)
    cos, sin = cos_sin(tokens, head_dim, dtype, device)
    q_got, k_got = rotary(q, k, cos, sin)
    q_want, k_want = rotary_reference(q, k, cos, sin)
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
    got_q, got_k = rotary(q, k, cos, sin)
    assert_within_rounding(got_q, want_q[0].transpose(0, 1), steps=2, floor=1.0)
    assert_within_rounding(got_k, want_k[0].transpose(0, 1), steps=2, floor=1.0)


def test_rotary_reads_slices_of_a_fused_projection(device) -> None:
    qkv = randn((5, (4 + 2 + 2) * 16), F32, device, 7)
    q, k = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    cos, sin = cos_sin(5, 16, F32, device)
    got = rotary(q, k, cos, sin)
    want = rotary_reference(q.contiguous(), k.contiguous(), cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.is_contiguous()
        assert_within_rounding(g, w)


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
    q, k = rotary(*(randn(s, F32, device, 3) for s in ((0, 2, 8), (0, 1, 8), (0, 8), (0, 8))))
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)


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
    with pytest.raises(ValueError, match="k must be"):
        rotary(q, k[:2], cos, sin)
    with pytest.raises(TypeError, match="cos must be"):
        rotary(q, k, cos.float(), sin)
    with pytest.raises(ValueError, match="q must be contiguous"):
        rotary(q.transpose(0, 1).contiguous().transpose(0, 1), k, cos, sin)
    with pytest.raises(ValueError, match="even"):
        odd = (t[..., :15].contiguous() for t in (q, k, cos, sin))
        rotary(*odd)
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
