"""The worker's batching policy, exactly, and against the real KVCacheManager under pressure."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compute.batch.scheduler import Chunk, Scheduler, SchedulerConfig, SeqStatus, Sequence, running
from kvstore.manager import KVCacheManager
from kvstore.protocol import LOOKAHEAD_SLOTS
from kvstore.requests import KVError

BS = 4


class Batch:
    """A scheduler and the sequences it is handed, by id (the worker's ``Requests`` keeps them
    so): the policy's calls by sequence id."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.seqs: dict[str, Sequence] = {}

    def add(self, seq_id: str, prompt: list[int], *more: Any, **limit: Any) -> Sequence:
        """``more`` and ``limit``: ``new_sequence``'s tokens done and max_tokens."""
        self.seqs[seq_id] = self.scheduler.new_sequence(seq_id, prompt, *more, **limit)
        return self.seqs[seq_id]

    def fork(self, parent: str, child: str, token: int) -> Sequence:
        self.seqs[child] = self.scheduler.fork(self.seqs[parent], child, token)
        return self.seqs[child]

    def finish(self, seq_id: str) -> Sequence:
        seq = self.seqs.pop(seq_id)
        self.scheduler.finish(seq)
        return seq

    def schedule(self) -> list[Chunk]:
        return self.scheduler.schedule(self.seqs.values())

    def to_place(self) -> list[Sequence]:
        return self.scheduler.to_place(self.seqs.values())

    def victim(self) -> Sequence | None:
        return self.scheduler.victim(self.seqs.values())

    def running(self) -> list[Sequence]:
        return running(self.seqs.values())

    def placed(self, seq_id: str, blocks: list[int], computed: int, tokens: int) -> None:
        self.scheduler.placed(self.seqs[seq_id], blocks, computed, tokens)

    def reported(self, seq_id: str, tokens: int) -> None:
        self.scheduler.reported(self.seqs[seq_id], tokens)

    def grown(
        self, seq_id: str, blocks: list[int], copies: list[tuple[int, int, int]]
    ) -> list[tuple[int, int]]:
        return self.scheduler.grown(self.seqs[seq_id], blocks, copies)

    def preempted(self, seq_id: str) -> None:
        self.scheduler.preempted(self.seqs[seq_id])

    def launched(self, chunk: Chunk, sampling: bool, feedable: bool) -> None:
        self.scheduler.launched(chunk, sampling, feedable)

    def processed(self, chunk: Chunk) -> None:
        self.scheduler.processed(chunk)

    def sampled(self, seq: Sequence, token: int) -> None:
        self.scheduler.sampled(seq, token)

    @property
    def held_steps(self) -> int:
        return self.scheduler.held_steps


def scheduler(seqs: int = 8, tokens: int = 16, interval: int = 1, aging: int = 1024) -> Batch:
    config = SchedulerConfig(seqs, tokens, prefill_interval=interval, priority_aging=aging)
    return Batch(Scheduler(config, BS))


def compute(s: Batch, chunk: Chunk, new_token: int | None) -> None:
    """A step run synchronously: launched, processed and, if ``new_token`` was drawn, sampled."""
    s.launched(chunk, new_token is not None, feedable=False)
    s.processed(chunk)
    if new_token is not None:
        s.sampled(chunk.seq, new_token)


