"""CUDA graphs of decode-only forwards: one per batch-size bucket, replayed with the step's data.

A decode step of a small model is launch-bound: ~10 kernels per layer, each costing more host
time than GPU time (BENCHMARKS-archive.md). Capturing the whole forward once per bucket and
replaying it turns hundreds of launches into one.

A step's inputs travel in one host-to-device copy (``compute.transfer.Staging``) and the graph
itself unpacks them: the bucket's graph reads its inputs at fixed places of the staging buffer,
writes the step's block-table changes into the runner's ``DeviceBlockTables``, gathers its rows
and takes the tokens that are only on the device (fed from the step before) from
``fed_tokens``. So a replay costs the host one copy, at most two small eager ops and the launch
of the graph, where unpacking the inputs eagerly took about a dozen torch calls per step (~0.5
ms of host time per 1B decode step on the H200, py-spy, BENCHMARKS-archive.md).

Rows past the step's batch do nothing: slot -1 (``store_kv`` skips it) and context length 0
(``paged_decode`` writes zeros). Block tables are as wide as the longest context the model
allows, so nothing about a graph depends on the step, and the kernel never reads past a row's
context.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from compute.model.attention import PagedBatch
from compute.model.block_tables import DeviceBlockTables, TableRows
from compute.transfer import Staging

log = logging.getLogger("pagedserve.compute")
INPUTS = 6  # rows of a bucket's inputs in the staging buffer (``stage_decode``)
WRITES = 2  # table writes a bucket's graph makes, per request (more go eagerly)


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
        self.cu = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # [B + 1]
        # the fed tokens of a step, gathered from the step before's draw (eagerly: its tensor
        # changes every step) for the graph to read
        self.fed_tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # a counter
        # a bucket's inputs (``stage_decode``), then the writes past its room and the fed rows
        self._staging = Staging(max_batch * (INPUTS + 2 * WRITES + 2 * max_blocks + 1), device)

    def fits(self, batch: int, width: int) -> bool:
        """A decode step of ``batch`` requests whose longest context reads ``width`` blocks can
        replay a graph (wider: a context past the model's length)."""
        return batch <= self.max_batch and width <= self.max_blocks

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (they share one memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        empty, scratch = TableRows([], [], 0), self.block_tables.scratch_place
        for i, size in enumerate(reversed(self.buckets)):
            # a step of padding only: every index the graph reads is valid while it is captured
            self._staging.copy(stage_decode(size, [], [], [], empty, [], None, scratch).values)
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
        """The bucket's forward, reading the step from the staging buffer (``stage_decode``)."""
        tables = self.block_tables
        step = unpack_decode(self._staging.buffer, size, tables, self.fed_tokens)
        paged = PagedBatch(
            slot_mapping=step.slots,
            block_tables=step.tables,
            cu_seqlens_q=self.cu[: size + 1],
            context_lens=step.context_lens,
            max_query_len=1,
            max_context_len=tables.max_blocks * self.block_size,
            pool=self.pool,
            num_decodes=size,
        )
        out = self.model(
            input_ids=step.tokens.view(1, size),
            position_ids=step.positions.view(1, size),
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
        """Copies one decode step of len(ids) <= max_batch requests to the device for
        ``replay`` (the rest of its bucket padded), without waiting for the device.
        ``table``: the requests' rows of the runner's ``DeviceBlockTables`` (its ``plan``).
        ``feed`` = (source [R] int64 on the device, rows): request ``i``'s token is
        ``source[rows[i]]`` for each ``i`` with ``rows[i] >= 0``, in place of ``ids[i]``."""
        size = self._bucket(len(ids))
        scratch = self.block_tables.scratch_place
        feed_rows = feed[1] if feed is not None else None
        step = stage_decode(size, ids, positions, slots, table, context_lens, feed_rows, scratch)
        staged = self._staging.copy(step.values + step.extra + step.fed_rows)
        source = feed[0] if feed is not None else None
        before_replay(staged, step, self.block_tables, source, self.fed_tokens)

    def replay(self, batch: int) -> torch.Tensor:
        """Runs the step ``load`` copied in; logits [batch, vocab] (a view into the graph's
        output: read it, or enqueue what reads it, before the next replay)."""
        graph, logits = self.graphs[self._bucket(batch)]
        graph.replay()
        self.replays += 1
        return logits[:batch]

    def _bucket(self, batch: int) -> int:
        return next(s for s in self.buckets if s >= batch)


class StagedDecode(NamedTuple):
    """A decode step as ``DecodeGraphs`` stages it (``stage_decode``)."""

    values: list[int]  # what the bucket's graph reads (``unpack_decode``)
    extra: list[int]  # table writes past the graph's room, [places..., blocks...]
    fed_rows: list[int]  # the rows of the feed's source to gather into ``fed_tokens``


class DecodeInputs(NamedTuple):
    """A bucket's model inputs, unpacked on the device (views of the staging buffer or new)."""

    tokens: torch.Tensor  # [size] int64
    positions: torch.Tensor  # [size] int64
    slots: torch.Tensor  # [size] int64
    context_lens: torch.Tensor  # [size] int32
    tables: torch.Tensor  # [size, max_blocks] int32


def stage_decode(
    size: int,
    ids: list[int],
    positions: list[int],
    slots: list[int],
    table: TableRows,
    context_lens: list[int],
    feed_rows: list[int] | None,
    scratch: int,
) -> StagedDecode:
    """A decode step of len(ids) <= ``size`` requests laid out for the ``size`` bucket:
    ``INPUTS`` rows of ``size`` values (token ids, positions, slots, context lengths, table
    rows, each request's place in ``fed_tokens`` or -1; padded with 0, slot -1 and place -1),
    then ``WRITES * size`` table writes' places and as many blocks (padded with writes of 0 to
    ``scratch``). ``feed_rows[i] >= 0``: request ``i``'s token is that row of the feed's source."""
    pad = size - len(ids)
    fed_at, fed_rows = [-1] * size, list[int]()
    for i, row in enumerate(feed_rows or ()):
        if row >= 0:
            fed_at[i] = len(fed_rows)
            fed_rows.append(row)
    values = [*ids, *[0] * pad, *positions, *[0] * pad, *slots, *[-1] * pad]
    values += [*context_lens, *[0] * pad, *table.rows, *[0] * pad, *fed_at]
    writes = len(table.writes) // 2
    room = WRITES * size
    places, blocks = table.writes[:writes], table.writes[writes:]
    fill = max(room - writes, 0)
    values += [*places[:room], *[scratch] * fill, *blocks[:room], *[0] * fill]
    return StagedDecode(values, [*places[room:], *blocks[room:]], fed_rows)


def before_replay(
    staged: torch.Tensor,
    step: StagedDecode,
    tables: DeviceBlockTables,
    source: torch.Tensor | None,
    fed_tokens: torch.Tensor,
) -> None:
    """Enqueues what a replay needs first: the table writes past its room, and the gather of
    the fed tokens from ``source`` (the step before's draw) into ``fed_tokens``. ``staged``:
    ``step``'s values, extra writes and fed rows, in that order, on the device."""
    start = len(step.values)
    if step.extra:  # new rows: written before the graph's own writes (other places)
        tables.write(*staged[start : start + len(step.extra)].view(2, -1))
    if step.fed_rows:
        assert source is not None, "fed rows of no source"
        rows = staged[start + len(step.extra) : start + len(step.extra) + len(step.fed_rows)]
        torch.index_select(source, 0, rows, out=fed_tokens[: len(step.fed_rows)])


def unpack_decode(
    staged: torch.Tensor, size: int, tables: DeviceBlockTables, fed_tokens: torch.Tensor
) -> DecodeInputs:
    """The ``size`` bucket's inputs from the staging buffer (``stage_decode``'s values at its
    start); enqueues the step's table writes into ``tables`` and the gathers. Device ops only:
    a graph captures it."""
    ids, positions, slots, context, rows, fed = staged[: INPUTS * size].view(INPUTS, size)
    room = WRITES * size
    places = staged[INPUTS * size : INPUTS * size + room]
    blocks = staged[INPUTS * size + room : INPUTS * size + 2 * room]
    tables.write(places, blocks)
    tokens = torch.where(fed >= 0, fed_tokens.index_select(0, fed.clamp(min=0)), ids)
    return DecodeInputs(
        tokens, positions, slots, context.to(torch.int32), tables.table.index_select(0, rows)
    )
