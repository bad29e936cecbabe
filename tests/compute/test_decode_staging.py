"""How a decode step reaches its CUDA graph: ``stage_decode`` lays it out on the host,
``before_replay`` enqueues the eager part and ``unpack_decode`` (captured in the graph) reads
it back. On the CPU, with the same torch ops the graph captures."""

from __future__ import annotations

import random

import torch

from compute.model.block_tables import DeviceBlockTables, TableRows
from compute.model.graphs import (
    INPUTS,
    WRITES,
    DecodeInputs,
    before_replay,
    stage_decode,
    unpack_decode,
)


def run_step(
    tables: DeviceBlockTables,
    size: int,
    keys: list[str],
    host_tables: list[list[int]],
    ids: list[int],
    feed: tuple[torch.Tensor, list[int]] | None,
    fed_tokens: torch.Tensor,
) -> DecodeInputs:
    """One step as ``DecodeGraphs.load`` and a replay run it (positions, slots and context
    lengths made from the ids so that every field is told apart)."""
    width = max(len(t) for t in host_tables)
    plan = tables.plan(keys, host_tables, width)
    positions = [100 + i for i in range(len(ids))]
    slots = [200 + i for i in range(len(ids))]
    context = [300 + i for i in range(len(ids))]
    feed_rows = feed[1] if feed is not None else None
    step = stage_decode(size, ids, positions, slots, plan, context, feed_rows, tables.scratch_place)
    staged = torch.tensor(step.values + step.extra + step.fed_rows, dtype=torch.int64)
    before_replay(staged, step, tables, feed[0] if feed else None, fed_tokens)
    return unpack_decode(staged, size, tables, fed_tokens)


def test_a_step_is_laid_out_for_its_bucket_and_read_back_exactly() -> None:
    tables = DeviceBlockTables(4, 6, torch.device("cpu"))
    plan = TableRows(rows=[0, 1, 2], writes=[0, 1, 6, 12, 7, 3, 5, 9], width=2)
    step = stage_decode(4, [11, 12, 13], [5, 6, 7], [50, 60, 70], plan, [6, 7, 8], [-1, 4, 0], 24)
    assert step.values[: INPUTS * 4] == [
        *[11, 12, 13, 0],  # ids, padded with 0
        *[5, 6, 7, 0],  # positions
        *[50, 60, 70, -1],  # slots: a padded row writes no K/V
        *[6, 7, 8, 0],  # context lengths: a padded row reads nothing
        *[0, 1, 2, 0],  # table rows
        *[-1, 0, 1, -1],  # place in fed_tokens: requests 1 and 2 are fed
    ]
    room = WRITES * 4
    assert step.values[INPUTS * 4 :] == [0, 1, 6, 12, *[24] * (room - 4), 7, 3, 5, 9, *[0] * 4]
    assert step.extra == [] and step.fed_rows == [4, 0]

    source = torch.tensor([40, 41, 42, 43, 44])  # the step before's draw
    fed_tokens = torch.full((8,), -7, dtype=torch.int64)
    staged = torch.tensor(step.values + step.extra + step.fed_rows)
    before_replay(staged, step, tables, source, fed_tokens)
    assert fed_tokens[:2].tolist() == [44, 40]
    inputs = unpack_decode(staged, 4, tables, fed_tokens)
    assert inputs.tokens.tolist() == [11, 44, 40, 0]
    assert inputs.positions.tolist() == [5, 6, 7, 0]
    assert inputs.slots.tolist() == [50, 60, 70, -1]
    assert inputs.context_lens.tolist() == [6, 7, 8, 0] and inputs.context_lens.dtype == torch.int32
    assert inputs.tables[:3, :2].tolist() == [[7, 3], [5, 0], [9, 0]]
    assert inputs.tables[3].tolist() == inputs.tables[0].tolist()  # padding reads row 0
    assert tables.table[4].tolist() == [0] * 6  # the scratch row took only the padding's zeros


def test_writes_past_the_room_go_before_the_graph() -> None:
    tables = DeviceBlockTables(4, 8, torch.device("cpu"))
    fed_tokens = torch.zeros(4, dtype=torch.int64)
    long = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]  # 9 writes; a bucket of 2 writes 4 in its graph
    inputs = run_step(tables, 2, ["a", "b"], long, [5, 6], None, fed_tokens)
    assert inputs.tables[0, :6].tolist() == long[0] and inputs.tables[1, :3].tolist() == long[1]
    assert inputs.tokens.tolist() == [5, 6]


def test_random_steps_read_back_what_the_host_holds() -> None:
    """Sequences join, grow a block, swap one (copy-on-write), are placed anew and leave; every
    step's unpacked inputs equal the host's lists."""
    rng = random.Random(0)
    max_blocks, max_batch = 12, 8
    tables = DeviceBlockTables(2 * max_batch, max_blocks, torch.device("cpu"))
    fed_tokens = torch.zeros(max_batch, dtype=torch.int64)
    host: dict[str, list[int]] = {}
    source = torch.arange(1000, 1000 + 3 * max_batch)
    for step_no in range(300):
        for key in list(host):
            roll = rng.random()
            if roll < 0.1:
                del host[key]
            elif roll < 0.3 and len(host[key]) < max_blocks:
                host[key].append(rng.randrange(500))
            elif roll < 0.35:
                host[key][rng.randrange(len(host[key]))] = rng.randrange(500)
            elif roll < 0.38:
                host[key] = [rng.randrange(500) for _ in range(rng.randint(1, max_blocks))]
        while len(host) < max_batch and rng.random() < 0.5:
            host[f"s{step_no}-{len(host)}"] = [
                rng.randrange(500) for _ in range(rng.randint(1, max_blocks))
            ]
        if not host:
            continue
        keys = list(host)
        size = next(s for s in (1, 2, 4, 8) if s >= len(keys))
        ids = [rng.randrange(50) for _ in keys]
        rows = [rng.choice([-1, rng.randrange(len(source))]) for _ in keys]
        inputs = run_step(
            tables, size, keys, [host[k] for k in keys], ids, (source, rows), fed_tokens
        )
        want = [int(source[r]) if r >= 0 else i for i, r in zip(ids, rows, strict=True)]
        assert inputs.tokens.tolist()[: len(keys)] == want
        assert inputs.slots.tolist()[len(keys) :] == [-1] * (size - len(keys))
        assert inputs.context_lens.tolist()[len(keys) :] == [0] * (size - len(keys))
        for i, key in enumerate(keys):
            assert inputs.tables[i, : len(host[key])].tolist() == host[key]