def test_decodes_first_then_prefill_chunks_within_the_budget() -> None:
    s = scheduler(tokens=10)
    a, b, c = (s.add(name, list(range(n))) for name, n in (("a", 12), ("b", 3), ("c", 9)))
    for seq in (a, b, c):
        blocks = -(-len(seq.token_ids) // BS)
        s.placed(seq.seq_id, list(range(100, 100 + blocks)), 0, len(seq.token_ids))
    s.placed("b", [7], 2, 3)  # b: 3 tokens, 2 computed -> a decode (one pending token)
    chunks = s.schedule()
    assert [(ch.seq.seq_id, ch.start, ch.num_tokens, ch.samples) for ch in chunks] == [
        ("b", 2, 1, True),  # the decode goes first whatever its arrival
        ("a", 0, 9, False),  # then the oldest prefill, cut by the budget
    ]
    compute(s, chunks[0], new_token=42)
    compute(s, chunks[1], new_token=None)
    assert b.token_ids == [0, 1, 2, 42] and (a.num_computed, b.num_computed) == (9, 3)
    assert b.unreported == [42] and b.num_pending == 0  # not computed before it is reported
    assert [(ch.seq.seq_id, ch.start) for ch in s.schedule()] == [("a", 9), ("c", 0)]
    s.reported("b", 4)  # the kvstore accepted 42 ...
    s.grown("b", [8], [])  # ... and gave b a block for it
    chunks = s.schedule()  # b decodes, a finishes its prompt, c starts
    assert [(ch.seq.seq_id, ch.start, ch.num_tokens) for ch in chunks] == [
        ("b", 3, 1),
        ("a", 9, 3),
        ("c", 0, 6),
    ]
    with pytest.raises(AssertionError, match="mid-prompt"):
        compute(s, chunks[2], new_token=5)
    assert s.seqs["c"].num_computed == 0  # a refused update changes nothing


def run_step(s: Batch, blocks: list[int]) -> list[tuple[str, int, int]]:
    """One step run synchronously: drawn tokens (9) are reported at once, a new block (from
    ``blocks``) given where a table is full. Returns the chunks as (id, start, tokens)."""
    chunks = s.schedule()
    for chunk in chunks:
        samples, seq = chunk.samples, chunk.seq
        compute(s, chunk, 9 if samples else None)
        if samples:
            s.reported(seq.seq_id, len(seq.token_ids))
            if len(seq.token_ids) > len(seq.block_ids) * BS:
                s.grown(seq.seq_id, [blocks.pop(0)], [])
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in chunks]


def test_with_a_prefill_interval_prompts_join_decodes_every_nth_step_only() -> None:
    """Interval 3: while ``d`` decodes, prompt chunks run in steps 1, 4 and 7 (the two steps
    before each have none); a prompt with no decode beside it runs at once, every step."""
    s = scheduler(tokens=6, interval=3)
    blocks = list(range(50, 90))
    s.add("d", [1, 2, 3])
    s.placed("d", [0], 2, 3)  # one pending token: a decode
    s.add("p", list(range(8)))
    s.placed("p", [1, 2], 0, 8)
    assert run_step(s, blocks) == [("d", 2, 1), ("p", 0, 5)]  # the first step may take prompts
    assert run_step(s, blocks) == [("d", 3, 1)]  # p's last 3 prompt tokens wait ...
    assert run_step(s, blocks) == [("d", 4, 1)]
    assert run_step(s, blocks) == [("d", 5, 1), ("p", 5, 3)]  # ... two steps
    s.add("q", list(range(4)))
    s.placed("q", [3], 0, 4)
    assert run_step(s, blocks) == [("d", 6, 1), ("p", 8, 1)]  # p decodes; q waits
    assert run_step(s, blocks) == [("d", 7, 1), ("p", 9, 1)]
    assert run_step(s, blocks) == [("d", 8, 1), ("p", 10, 1), ("q", 0, 4)]
    assert s.held_steps == 4  # steps 2, 3, 5 and 6
    alone = scheduler(tokens=4, interval=3)
    alone.add("a", list(range(10)))
    alone.placed("a", [0, 1, 2], 0, 10)
    steps = [run_step(alone, blocks) for _ in range(4)]
    assert steps == [[("a", 0, 4)], [("a", 4, 4)], [("a", 8, 2)], [("a", 10, 1)]]


def test_the_config_refuses_values_below_one() -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens", "prefill_interval", "priority_aging"):
        with pytest.raises(ValueError, match="must be at least 1"):
            SchedulerConfig(**{name: 0})


def test_placement_order_room_and_victim() -> None:
    s = scheduler(seqs=2)
    for name in "abcd":
        s.add(name, [1, 2, 3])
    assert [q.seq_id for q in s.to_place()] == ["a", "b"]
    s.placed("a", [0], 0, 3)
    s.placed("b", [1], 0, 3)
    victim = s.victim()
    assert s.to_place() == [] and victim is not None and victim.seq_id == "b"
    s.preempted("b")
    assert [q.seq_id for q in s.to_place()] == ["b"]  # preempted before the new c and d
    s.finish("a")
    assert [q.seq_id for q in s.to_place()] == ["b", "c"]


