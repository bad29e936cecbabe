"""ModelRunner: one forward pass over a packed batch of prefill chunks and decodes.

The runner is stateless between steps: the caller (the engine loop) owns each request's tokens,
how many of them are computed, and its block table (from the kvstore's ``Placement``/``Growth``).
For every step it passes one ``ScheduledChunk`` per request and gets back the logits of each
request's last scheduled token. Tokens whose KV is written are the caller's to report
(``append(..., num_computed=start + len(token_ids))``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from compute.attention import ATTN_NAME, PagedBatch, copy_blocks_inplace
from pagedserve.model_config import kv_geometry

__all__ = ["ModelRunner", "ScheduledChunk"]


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step: compute ``token_ids`` at positions ``start, start+1, ...``.

    ``start`` is the number of the request's tokens whose KV is already in its blocks (its
    ``num_computed``); ``block_ids`` is its whole block table, which must cover
    ``start + len(token_ids)`` tokens. A decode is a chunk of one token.
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]


class ModelRunner:
    """Runs a transformers causal LM loaded with ``attn_implementation="paged"`` on a paged pool.

    pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] on the model's device,
    in the model's dtype (the kvstore's layout; block-major).
    """

    def __init__(self, model: PreTrainedModel, pool: torch.Tensor, block_size: int) -> None:
        config = model.config
        if config._attn_implementation != ATTN_NAME:
            raise ValueError(
                f"model must be loaded with attn_implementation={ATTN_NAME!r}, "
                f"got {config._attn_implementation!r}"
            )
        dtype = str(model.dtype).removeprefix("torch.")
        geometry = kv_geometry(config, dtype)
        want = (
            geometry.num_layers,
            2,
            block_size,
            geometry.num_kv_heads,
            geometry.head_dim,
        )
        if pool.dim() != 6 or tuple(pool.shape[1:]) != want:
            raise ValueError(f"pool {tuple(pool.shape)} does not match (blocks, *{want})")
        if pool.dtype != model.dtype or pool.device != model.device:
            raise ValueError(
                f"pool is {pool.dtype} on {pool.device}, model is {model.dtype} on {model.device}"
            )
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.device = pool.device

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Performs copy-on-write block copies, the ``(src, dst)`` of each ``(position, src,
        dst)`` in the kvstore's ``Growth.copies``; must run before the forward that writes the
        destination blocks."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)  # [N]
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)  # [N]
        copy_blocks_inplace(self.pool, src, dst)

    def prepare(
        self, batch: Sequence[ScheduledChunk]
    ) -> tuple[dict[str, torch.Tensor], PagedBatch]:
        """Host-side packing: model inputs and the paged metadata of one step."""
        if not batch:
            raise ValueError("empty batch")
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        context_lens: list[int] = []
        for chunk in batch:
            n = len(chunk.token_ids)
            end = chunk.start + n
            if n == 0:
                raise ValueError("every scheduled request needs at least one token")
            if -(-end // bs) > len(chunk.block_ids):
                raise ValueError(f"{len(chunk.block_ids)} blocks cannot hold {end} tokens")
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, end))
            slots.extend(chunk.block_ids[p // bs] * bs + p % bs for p in range(chunk.start, end))
            cu.append(cu[-1] + n)
            context_lens.append(end)
        width = max(-(-c // bs) for c in context_lens)  # blocks the longest context reads
        table = [list(chunk.block_ids[:width]) for chunk in batch]
        table = [row + [0] * (width - len(row)) for row in table]

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        inputs = {
            "input_ids": tensor([ids], torch.int64),  # [1, T]
            "position_ids": tensor([positions], torch.int64),  # [1, T]
            "logits_to_keep": tensor(cu[1:], torch.int64) - 1,  # [B] last row of each request
        }
        paged = PagedBatch(
            slot_mapping=tensor(slots, torch.int64),  # [T]
            block_tables=tensor(table, torch.int32),  # [B, width]
            cu_seqlens_q=tensor(cu, torch.int32),  # [B + 1]
            context_lens=tensor(context_lens, torch.int32),  # [B]
            max_query_len=max(len(chunk.token_ids) for chunk in batch),
            max_context_len=max(context_lens),
            pool=self.pool,
        )
        return inputs, paged

    @torch.inference_mode()
    def forward(self, batch: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Writes the KV of every scheduled token into the pool; returns logits [B, vocab] of
        each request's last scheduled token (fp32), in batch order."""
        inputs, paged = self.prepare(batch)
        out = self.model(**inputs, use_cache=False, paged=paged)
        return out.logits[0].float()  # [B, vocab]
