"""Continuous batching policy of a compute worker: which sequences run in the next step and how
many of their tokens (chunked prefill under a token budget), which get placed at the kvstore, and
which one is preempted when the kvstore runs out of blocks.

Pure Python, owned and called by the engine loop's single thread. Block tables only ever come
from the kvstore's replies (``placed``/``grown``); the scheduler never invents a block id.

Overlap (``compute.loop.model_step``): a step is launched before the previous one's tokens reach the
host. A sequence whose last sampled token is still on the device (``inflight``) runs its next
decode with that token fed from the device (a ``fed`` chunk), provided its block table already
has the slot (the kvstore keeps two past every running table's last token,
``kvstore.protocol.LOOKAHEAD_SLOTS``) and its ``max_len`` allows another token; otherwise it
waits a step.
``num_computed`` counts launched work, ``num_done`` the work of processed steps (what the kvstore
is told).

Policy (as vLLM / SGLang with chunked prefill):
- decodes first, every running sequence that has exactly one token to compute, oldest first;
- then prefill chunks of running sequences, oldest first, as far as the token budget goes;
  with ``prefill_interval`` N > 1, a step that has decodes takes prompt chunks only if the
  N - 1 steps before it took none (vLLM v0's ``--scheduler-delay-factor``, counted in steps):
  prompts gather into fewer, larger steps, so most decode steps carry no prompt (a shorter
  median inter-token gap, for later first tokens and longer gaps at the prompt steps);
- placement (admission or resume) oldest first (a preempted sequence arrived before the new
  ones, and goes first at a tie), while the number of running sequences stays under
  ``max_num_seqs``;
- the preemption victim is the running sequence that arrived last.

"Oldest" and "last" go by a sequence's ``rank``: its arrival (a counter of the sequences this
scheduler was handed) plus ``priority * priority_aging``. Priority 0 (the default) is arrival
order; a lower priority value goes first, as in vLLM. The bound on starvation: a request is
overtaken by at most ``priority_aging * (its priority - theirs)`` requests that arrived after it
(vLLM's priority scheduling states none).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from contracts.options import flag


class SeqStatus(Enum):
    WAITING = "waiting"  # never placed at the kvstore
    RUNNING = "running"  # holds blocks
    PREEMPTED = "preempted"  # gave its blocks back; the kvstore swapped or dropped them
    FINISHED = "finished"


@dataclass
class Sequence:
    """One generated sequence, a kvstore request (``n > 1`` and beams are several). Its output
    count (``num_generated``) and length limit (``max_len``) are the worker's only ones: the
    stop checker is told which token is the last (``last_allowed``)."""

    seq_id: str
    rank: int  # lower runs first, is placed first, is preempted last (arrival and priority)
    token_ids: list[int]  # prompt + generated
    num_prompt: int
    status: SeqStatus = SeqStatus.WAITING
    max_len: int = 1 << 62  # prompt + max_tokens: no token is sampled past it
    num_computed: int = 0  # tokens whose KV this worker has written or launched a step to write
    num_done: int = 0  # tokens whose KV is written by steps already processed
    num_reported: int = 0  # tokens the kvstore knows (and has blocks for)
    inflight: int = 0  # tokens sampled on the device that the host does not know yet
    launched_chunks: int = 0  # chunks of it in launched steps not processed yet
    feedable: bool = False  # the last in-flight token may feed the next step from the device
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        """Output tokens the host has (in-flight ones join ``token_ids`` when sampled)."""
        return len(self.token_ids) - self.num_prompt

    def last_allowed(self, offset: int) -> bool:
        """Whether output token ``offset`` is the last one ``max_len`` allows."""
        return self.num_prompt + offset + 1 >= self.max_len

    @property
    def num_pending(self) -> int:
        """Known tokens to compute now: only those the kvstore knows, so their blocks (and any
        copy-on-write) exist; a sampled token is computed after an append reported it, unless it
        is fed from the device (``can_feed``)."""
        return self.num_reported - self.num_computed if not self.inflight else 0

    def can_feed(self, block_size: int) -> bool:
        """Its one in-flight token can run next, fed from the device: nothing else is pending,
        the token's slot is in the table already, and another token may follow it."""
        position = len(self.token_ids)  # of the in-flight token
        return (
            self.inflight == 1
            and self.feedable
            and self.num_computed == position
            and position < len(self.block_ids) * block_size
            and position + 1 < self.max_len
        )

    @property
    def unreported(self) -> list[int]:
        """Sampled tokens the kvstore has not accepted yet (the next append carries them)."""
        return self.token_ids[self.num_reported :]


