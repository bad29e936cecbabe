"""``DeviceBlockTables``: the block tables CUDA-graph steps gather on the device, kept between
steps and rewritten only where a sequence's table changed. On the CPU (the same torch ops)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from compute.model.block_tables import DeviceBlockTables, TableRows


def gathered(tables: DeviceBlockTables, step: TableRows) -> list[list[int]]:
    """What a graph reads after ``apply``: the step's rows, ``width`` columns."""
    out = torch.full((len(step.rows), tables.max_blocks), -1, dtype=torch.int32)
    writes = torch.tensor(step.writes, dtype=torch.int64)
    tables.apply(writes, torch.tensor(step.rows, dtype=torch.int64), step.width, out)
    return out[:, : step.width].tolist()


def test_a_row_is_written_once_then_only_its_new_blocks() -> None:
    tables = DeviceBlockTables(4, 6, torch.device("cpu"))
    first = tables.plan(["a", "b"], [[7, 3], [5]], 2)
    assert first.rows == [0, 1]  # rows are handed out from the lowest
    assert first.writes == [0, 1, 6, 7, 3, 5]  # places (row * 6 + column), then blocks
    assert gathered(tables, first)[0] == [7, 3] and gathered(tables, first)[1][0] == 5
    assert tables.plan(["a", "b"], [[7, 3], [5]], 2).writes == []  # nothing changed
    grown = tables.plan(["b", "a"], [[5, 9], [7, 3, 2]], 3)  # each got a block; order swapped
    assert grown.rows == [1, 0]
    assert grown.writes == [7, 2, 9, 2]  # b's column 1, a's column 2
    assert gathered(tables, grown) == [[5, 9, 0], [7, 3, 2]]


def test_a_changed_block_rewrites_the_row_and_a_shorter_table_reads_its_prefix() -> None:
    tables = DeviceBlockTables(2, 4, torch.device("cpu"))
    gathered(tables, tables.plan(["a"], [[1, 2, 3]], 3))
    swapped = tables.plan(["a"], [[1, 8, 3]], 3)  # copy-on-write of block 1
    assert swapped.writes == [0, 1, 2, 1, 8, 3]
    assert gathered(tables, swapped) == [[1, 8, 3]]
    placed_again = tables.plan(["a"], [[6]], 1)  # preempted, placed anew
    assert placed_again.writes == [0, 6]
    assert gathered(tables, placed_again) == [[6]]  # past the table: stale, never read


def test_rows_of_sequences_that_left_are_reclaimed_and_unkeyed_ones_compare_in_full() -> None:
    tables = DeviceBlockTables(3, 4, torch.device("cpu"))
    gathered(tables, tables.plan(["a", "b", "c"], [[1], [2], [3]], 1))
    step = tables.plan(["d", "c"], [[4, 5], [3]], 2)  # no free row: a's and b's are taken back
    assert set(step.rows) <= {0, 1, 2} and step.rows[1] == 2
    assert gathered(tables, step) == [[4, 5], [3, 0]]
    step = tables.plan([None, None], [[9], [3]], 1)  # keyed by place: rewritten as they differ
    assert gathered(tables, step) == [[9], [3]]
    with pytest.raises(ValueError, match="share a key"):
        tables.plan(["x", "x"], [[1], [2]], 1)
    with pytest.raises(ValueError, match="4 sequences in a step, 3 table rows"):
        tables.plan(["p", "q", "r", "s"], [[1], [2], [3], [4]], 1)
    with pytest.raises(ValueError, match="a table of 5 blocks, rows of 4"):
        tables.plan(["p"], [[1, 2, 3, 4, 5]], 5)


class TablesMachine(RuleBasedStateMachine):
    """Sequences come, grow, swap a block (copy-on-write), are placed anew and leave, in any
    order; every step's gathered tables start with each sequence's host table."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = DeviceBlockTables(4, 8, torch.device("cpu"))
        self.host: dict[str, list[int]] = {}
        self.next_block = 1

    def _block(self) -> int:
        self.next_block += 1
        return self.next_block

    @rule(key=st.sampled_from("abcdefgh"), blocks=st.integers(1, 3))
    def arrive_or_place_anew(self, key: str, blocks: int) -> None:
        if len(self.host) < 3 or key in self.host:
            self.host[key] = [self._block() for _ in range(blocks)]

    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        if self.host:
            key = data.draw(st.sampled_from(sorted(self.host)))
            if len(self.host[key]) < 8:
                self.host[key].append(self._block())

    @rule(data=st.data())
    def copy_on_write(self, data: st.DataObject) -> None:
        if self.host:
            key = data.draw(st.sampled_from(sorted(self.host)))
            table = self.host[key]
            table[data.draw(st.integers(0, len(table) - 1))] = self._block()

    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        if self.host:
            del self.host[data.draw(st.sampled_from(sorted(self.host)))]

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        keys = data.draw(st.permutations(sorted(self.host)))
        if not keys:
            return
        width = max(len(self.host[k]) for k in keys)
        step = self.tables.plan(keys, [self.host[k] for k in keys], width)
        for key, row in zip(keys, gathered(self.tables, step), strict=True):
            assert row[: len(self.host[key])] == self.host[key]

    @invariant()
    def rows_are_distinct(self) -> None:
        rows = list(self.tables._row_of.values())
        assert len(rows) == len(set(rows)) and len(rows) + len(self.tables._free) == 4


TablesMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_tables_machine = TablesMachine.TestCase
