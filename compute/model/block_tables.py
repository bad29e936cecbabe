"""Block tables kept on the device between steps: ``DeviceBlockTables`` (vLLM's persistent
block table, in spirit).

A CUDA-graph step reads a dense [B, width] table. Built from the host lists every step, it was
most of what a step copied (a 1B decode step of 128 requests with contexts of ~600 tokens: ~4,900
of ~5,600 values) and ~17% of the worker's host time on the H200 (py-spy,
BENCHMARKS-archive.md). Yet a sequence's table changes rarely: a block every 16 tokens, a
copy-on-write swap, a new placement.

Here every sequence the steps run has a row of a device tensor, keyed by the caller (a sequence
id). ``plan`` compares each sequence's host table with what its row was last given (a host
mirror) and returns the writes that bring the row up to date: the new blocks of a table that
grew, the whole table otherwise. The caller copies the rows and writes to the device with its
other inputs, then ``apply`` enqueues the writes and the gather of the step's rows into the
graph's static table. Correctness rests on the comparison alone: a key reused by another
sequence, or no key, costs a rewrite, never a stale table.

Entries of a row past its table's length are stale, never zeroed: attention reads a row only up
to its context, which its table covers.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

__all__ = ["DeviceBlockTables", "TableRows"]


class TableRows(NamedTuple):
    """A step's block tables as ``DeviceBlockTables`` rows: the row of each sequence, the
    writes the rows need first (``[places..., blocks...]``, a place being ``row * max_blocks +
    column``), and the width the step reads (blocks of its longest context)."""

    rows: list[int]
    writes: list[int]
    width: int


class DeviceBlockTables:
    """``rows`` device rows of ``max_blocks`` block ids, assigned to keys. Owned by the runner;
    ``plan`` mutates the host side (row assignment, mirror), ``apply`` enqueues the device
    side, in the order the caller's steps run."""

    def __init__(self, rows: int, max_blocks: int, device: torch.device) -> None:
        # one more row than assigned: its first entry is the scratch place, where a graph's
        # padding writes go
        self.table = torch.zeros(rows + 1, max_blocks, dtype=torch.int32, device=device)
        self.max_blocks = max_blocks
        self.scratch_place = rows * max_blocks
        self._row_of: dict[Hashable, int] = {}
        self._mirror: list[list[int]] = [[] for _ in range(rows)]  # what each row was given
        self._free = list(range(rows - 1, -1, -1))

    @property
    def rows(self) -> int:
        return len(self._mirror)

    def plan(
        self, keys: Sequence[Hashable | None], tables: Sequence[Sequence[int]], width: int
    ) -> TableRows:
        """The row of each sequence (``keys[i]``; None: keyed by its place ``i`` in the batch)
        and the writes that make each row start with its ``tables[i]``. Mutates the row
        assignment and the mirror: the writes must reach the device before any step reads these
        rows (``apply``). Keys absent from this batch lose their rows when rows run out."""
        if len(keys) > self.rows:
            raise ValueError(f"{len(keys)} sequences in a step, {self.rows} table rows")
        keys = [("#", i) if k is None else k for i, k in enumerate(keys)]
        if len(set(keys)) != len(keys):
            raise ValueError("two sequences of a step share a key")
        if len(self._free) < len(keys):  # sure to fit: free every row this step does not use
            kept = set(keys)
            for key in [k for k in self._row_of if k not in kept]:
                self._free.append(self._row_of.pop(key))
        rows: list[int] = []
        places: list[int] = []
        blocks: list[int] = []
        row_of, mirror, width_of_row = self._row_of, self._mirror, self.max_blocks
        for key, table in zip(keys, tables, strict=True):
            row = row_of.get(key)
            if row is None:
                row = row_of[key] = self._free.pop()
            rows.append(row)
            had = mirror[row]
            if had == table:
                continue
            if len(table) > self.max_blocks:
                raise ValueError(f"a table of {len(table)} blocks, rows of {self.max_blocks}")
            n = len(had)
            first = n if n <= len(table) and table[:n] == had else 0  # grew, or rewritten
            base = row * width_of_row
            places += range(base + first, base + len(table))
            blocks += table[first:]
            mirror[row] = list(table)
        return TableRows(rows, [*places, *blocks], width)

    def apply(
        self, writes: torch.Tensor, rows: torch.Tensor, width: int, out: torch.Tensor
    ) -> None:
        """Enqueues a ``TableRows``' writes and the gather of its rows into ``out[:len(rows),
        :width]`` (``writes``, ``rows``: its lists on the device, int64)."""
        if writes.numel():
            self.write(*writes.view(2, -1))
        out[: rows.numel(), :width].copy_(self.table.index_select(0, rows)[:, :width])

    def write(self, places: torch.Tensor, blocks: torch.Tensor) -> None:
        """Enqueues ``table.flat[places] = blocks`` (int64 on the device, as a ``TableRows``'
        writes are laid out)."""
        self.table.view(-1).index_copy_(0, places, blocks.to(torch.int32))
