"""Builders of paged-attention test cases: a NaN-poisoned pool, random block tables, checks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ‖out − ref‖/‖ref‖ bounds against an fp32 reference: output rounding plus P cast to 16 bits
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.5e-2}

# The H200 grid of issue 3, shared by the decode and prefill GPU tests.
GRID_HEAD_DIMS = [64, 80, 96, 128, 256]
GRID_HEADS = [(32, 32), (32, 8), (8, 2), (5, 1)]  # (query heads, kv heads)
# The GPU edge tests, beside the grid: the low end of kernels._checks.SUPPORTED_HEAD_DIMS (9 and
# 16, both padded to the smallest tile, 16), 40 (padded to 64) and 200 (to 256).
EDGE_HEAD_DIMS = [9, 16, 40, 200]


def grid_dtype(head_dim: int, q_heads: int, block_size: int) -> torch.dtype:
    """Alternates bf16 and fp16 across the grid so both dtypes meet every axis."""
    return torch.bfloat16 if (head_dim + q_heads + block_size) % 2 == 0 else torch.float16


@dataclass
class PagedCase:
    """One batch over a block-major pool; slots no request owns hold NaN."""

    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    layer: int
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    owned: torch.Tensor  # [num_blocks, block_size] bool: slot holds a live token of the layer

    @property
    def k_cache(self) -> torch.Tensor:  # [num_blocks, block_size, kv_heads, head_dim]
        return self.pool[:, self.layer, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.pool[:, self.layer, 1]

    def repoison(self, value: float) -> PagedCase:
        """A copy of the case whose unowned slots (every layer) hold ``value`` instead of NaN."""
        pool = self.pool.clone()
        dead = ~self.owned  # [num_blocks, block_size]
        for layer in range(pool.shape[1]):
            sel = pool[:, layer]  # [num_blocks, 2, block_size, H, D]
            sel.permute(0, 2, 1, 3, 4)[dead] = value
            if layer != self.layer:
                pool[:, layer].fill_(value)
        return PagedCase(pool, self.layer, self.block_tables, self.context_lens, self.owned)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN anywhere gives NaN (which fails every ``<`` check)."""
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


def make_case(
    context_lens: list[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_blocks: int | None = None,
    num_layers: int = 2,
    extra_table_cols: int = 2,
    high_blocks: bool = False,
    seed: int = 0,
) -> PagedCase:
    """Random block tables over a NaN pool; only each request's live slots of one layer get randn.

    Table entries past a request's blocks point at other (NaN) blocks. ``high_blocks`` draws the
    requests' blocks from the top of the pool (to exercise int64 offsets).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / block_size) for c in context_lens]
    total = sum(need)
    if num_blocks is None:
        num_blocks = total + 8
    assert num_blocks >= total + 1
    max_blocks = max([*need, 1]) + extra_table_cols
    pool = torch.full(
        (num_blocks, num_layers, 2, block_size, kv_heads, head_dim),
        float("nan"),
        dtype=dtype,
        device=device,
    )
    if high_blocks:
        ids = num_blocks - 1 - torch.randperm(min(num_blocks, 4 * total + 8), generator=gen)
    else:
        ids = torch.randperm(num_blocks, generator=gen)
    spare = ids[total:]  # never owned: NaN everywhere
    tables = spare[torch.randint(len(spare), (len(context_lens), max_blocks), generator=gen)]
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    layer = num_layers - 1
    at = 0
    for b, (ctx, n) in enumerate(zip(context_lens, need, strict=True)):
        mine = ids[at : at + n]
        at += n
        tables[b, :n] = mine
        for j, blk in enumerate(mine.tolist()):
            live = min(block_size, ctx - j * block_size)
            owned[blk, :live] = True
            kv = torch.randn((2, live, kv_heads, head_dim), generator=gen).to(dtype)
            pool[blk, layer, :, :live] = kv.to(device)
    return PagedCase(
        pool=pool,
        layer=layer,
        block_tables=tables.to(device=device, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        owned=owned.to(device),
    )


def fp32_caches(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 copies of the layer's K and V caches, for the fp32 reference."""
    return case.k_cache.float(), case.v_cache.float()


def randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
