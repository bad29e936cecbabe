"""CUDA graphs of decode-only forwards: one per batch-size bucket, replayed with the step's data.

A decode step of a small model is launch-bound: ~10 kernels per layer, each costing more host
time than GPU time (BENCHMARKS.md). Capturing the whole forward once per bucket and replaying it
turns hundreds of launches into one.

Every captured graph reads the same static buffers (sized for the largest bucket); a replay
copies the step's inputs into their first rows and pads the rest of the bucket with rows that do
nothing: slot -1 (``store_kv`` skips it) and context length 0 (``paged_decode`` writes zeros).
Block tables are as wide as the longest context the model allows, so nothing about a graph
depends on the step; they are gathered on the device from the runner's ``DeviceBlockTables``
(only the first ``width`` columns), and the kernel never reads past a row's context.
"""

from __future__ import annotations

import logging

import torch
from transformers import PreTrainedModel

from compute.attention import PagedBatch
from compute.block_tables import DeviceBlockTables, TableRows
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
        tables: DeviceBlockTables,
    ) -> None:
        """pool: [num_blocks, layers, 2, block_size, kv_heads, head_dim] on CUDA; ``max_blocks``:
        the widest block table (the model's context length / block size); ``tables``: the
        sequences' block tables on the device (the runner's)."""
        assert pool.is_cuda, "CUDA graphs need the pool on a CUDA device"
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.block_tables = tables
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
        # ids, positions, slots, context, table rows, feed [B] each; table writes (2 per block)
        self._staging = Staging(max_batch * (6 + 2 * max_blocks), device)

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
        table: TableRows,
        context_lens: list[int],
        feed: tuple[torch.Tensor, list[int]] | None = None,
    ) -> None:
        """Copies one decode step of len(ids) <= max_batch requests into the static inputs
        (the rest of its bucket padded) for ``replay``, without waiting for the device.
        ``table``: the requests' rows of ``block_tables`` (``DeviceBlockTables.plan``).
        ``feed`` = (source [R] int64 on the device, rows): request ``i``'s token is
        ``source[rows[i]]`` for each ``i`` with ``rows[i] >= 0``, in place of ``ids[i]``."""
        batch = len(ids)
        size = self._bucket(batch)
        pad = size - batch
        fed = [i for i, row in enumerate(feed[1]) if row >= 0] if feed is not None else []
        values = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad]
        values += [*context_lens, *[0] * pad, *table.rows, *table.writes]
        values += [*(feed[1][i] for i in fed), *fed] if feed is not None else []
        parts = self._staging.copy(values).split(
            [size, size, size, size, batch, len(table.writes), len(fed), len(fed)]
        )
        self.input_ids[0, :size].copy_(parts[0])
        self.positions[0, :size].copy_(parts[1])
        self.slots[:size].copy_(parts[2])
        self.context[:size].copy_(parts[3])
        self.block_tables.apply(parts[5], parts[4], table.width, self.tables)
        if feed is not None and fed:
            self.input_ids[0].index_copy_(0, parts[7], feed[0][parts[6]])

    def replay(self, batch: int) -> torch.Tensor:
        """Runs the step ``load`` copied in; logits [batch, vocab] (a view into the graph's
        output: read it, or enqueue what reads it, before the next replay)."""
        graph, logits = self.graphs[self._bucket(batch)]
        graph.replay()
        self.replays += 1
        return logits[:batch]

    def _bucket(self, batch: int) -> int:
        return next(s for s in self.buckets if s >= batch)
