"""CUDA graphs of decode-only forwards: one per batch-size bucket, replayed with the step's data.

A decode step of a small model is launch-bound: ~10 kernels per layer, each costing more host
time than GPU time (BENCHMARKS.md). Capturing the whole forward once per bucket and replaying it
turns hundreds of launches into one.

Every captured graph reads the same static buffers (sized for the largest bucket); a replay
copies the step's inputs into their first rows and pads the rest of the bucket with rows that do
nothing: slot -1 (``store_kv`` skips it) and context length 0 (``paged_decode`` writes zeros).
Block tables are as wide as the longest context the model allows, so nothing about a graph
depends on the step; only the first ``width`` columns are copied, and the kernel never reads
past a row's context.
"""

from __future__ import annotations

import itertools
import logging

import torch
from transformers import PreTrainedModel

from compute.attention import PagedBatch
from compute.transfer import Staging

log = logging.getLogger("pagedserve.compute")


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to 64, of 16 up to 128 and of 32 beyond (vLLM's
    spacing: padding wastes at most ~20% of a step)."""
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 129, 16), *range(160, max_batch + 32, 32)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``pool`` for batches of 1..``max_batch``."""

    def __init__(
        self,
        model: PreTrainedModel,
        pool: torch.Tensor,
        block_size: int,
        max_batch: int,
        max_blocks: int,
    ) -> None:
        """pool: [num_blocks, layers, 2, block_size, kv_heads, head_dim] on CUDA; ``max_blocks``:
        the widest block table (the model's context length / block size)."""
        assert pool.is_cuda, "CUDA graphs need the pool on a CUDA device"
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.buckets = bucket_sizes(max_batch)
        device = pool.device
        self.input_ids = torch.zeros(1, max_batch, dtype=torch.int64, device=device)  # [1, B]
        self.positions = torch.zeros(1, max_batch, dtype=torch.int64, device=device)  # [1, B]
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)  # [B]
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.context = torch.zeros(max_batch, dtype=torch.int32, device=device)  # [B]
        self.cu = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # [B + 1]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # a counter
        # ids, positions, slots, context, table, feed: one copy per step
        self._staging = Staging(max_batch * (6 + max_blocks), device)

    def fits(self, batch: int, width: int) -> bool:
        """A decode step of ``batch`` requests whose longest context reads ``width`` blocks can
        replay a graph (wider: a context past the model's length)."""
        return batch <= self.max_batch and width <= self.max_blocks

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (they share one memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        for i, size in enumerate(reversed(self.buckets)):
            self._run(size)  # warm-up outside the graph: compiles kernels, allocates
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._run(size)  # [size, vocab]
            self.graphs[size] = (graph, logits)
            if i % 8 == 0 or size == 1:
                log.info(
                    "captured CUDA graph for %d decodes (%d/%d)", size, i + 1, len(self.buckets)
                )

    def _run(self, size: int) -> torch.Tensor:
        paged = PagedBatch(
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            cu_seqlens_q=self.cu[: size + 1],
            context_lens=self.context[:size],
            max_query_len=1,
            max_context_len=self.tables.shape[1] * self.block_size,
            pool=self.pool,
            num_decodes=size,
        )
        out = self.model(
            input_ids=self.input_ids[:, :size],
            position_ids=self.positions[:, :size],
            use_cache=False,
            paged=paged,
        )
        return out.logits[0]  # [size, vocab]

    def load(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        table: list[list[int]],
        context_lens: list[int],
        feed: tuple[torch.Tensor, list[int]] | None = None,
    ) -> None:
        """Copies one decode step of len(ids) <= max_batch requests into the static inputs
        (the rest of its bucket padded) for ``replay``, without waiting for the device.
        ``feed`` = (source [R] int64 on the device, rows): request ``i``'s token is
        ``source[rows[i]]`` for each ``i`` with ``rows[i] >= 0``, in place of ``ids[i]``."""
        batch = len(ids)
        size = self._bucket(batch)
        pad = size - batch
        width = len(table[0])
        fed = [i for i, row in enumerate(feed[1]) if row >= 0] if feed is not None else []
        values = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad]
        values += [*context_lens, *[0] * pad]
        values += itertools.chain.from_iterable(table)  # a generator per row costs 4x more
        values += [*(feed[1][i] for i in fed), *fed] if feed is not None else []
        parts = self._staging.copy(values).split(
            [size, size, size, size, batch * width, len(fed), len(fed)]
        )
        self.input_ids[0, :size].copy_(parts[0])
        self.positions[0, :size].copy_(parts[1])
        self.slots[:size].copy_(parts[2])
        self.context[:size].copy_(parts[3])
        self.tables[:batch, :width].copy_(parts[4].view(batch, width))
        if feed is not None and fed:
            self.input_ids[0].index_copy_(0, parts[6], feed[0][parts[5]])

    def replay(self, batch: int) -> torch.Tensor:
        """Runs the step ``load`` copied in; logits [batch, vocab] (a view into the graph's
        output: read it, or enqueue what reads it, before the next replay)."""
        graph, logits = self.graphs[self._bucket(batch)]
        graph.replay()
        self.replays += 1
        return logits[:batch]

    def _bucket(self, batch: int) -> int:
        return next(s for s in self.buckets if s >= batch)