def test_priority_orders_placement_steps_and_the_victim() -> None:
    """A lower priority value is placed first, stepped first and preempted last; at equal
    priority, arrival order (and a preempted sequence before a new one)."""
    s = scheduler(seqs=2)
    s.add("a", [1, 2, 3])
    s.add("b", [1, 2, 3], priority=5)
    s.add("c", [1, 2, 3], priority=-1)
    s.add("d", [1, 2, 3])
    assert [q.seq_id for q in s.to_place()] == ["c", "a"]
    s.placed("a", [0], 0, 3)
    s.placed("c", [1], 0, 3)
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in s.schedule()] == [
        ("c", 0, 3),
        ("a", 0, 3),
    ]
    victim = s.victim()
    assert victim is not None and victim.seq_id == "a"  # c outranks it, arrived later
    s.preempted("a")
    assert [q.seq_id for q in s.to_place()] == ["a"]  # before d, which arrived after it
    s.finish("c")
    assert [q.seq_id for q in s.to_place()] == ["a", "d"]  # b (priority 5) last


def test_a_low_priority_request_is_overtaken_by_at_most_aging_later_arrivals() -> None:
    """The stated bound on starvation: with ``priority_aging`` 3, a request of priority 1 is
    overtaken by at most 3 of the priority-0 requests that keep arriving after it."""
    s = scheduler(seqs=100, aging=3)
    s.add("low", [1], priority=1)
    for i in range(10):
        s.add(f"h{i}", [1])
    order = [q.seq_id for q in s.to_place()]
    assert order == ["h0", "h1", "low", *[f"h{i}" for i in range(2, 10)]]  # h2 ties: later


def test_a_preempted_sequence_is_placed_again_only_once_its_launched_chunks_are_processed() -> None:
    """The kvstore's reply is applied after the next step is launched: a victim may be computed
    by two launched steps when it is preempted. Their work went to the blocks it lost, so it
    is not placed again (its computed count would take them in) until both are processed."""
    s = scheduler(seqs=4, tokens=4)
    s.add("a", [1, 2, 3, 4, 5, 6, 7, 8])
    s.placed("a", [0, 1, 2], 0, 8)
    first = s.schedule()[0]
    s.launched(first, sampling=False, feedable=False)  # step k: tokens 0-3
    second = s.schedule()[0]
    s.launched(second, sampling=True, feedable=True)  # step k+1: tokens 4-7, draws one
    s.preempted("a")
    assert s.to_place() == []  # two launched steps still compute it
    s.processed(first)
    assert s.to_place() == []
    s.processed(second)
    s.sampled(second.seq, 9)
    assert [q.seq_id for q in s.to_place()] == ["a"]
    a = s.seqs["a"]
    assert (a.num_done, a.num_computed, a.unreported) == (0, 0, [9])


