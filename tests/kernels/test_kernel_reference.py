"""The references themselves, against a naive token-by-token implementation in fp64."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

import kernels
import kernels.reference
from kernels.reference import paged_decode_reference, paged_prefill_reference
from tests.kernels.kernel_cases import make_case, randn, rel_err

REPO = Path(__file__).resolve().parents[2]


def naive_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query row over its visible keys, fp64. q: [Hq, D]; keys, values: [n, Hkv, D]."""
    group = q.shape[0] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        k = keys[:, h // group].double()
        w = torch.softmax((k @ q[h].double()) * scale, dim=0)
        out[h] = w @ values[:, h // group].double()
    return out


def naive_keys(case_cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    bs = case_cache.shape[1]
    return torch.stack([case_cache[int(table[p // bs]), p % bs] for p in range(n)])


def test_reference_prefill_matches_naive() -> None:
    reqs = [(1, 20), (6, 6), (4, 37)]  # (q_len, context)
    case = make_case([c for _, c in reqs], 2, 16, 8, torch.float32, torch.device("cpu"))
    cu = torch.tensor([0, 1, 7, 11], dtype=torch.int32)
    q = randn((11, 4, 16), torch.float32, torch.device("cpu"), 0)
    snapshot = (q.clone(), case.pool.clone())
    out = paged_prefill_reference(
        q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.3
    )
    assert torch.equal(q, snapshot[0]), "the reference mutated the query"
    assert torch.equal(case.pool.nan_to_num(7.0), snapshot[1].nan_to_num(7.0)), "mutated the pool"
    for b, (q_len, ctx) in enumerate(reqs):
        keys = naive_keys(case.k_cache, case.block_tables[b], ctx)
        vals = naive_keys(case.v_cache, case.block_tables[b], ctx)
        for i in range(q_len):
            row = int(cu[b]) + i
            visible = ctx - q_len + i + 1
            want = naive_attention(q[row], keys[:visible], vals[:visible], 0.3)
            assert rel_err(out[row], want) < 1e-5


def test_reference_decode_is_prefill_of_one() -> None:
    lens = [1, 9, 30]
    case = make_case(lens, 1, 16, 8, torch.float32, torch.device("cpu"))
    q = randn((3, 3, 16), torch.float32, torch.device("cpu"), 1)
    dec = paged_decode_reference(
        q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25
    )
    cu = torch.arange(4, dtype=torch.int32)
    pre = paged_prefill_reference(
        q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, 0.25
    )
    assert torch.allclose(dec, pre, atol=1e-6)
    for b, ctx in enumerate(lens):
        keys = naive_keys(case.k_cache, case.block_tables[b], ctx)
        vals = naive_keys(case.v_cache, case.block_tables[b], ctx)
        assert rel_err(dec[b], naive_attention(q[b], keys, vals, 0.25)) < 1e-5


def test_reference_import_does_not_import_triton() -> None:
    code = "import sys, kernels.reference; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_one_reference_per_launcher() -> None:
    """Each Triton launcher (its kernels) has exactly one oracle, in kernels/reference.py."""
    # a heuristic; launches paged_decode; list paged_prefill's work
    helpers = {"choose_num_splits", "compile_variants", "prefill_tile_tokens", "prefill_tiles"}
    launchers = {name for name in kernels.__all__ if name not in helpers}
    oracles = {name for name in kernels.reference.__all__ if name != "gather_kv"}
    assert oracles == {f"{name}_reference" for name in launchers}