class Chunk(NamedTuple):  # made per token per step: 4x cheaper than a frozen dataclass
    """Compute ``num_tokens`` tokens of ``seq`` from position ``start`` in the next forward."""

    seq: Sequence
    start: int
    num_tokens: int
    fed: bool = False  # one token, the in-flight one, fed from the device

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token: its logits give the next token."""
        return self.fed or self.start + self.num_tokens == len(self.seq.token_ids)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = flag(256, "running sequences per step at most")
    max_num_batched_tokens: int = flag(8192, "tokens per forward pass (decodes + prefill chunks)")
    prefill_interval: int = flag(
        1,
        "while sequences decode, prompt chunks join a step only if the N-1 steps "
        "before it had none: most decode steps then carry no prompt (a lower median "
        "inter-token latency, for a later first token; 1: prompts join every step). For "
        "models the GPU bounds; pair it with --max-num-batched-tokens equal to "
        "--cuda-graph-max-tokens, so the gathered prompts still replay CUDA graphs",
    )

    priority_aging: int = flag(
        1024,
        "a request's 'priority' (lower first, vLLM's semantics) counts as this many places in "
        "the line of arrivals per unit: a request is overtaken by at most this many times the "
        "difference of priorities of those that arrived after it (the bound on starvation)",
    )

    read_ahead: int = flag(
        0,
        "requests a worker reads from Redis beyond --max-num-seqs, held waiting (no KV) in "
        "the scheduler's order: a request of a lower 'priority' value that arrives under an "
        "overload of requests then starts at the next free place instead of behind those read "
        "before it. 0: a worker reads only what it can run (several workers of one pool share "
        "its queue evenly)",
    )

    def __post_init__(self) -> None:
        at_least_one = ("max_num_seqs", "max_num_batched_tokens", "prefill_interval")
        for name in (*at_least_one, "priority_aging"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.read_ahead < 0:
            raise ValueError("--read-ahead must be at least 0")

    @property
    def max_held(self) -> int:
        """Requests a worker holds at most: those it runs and those it read ahead."""
        return self.max_num_seqs + self.read_ahead


class Scheduler:
    """Policy over the sequences it is handed (their one map is
    ``compute.batch.registry.Requests``): which run next and how far, which are placed, which one is
    preempted; and the transitions of a sequence's counts, which only it writes."""

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._arrivals = 0  # sequences handed so far
        self._steps_without_prompt = config.prefill_interval  # the first step may take prompts
        self.held_steps = 0  # steps whose pending prompts waited for the interval, a counter

    # ------------------------------------------------------------------ a new sequence
    def new_sequence(
        self,
        seq_id: str,
        prompt: list[int],
        generated: Iterable[int] = (),
        max_tokens: int | None = None,
        priority: int = 0,
    ) -> Sequence:
        """A sequence waiting to be admitted, the latest arrival (``generated``: tokens it
        already produced, when a worker takes over the request of a dead one; ``max_tokens``:
        its output limit; ``priority``: lower goes first, see the module's docstring)."""
        if not prompt:
            raise ValueError("a sequence needs at least one prompt token")
        rank = self._arrivals + priority * self.config.priority_aging
        seq = Sequence(seq_id, rank, [*prompt, *generated], len(prompt))
        if max_tokens is not None:
            seq.max_len = len(prompt) + max_tokens
        self._arrivals += 1
        return seq

    # ------------------------------------------------------------------ decisions
    def schedule(self, seqs: Iterable[Sequence]) -> list[Chunk]:
        """The next forward pass over ``seqs``: decodes first, then prefill chunks, within the
        token budget (prefill chunks beside decodes only every ``prefill_interval`` steps).
        Call once per step launched: it counts the steps since the last one with prompt
        tokens."""
        budget = self.config.max_num_batched_tokens
        chunks: list[Chunk] = []
        everyone = running(seqs)
        pending = [s for s in everyone if s.num_pending > 0]
        for seq in everyone:
            if budget > 0 and seq.can_feed(self.block_size):
                chunks.append(Chunk(seq, seq.num_computed, 1, fed=True))
                budget -= 1
        decodes = [s for s in pending if s.num_pending == 1]
        prompts = [s for s in pending if s.num_pending > 1]
        interval = self.config.prefill_interval
        if prompts and (chunks or decodes) and self._steps_without_prompt + 1 < interval:
            prompts = []  # they join a later step
            self.held_steps += 1
        before_prompts = len(chunks) + len(decodes)  # decodes first: any chunk past is a prompt's
        for seq in decodes + prompts:
            if budget == 0:
                break
            n = min(seq.num_pending, budget)
            end = seq.num_computed + n
            assert -(-end // self.block_size) <= len(seq.block_ids), (
                f"{seq.seq_id}: {len(seq.block_ids)} blocks cannot hold {end} tokens"
            )
            chunks.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        if chunks:
            prompted = len(chunks) > before_prompts
            self._steps_without_prompt = 0 if prompted else self._steps_without_prompt + 1
        return chunks

    def to_place(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """Those of ``seqs`` to admit or resume at the kvstore now: lowest rank first (a
        preempted one before a new one at a tie), while running sequences stay under
        ``max_num_seqs``. A preempted sequence
        that a launched step still computes waits until that step is processed (its work went
        to the blocks it lost, and must not count once it is placed again)."""
        seqs = list(seqs)
        room = self.config.max_num_seqs - len(running(seqs))
        preempted = [s for s in in_rank(seqs, SeqStatus.PREEMPTED) if not s.launched_chunks]
        waiting = in_rank(seqs, SeqStatus.WAITING)
        candidates = sorted(preempted + waiting, key=_rank)  # stable: preempted first at a tie
        return candidates[: max(room, 0)]

    def victim(self, seqs: Iterable[Sequence]) -> Sequence | None:
        """The running sequence of ``seqs`` to preempt when the kvstore has no block left: the
        latest."""
        everyone = running(seqs)
        return everyone[-1] if everyone else None

    # ------------------------------------------------------------------ kvstore replies
    def placed(
        self, seq: Sequence, block_ids: list[int], num_computed: int, num_tokens: int
    ) -> None:
        """Admitted, resumed or adopted: the kvstore's table for its ``num_tokens`` tokens (the
        prompt at admission; what it held at preemption on resume); compute from
        ``num_computed``."""
        assert num_tokens <= len(seq.token_ids), f"{seq.seq_id}: the kvstore knows more tokens"
        seq.block_ids = list(block_ids)
        seq.num_computed = seq.num_done = num_computed
        seq.num_reported = num_tokens
        seq.status = SeqStatus.RUNNING

    def reported(self, seq: Sequence, num_tokens: int) -> None:
        """The kvstore accepted an append that brought its tokens to ``num_tokens`` (with or
        without a table change; tokens sampled since the append stay unreported)."""
        assert seq.num_reported <= num_tokens <= len(seq.token_ids), f"{seq.seq_id}: reported"
        seq.num_reported = num_tokens

    def grown(
        self, seq: Sequence, new_block_ids: list[int], copies: list[tuple[int, int, int]]
    ) -> list[tuple[int, int]]:
        """An append changed the table: replaces copied blocks, appends new ones. Returns the
        ``(src, dst)`` copies the worker must perform before its next forward."""
        for position, src, dst in copies:
            assert seq.block_ids[position] == src, f"{seq.seq_id}: block {position} is not {src}"
            seq.block_ids[position] = dst
        seq.block_ids.extend(new_block_ids)
        return [(src, dst) for _, src, dst in copies]

    def launched(self, chunk: Chunk, sampling: bool, feedable: bool) -> None:
        """A step computing ``chunk`` is on the device. ``sampling``: a token is drawn from its
        logits there (it is in flight until ``sampled``); ``feedable``: that token may feed the
        sequence's next step (one draw for the sequence, nothing the host must see first)."""
        seq = chunk.seq
        assert seq.num_computed == chunk.start, f"{seq.seq_id}: computed twice"
        assert not sampling or chunk.samples, f"{seq.seq_id}: sampled mid-prompt"
        assert chunk.fed or chunk.start + chunk.num_tokens <= seq.num_reported, (
            f"{seq.seq_id}: computed tokens the kvstore does not know"
        )
        seq.num_computed = chunk.start + chunk.num_tokens
        seq.launched_chunks += 1
        if sampling:
            seq.inflight += 1
            seq.feedable = feedable

    def processed(self, chunk: Chunk) -> None:
        """The step that computed ``chunk`` finished: its KV is written (unless the sequence
        lost its blocks since, to a preemption or its end)."""
        seq = chunk.seq
        seq.launched_chunks -= 1
        if seq.status is SeqStatus.RUNNING:
            seq.num_done = max(seq.num_done, chunk.start + chunk.num_tokens)

    def sampled(self, seq: Sequence, token: int) -> None:
        """An in-flight token reached the host: it joins the sequence."""
        assert seq.inflight > 0, f"{seq.seq_id}: no token in flight"
        seq.inflight -= 1
        seq.token_ids.append(token)

    def append_sampled(self, seq: Sequence, token: int) -> None:
        """A token chosen after the sequence's forward, in a later call than ``computed`` (beam
        search waits for every beam's logits): it joins the sequence, which had nothing
        pending."""
        assert seq.num_computed == seq.num_reported == len(seq.token_ids) and not seq.inflight, (
            f"{seq.seq_id}: tokens pending"
        )
        seq.token_ids.append(token)

    def fork(self, parent: Sequence, child_id: str, first_token: int) -> Sequence:
        """A sibling of ``parent`` (n > 1, beams), mirroring the kvstore's fork in the same
        step: it shares the parent's blocks and reported tokens, then has its own
        ``first_token`` (unreported: the step's append brings the copy-on-write of the shared
        last block). Call right after the parent's token was sampled, before it is reported."""
        assert (
            parent.status is SeqStatus.RUNNING and parent.num_reported == len(parent.token_ids) - 1
        ), f"{parent.seq_id}: fork right after sampling its first token"
        return Sequence(
            child_id,
            parent.rank,
            [*parent.token_ids[: parent.num_reported], first_token],
            parent.num_prompt,
            SeqStatus.RUNNING,
            max_len=parent.max_len,
            num_computed=parent.num_computed,
            num_done=parent.num_done,
            num_reported=parent.num_reported,
            block_ids=list(parent.block_ids),
        )

    def preempted(self, seq: Sequence) -> None:
        """The kvstore took the blocks back (swap or recompute); the KV must be placed again.
        Unreported tokens stay: after the resume, the next append reports them."""
        seq.status, seq.block_ids, seq.num_computed, seq.num_done = SeqStatus.PREEMPTED, [], 0, 0

    def finish(self, seq: Sequence) -> None:
        """The sequence ended (the caller forgets it and frees it at the kvstore): no step it
        is in any more counts its work."""
        seq.status = SeqStatus.FINISHED


def in_rank(seqs: Iterable[Sequence], *statuses: SeqStatus) -> list[Sequence]:
    """Those of ``seqs`` in one of ``statuses``, lowest ``rank`` (oldest, or of a lower
    priority value) first."""
    return sorted((s for s in seqs if s.status in statuses), key=_rank)


def running(seqs: Iterable[Sequence]) -> list[Sequence]:
    """The running ones of ``seqs``, lowest rank first."""
    return in_rank(seqs, SeqStatus.RUNNING)


def _rank(seq: Sequence) -> int:
    return seq.rank