def test_grown_applies_copies_and_new_blocks() -> None:
    s = scheduler()
    s.add("p", list(range(6)))
    s.placed("p", [3, 4], 6, 6)
    assert s.grown("p", [9], [(1, 4, 8)]) == [(4, 8)]
    assert s.seqs["p"].block_ids == [3, 8, 9]
    with pytest.raises(AssertionError, match="is not"):
        s.grown("p", [], [(0, 5, 6)])


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    outputs=st.integers(1, 12),
    blocks=st.integers(8, 40),
    budget=st.integers(1, 24),
    interval=st.integers(1, 4),
    priorities=st.lists(st.integers(-2, 2), min_size=8, max_size=8),
)
def test_every_sequence_finishes_under_memory_pressure(
    prompts: list[int], outputs: int, blocks: int, budget: int, interval: int, priorities: list[int]
) -> None:
    """The engine's step loop, minus the model: schedule, 'compute', append at the real manager,
    preempt the victim when it has no room, place what fits. Every sequence ends with its prompt
    and ``outputs`` tokens, and the scheduler's tables always equal the manager's, whatever the
    prefill interval and the priorities (aging 2: each unit of priority is two arrivals)."""
    if max(-(-(p + outputs + LOOKAHEAD_SLOTS) // BS) for p in prompts) > blocks:
        return  # one sequence alone cannot fit: not this test's business
    kv = KVCacheManager(blocks, 0, BS)
    s = scheduler(seqs=4, tokens=budget, interval=interval, aging=2)
    for i, n in enumerate(prompts):
        s.add(f"r{i}", [i * 100 + t for t in range(n)], priority=priorities[i])
    done: dict[str, list[int]] = {}
    for _ in range(2000):
        for seq in s.to_place():
            try:
                if seq.status is SeqStatus.PREEMPTED:
                    placed, _ = kv.resume(seq.seq_id, "w")
                else:
                    placed = kv.admit(seq.seq_id, "w", seq.token_ids, None)
            except KVError as err:
                assert err.code == "no_space"
                break
            known = len(kv.requests[seq.seq_id].token_ids)
            s.placed(seq.seq_id, placed.block_ids, placed.num_computed, known)
        chunks = s.schedule()
        for chunk in chunks:  # the forward pass
            compute(s, chunk, 7 if chunk.samples else None)
        for seq in s.running():  # the step's appends, oldest first; preempt on no room
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted above to make room
            while True:
                try:
                    growth = kv.append(seq.seq_id, "w", seq.unreported, seq.num_computed)
                except KVError as err:
                    assert err.code == "no_space"
                    victim = s.victim()
                    assert victim is not None
                    kv.preempt([victim.seq_id], "w", 0.0)
                    s.preempted(victim.seq_id)
                    if victim is seq:
                        break
                    continue
                s.reported(seq.seq_id, len(seq.token_ids))
                s.grown(seq.seq_id, growth.new_block_ids, growth.copies)
                break
            if seq.status is SeqStatus.RUNNING and len(seq.token_ids) - seq.num_prompt == outputs:
                kv.free(seq.seq_id, "w")
                done[seq.seq_id] = s.finish(seq.seq_id).token_ids
        assert chunks or s.running() or not s.seqs, "nothing runs although sequences wait"
        kv.check_integrity()
        for seq in s.running():
            assert seq.block_ids == kv.requests[seq.seq_id].block_ids
            assert seq.token_ids[: seq.num_reported] == kv.requests[seq.seq_id].token_ids
        if not s.seqs:
            break
    assert sorted(done) == sorted(f"r{i}" for i in range(len(prompts)))
    for i, n in enumerate(prompts):
        assert done[f"r{i}"] == [i * 100 + t for t in range(n)] + [7] * outputs


def test_fork_shares_reported_tokens_and_blocks() -> None:
    s = scheduler()
    s.add("p", list(range(6)), priority=2)
    s.placed("p", [3, 4], 0, 6)
    [chunk] = s.schedule()
    compute(s, chunk, new_token=50)
    child = s.fork("p", "p#1", 51)
    assert child.rank == s.seqs["p"].rank  # its parent's place in line, priority included
    assert child.token_ids == [0, 1, 2, 3, 4, 5, 51] and child.unreported == [51]
    assert (child.block_ids, child.num_computed, child.status) == ([3, 4], 6, SeqStatus.RUNNING)
    assert child.block_ids is not s.seqs["p"].block_ids


def test_a_sequence_counts_its_output_and_names_the_last_token_its_limit_allows() -> None:
    """``num_generated`` and ``max_len`` are the worker's only output count and limit: a fork
    starts with its first token counted and the parent's limit, a sequence taken over with the
    tokens it streamed."""
    s = scheduler()
    seq = s.add("p", list(range(6)), max_tokens=2)
    assert seq.num_generated == 0 and not seq.last_allowed(0) and seq.last_allowed(1)
    s.placed("p", [3, 4], 0, 6)
    [chunk] = s.schedule()
    s.launched(chunk, True, feedable=False)
    assert seq.num_generated == 0  # in flight: not the host's yet
    s.processed(chunk)
    s.sampled(seq, 50)
    child = s.fork("p", "p#1", 51)
    assert seq.num_generated == child.num_generated == 1
    assert not child.last_allowed(0) and child.last_allowed(1)
    resumed = s.add("q", [1, 2], [7, 8], max_tokens=3)
    assert resumed.num_generated == 2 and resumed.last_allowed(2) and not resumed.last_allowed(1)
    assert s.add("beam", [1]).last_allowed(10_000) is False  # no limit: beams keep their own
