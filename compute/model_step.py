"""The engine's model work, overlapped with its host work: ``ModelStep``.

``launch`` plans a step (``Scheduler.schedule``), packs it, and enqueues its forward pass and its
token draw on the device, with the drawn ids copied to pinned host memory; it returns without
waiting (``Launched``). ``process`` waits for a launched step's ids and does its host work: the
tokens join their sequences, stop conditions and detokenization run, branches fork, finished
sequences end, and the step's output records come back for publishing.

The engine launches step N+1 before it processes step N, so the host's work on step N (and the
kvstore and Redis traffic after it) runs while the device computes step N+1. A sequence whose
token of step N is still on the device runs its decode in step N+1 with that token gathered on
the device from step N's draw (the scheduler's ``fed`` chunks). The lag has consequences, each
handled here:

* a sequence that stops at step N (EOS, a stop string) may have computed one more token in step
  N+1: that token is dropped when step N+1 is processed (the sequence is gone by then);
  ``max_tokens`` is known ahead, so the scheduler never feeds a sequence past it;
* a sequence's blocks may be written by a launched step until it is processed: a sequence that
  ends is freed at the kvstore only after the step in flight when it ended is processed
  (``free_later``), and a preemption waits for the device first, after the copy-on-write
  copies owed are made (``settle``);
* a step whose host work needs its logits (beam search reads them) or forks branches (a first
  token that fans out to ``n``) is processed at once, before the next launch and any kvstore
  call (``Launched.sync``); a sequence that fans out is not ``feedable``: its forks must reach
  the kvstore before it writes its shared last block.

On the CPU the forward pass runs synchronously inside ``launch``; the bookkeeping is the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from llguidance import LLMatcher

from compute.faults import Faults
from compute.grammar import Masks
from compute.kvsync import KVSync
from compute.logprobs import Logprobs, PromptLogprobs, sampled_logprobs, split_prompt_rows
from compute.penalties import ProcessedRow, process_logits
from compute.registry import Requests
from compute.requests import Active, Branch, output_record
from compute.runner import Feed, ForwardPath, ModelRunner, ScheduledChunk
from compute.sampling import RowState, sample
from compute.scheduler import Chunk
from compute.stops import StopChecker
from compute.timeline import PathTotals
from compute.transfer import to_device
from contracts.records import OutputRecord, SamplingParams

__all__ = ["Launched", "ModelStep", "Processed"]

log = logging.getLogger("pagedserve.compute")


class Row(NamedTuple):  # made per token per step: 4x cheaper than a frozen dataclass
    """One drawn token of a launched step: chunk ``chunk``'s, for branch ``branch``."""

    chunk: int
    active: Active
    branch: int  # the branch's index in its request (not ``index``: a tuple's method)
    forks: bool  # a new branch, forked from branch 0 at its first token


@dataclass
class Launched:
    """A step on the device: what it computes and where its drawn ids arrive."""

    chunks: list[Chunk]
    rows: list[Row]
    row_of: dict[str, int]  # sequence id -> the row of its own next token
    sampled: torch.Tensor | None  # [R] int64 on the device
    host: torch.Tensor | None  # [R] int64, pinned: ``sampled`` copied back
    logits: torch.Tensor  # [chunks, vocab]: read only by a ``sync`` step's processing
    beams: list[int]  # chunks of beam searches (their logits are read when processed)
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None  # around the device work
    logprobs: Logprobs | None = None  # of the rows whose request asked for them
    prompt: PromptLogprobs | None = None  # of the prompt tokens of chunks that collect them
    frees_after: list[str] = field(default_factory=list)  # to free once this is processed
    copied: list[int] = field(default_factory=list)  # copy-on-write destinations it wrote first
    path: ForwardPath = "eager"  # how its forward ran
    num_tokens: int = 0  # computed (prompt and decode)

    @property
    def sync(self) -> bool:
        """Processed right after its launch, before any kvstore call: its processing reads
        ``logits`` (beam search) or forks branches off sequences that must still be running."""
        return bool(self.beams) or any(row.forks for row in self.rows)

    def wait(self) -> list[int]:
        """Blocks until the device finished the step; its drawn ids."""
        if self.events is not None:
            self.events[1].synchronize()
        return [] if self.host is None else self.host.tolist()

    def device_ms(self) -> float:
        """Device time from the step's first kernel to its last (after ``wait``)."""
        return self.events[0].elapsed_time(self.events[1]) if self.events else 0.0


@dataclass(frozen=True)
class Processed:
    """What processing a step produced."""

    records: list[OutputRecord]
    done: list[Active]  # requests that finished (every branch ended)
    computed: set[str]  # sequences whose KV the step wrote


class ModelStep:
    """Owns the launched step not processed yet (``inflight``); one per engine state."""

    def __init__(
        self,
        runner: ModelRunner,
        requests: Requests,
        kvsync: KVSync,
        decode: Callable[[Sequence[int]], str],
        phase_s: dict[str, float],
        faults: Faults,
    ) -> None:
        """``faults``: the per-request fault boundaries (``compute.faults``) in which each
        request's own work runs; a request that fails there draws nothing more and is skipped
        until the engine ends it."""
        self.runner = runner
        self.requests = requests
        self.scheduler = requests.scheduler
        self.kvsync = kvsync
        self.decode = decode
        self.inflight: Launched | None = None
        # host seconds per part of launch (plan, forward: pack and enqueue, draw: enqueue the
        # sampling) and of process (wait: for the device), added to the engine's timeline
        self.phase_s = phase_s
        self.tokens_computed = 0  # tokens run through the model (prefill + decode), a counter
        self.tokens_fed = 0  # of those, tokens fed from the device (overlapped decodes)
        self.device_s = 0.0  # device seconds of processed steps (CUDA), a counter
        self.by_path = PathTotals()  # the same, per forward path
        self.faults = faults
        kvsync.quiesce = self.settle

    # ------------------------------------------------------------------ launching
    def launch(self) -> Launched | None:
        """Plans and enqueues the next step; None when nothing can run. Mutates the scheduler
        (``launched``: computed counts, in-flight tokens), never waits for the device."""
        clock = time.perf_counter()
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        clock = self._phase("plan", clock)
        cuda = self.runner.device.type == "cuda"
        events = None
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        copies, self.kvsync.copies = self.kvsync.copies, []
        self.runner.copy_blocks(copies)
        collects = [self._collector(c) for c in chunks]
        pairs = zip(chunks, collects, strict=True)
        scheduled = [self._scheduled(c, a is not None) for c, a in pairs]
        logits = self.runner.forward(scheduled, self._feed(chunks))
        prompt = None
        if any(collects):  # logits of every row of those chunks: split them off
            logits, prompt = split_prompt_rows(chunks, collects, logits)
        num_tokens = sum(c.num_tokens for c in chunks)
        self.tokens_computed += num_tokens
        self.tokens_fed += sum(c.fed for c in chunks)
        clock = self._phase("forward", clock)
        rows: list[Row] = []
        states: list[RowState] = []
        processed: list[ProcessedRow] = []
        row_of: dict[str, int] = {}
        beams: list[int] = []
        guided: list[int] = []  # rows whose grammar masks them
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            if not chunk.samples or self.requests.beam_search(seq.seq_id) is not None:
                if chunk.samples:
                    beams.append(i)
                self.scheduler.launched(chunk, sampling=False, feedable=False)
                continue
            found = self.requests.branch(seq.seq_id)
            assert found is not None, f"{seq.seq_id}: a chunk of no branch"
            active, branch = found
            made: list[tuple[Row, RowState, ProcessedRow | None]] = []
            req_id = active.record.req_id
            if not self.faults.failed(req_id):
                try:
                    made = self._rows(i, chunk, active, branch, len(rows))
                except Exception as err:
                    self.faults.record(req_id, "preparing its sampling", err)
            if made:
                row_of[seq.seq_id] = len(rows)
            for row, state, processed_row in made:
                if processed_row is not None:
                    processed.append(processed_row)
                if branch.matcher is not None:  # the fan-out's rows share branch 0's state
                    guided.append(len(rows))
                rows.append(row)
                states.append(state)
            self.scheduler.launched(chunk, sampling=bool(made), feedable=len(made) == 1)
        sampled = host = logprobs = None
        if rows:
            index = [r.chunk for r in rows]
            drawn = logits  # one row per chunk, in order: no gather
            if index != list(range(len(chunks))):
                drawn = logits[to_device(index, logits.device)]  # [R, vocab]
            raw = drawn
            if processed:
                source = self.inflight.sampled if self.inflight is not None else None
                drawn = process_logits(drawn.float(), processed, source)
            if guided:
                drawn = self._masked(drawn, [rows[r] for r in guided], guided, chunks)
            sampled = sample(drawn, states).token_ids  # [R]
            logprobs = sampled_logprobs(raw, sampled, [row.active.record.params for row in rows])
            host = sampled
            if cuda:
                host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
                host.copy_(sampled, non_blocking=True)
        if events is not None:
            events[1].record()
        self._phase("draw", clock)
        return Launched(
            chunks, rows, row_of, sampled, host, logits, beams, events, logprobs, prompt,
            path=self.runner.last_path, num_tokens=num_tokens, copied=[d for _, d in copies],
        )  # fmt: skip

    def _rows(
        self, i: int, chunk: Chunk, active: Active, branch: Branch, first: int
    ) -> list[tuple[Row, RowState, ProcessedRow | None]]:
        """The rows that draw chunk ``i``'s next token(s): one, or ``n`` at a request's first
        token (the branches beyond the first fork there), numbered from ``first``."""
        params = active.record.params
        generated = branch.stop.num_generated + chunk.seq.inflight  # the position being drawn
        fan_out = params.n if generated == 0 and branch.index == 0 else 1
        made: list[tuple[Row, RowState, ProcessedRow | None]] = []
        for k in range(branch.index, branch.index + fan_out):
            processed = None
            if active.processed:
                at = first + len(made)
                processed = self._processed_row(at, chunk, params, generated, branch.stop)
            row = Row(i, active, k, forks=k != branch.index)
            made.append((row, RowState(params, k, generated), processed))
        return made

    def _masked(
        self, logits: torch.Tensor, rows: list[Row], at: list[int], chunks: list[Chunk]
    ) -> torch.Tensor:
        """``logits`` with the guided ``rows`` (at rows ``at``) masked to what their grammars
        allow next; each row's matcher work runs in its request's fault boundary."""
        self._catch_up(rows, chunks)
        masks = Masks(at, logits.shape[1], logits.device)
        for k, row in enumerate(rows):
            req_id = row.active.record.req_id
            if not self.faults.failed(req_id):
                with self.faults.guard(req_id, "masking its grammar"):
                    masks.fill(k, self._matcher(row))
        return masks.apply(logits)

    def _catch_up(self, rows: list[Row], chunks: list[Chunk]) -> None:
        """Guided rows of fed chunks draw after a token of the step in flight that their
        matcher has not seen: waits for that step's ids (the device runs this step's forward
        meanwhile) and lets each matcher accept its token, ahead of that step's processing."""
        late = [row for row in rows if chunks[row.chunk].fed]
        source = self.inflight
        if not late or source is None:
            return
        tokens = source.wait()
        for row in late:
            branch = row.active.branches[row.branch]
            token = tokens[source.row_of[branch.seq.seq_id]]
            req_id = row.active.record.req_id
            if self.faults.failed(req_id):
                continue
            with self.faults.guard(req_id, "masking its grammar"):
                if not branch.accept(branch.stop.num_generated, token):
                    log.error("%s: token %d outside its grammar", branch.seq.seq_id, token)

    @staticmethod
    def _matcher(row: Row) -> LLMatcher:
        """The grammar state a guided row draws from: its branch's (branch 0's for a branch
        forked at this token: they share every token before it)."""
        branches = row.active.branches
        matcher = branches[0 if row.forks else row.branch].matcher
        assert matcher is not None, "a guided row of no grammar"
        return matcher

    def _collector(self, chunk: Chunk) -> Active | None:
        """The request collecting prompt logprobs that ``chunk`` computes some of, if any."""
        seq = chunk.seq
        if chunk.fed or chunk.start >= seq.num_prompt - 1:  # no prompt token to predict
            return None
        found = self.requests.branch(seq.seq_id)
        return found[0] if found is not None and found[0].prompt_logprobs is not None else None

    def _processed_row(
        self, row: int, chunk: Chunk, params: SamplingParams, generated: int, stop: StopChecker
    ) -> ProcessedRow:
        """What ``compute.penalties`` reads of a row drawing ``chunk``'s sequence's next token:
        its tokens (the newest one still on the device if the chunk is fed) and, while under
        ``min_tokens``, its stop ids to mask."""
        seq = chunk.seq
        fed = self.inflight.row_of[seq.seq_id] if chunk.fed and self.inflight else -1
        banned = sorted(stop.stop_token_ids) if generated < params.min_tokens else []
        prompt, output = seq.token_ids[: seq.num_prompt], seq.token_ids[seq.num_prompt :]
        return ProcessedRow(row, params, prompt, output, fed, banned)

    def _scheduled(self, chunk: Chunk, every_row: bool) -> ScheduledChunk:
        seq = chunk.seq
        tokens = [0] if chunk.fed else seq.token_ids[chunk.start : chunk.start + chunk.num_tokens]
        return ScheduledChunk(tokens, chunk.start, seq.block_ids, every_row, seq.seq_id)

    def _feed(self, chunks: list[Chunk]) -> Feed | None:
        """Where the fed chunks' tokens are: the in-flight step's draw."""
        fed = [i for i, c in enumerate(chunks) if c.fed]
        if not fed:
            return None
        source = self.inflight
        assert source is not None and source.sampled is not None, "a fed chunk of no step"
        rows = [source.row_of[chunks[i].seq.seq_id] for i in fed]
        return Feed(source.sampled, rows, fed)

    # ------------------------------------------------------------------ processing
    def process(self, launched: Launched) -> Processed:
        """Waits for ``launched`` and does its host work. Mutates the scheduler and requests
        (tokens, forks, ends), queues forks and frees at ``kvsync`` (frees of sequences a
        later launched step may still write wait for that step: ``free_later``)."""
        clock = time.perf_counter()
        tokens = launched.wait()
        clock = self._phase("wait", clock)
        prompt = launched.prompt
        if prompt is not None:  # before the first records, which carry them
            for i, collector in enumerate(prompt.owners):
                try:
                    prompt.store(i)
                except Exception as err:
                    self.faults.record(collector.record.req_id, "storing its prompt logprobs", err)
        device_s = launched.device_ms() / 1e3
        self.device_s += device_s
        self.by_path.add(launched.path, device_s, launched.num_tokens)
        self.kvsync.frees += launched.frees_after  # nothing on the device writes them now
        self.kvsync.copied += launched.copied  # the kvstore may trust their content now
        for chunk in launched.chunks:
            self.scheduler.processed(chunk)
        live = [
            (i, row, token)
            for i, (row, token) in enumerate(zip(launched.rows, tokens, strict=True))
            if self._live(launched.chunks[row.chunk])  # else it ended while this ran
        ]
        for _, row, token in live:
            if row.forks:  # counted before any branch can finish: ``final`` stays right
                row.active.live += 1
            else:
                self.scheduler.sampled(launched.chunks[row.chunk].seq, token)
        records: list[OutputRecord] = []
        frees: list[str] = []
        for i, row, token in live:
            req_id = row.active.record.req_id
            if not self.faults.failed(req_id):
                try:
                    records.append(self._take(row, token, launched.logprobs, i, frees))
                except Exception as err:
                    self.faults.record(req_id, "processing its token", err)
        searches: dict[str, Active] = {}
        for i in launched.beams:
            seq = launched.chunks[i].seq
            owner = self.requests.beam_search(seq.seq_id)
            if owner is not None and owner.beams is not None:
                owner.beams.computed(seq, launched.logits[i])
                searches[owner.record.req_id] = owner
        for req_id, search in searches.items():
            if not self.faults.failed(req_id):
                with self.faults.guard(req_id, "scoring its beams"):
                    records += self._beam_round(search, frees)
        for seq_id in frees:
            self.requests.finish(seq_id)
        self.free_later(frees)
        done = [
            a
            for a in self.requests.active.values()
            if a.live == 0 and not self.faults.failed(a.record.req_id)
        ]
        for active in done:
            self.requests.done(active)
        return Processed(records, done, {c.seq.seq_id for c in launched.chunks})

    def _take(
        self, row: Row, token: int, logprobs: Logprobs | None, at: int, frees: list[str]
    ) -> OutputRecord:
        """Row ``at``'s drawn ``token`` joins its branch (forked now if the row forks): its
        grammar and stop checker take it; a branch it ends goes to ``frees``. Its record."""
        active, k = row.active, row.branch
        branch = self.requests.fork_branch(active, k, token) if row.forks else active.branches[k]
        if not branch.accept(branch.stop.num_generated, token):
            log.error("%s: token %d outside its grammar", branch.seq.seq_id, token)
        update = branch.stop.append(token)
        if update.finish_reason is not None:
            active.live -= 1
            if row.forks:  # it ends where it starts: the kvstore never needs to know it
                self.requests.finish(branch.seq.seq_id)
            else:
                frees.append(branch.seq.seq_id)
                self.kvsync.ended(branch.seq)
        elif row.forks:
            parent = active.branches[0].seq.seq_id
            self.kvsync.forks.setdefault(parent, []).append(branch.seq.seq_id)
        logprob = logprobs.of(at) if logprobs is not None else None
        return output_record(
            active,
            k,
            [token],
            update.finish_reason,
            active.live == 0,
            update.text,
            branch.stop.num_generated - 1,
            logprobs=None if logprob is None else [logprob],
        )

    def _live(self, chunk: Chunk) -> bool:
        return self.scheduler.seqs.get(chunk.seq.seq_id) is chunk.seq

    def _beam_round(self, active: Active, frees: list[str]) -> list[OutputRecord]:
        """Advances a beam search whose live beams all have their logits; adds the sequences
        it drops to ``frees``. Once it is done, the request's n best hypotheses."""
        beams = active.beams
        assert beams is not None
        if not beams.ready():
            return []
        round_ = beams.advance(self.scheduler)
        frees += round_.frees
        for parent, children in round_.forks.items():
            self.kvsync.forks.setdefault(parent, []).extend(children)
            self.requests.add_beams(active, children)
        if not beams.done:
            return []
        active.live = 0
        best = beams.best(active.record.params.n, self.decode)
        return [
            output_record(active, k, tokens, reason, k == len(best) - 1, text)
            for k, (tokens, reason, text) in enumerate(best)
        ]

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_s[name] += now - since
        return now

    # ------------------------------------------------------------------ the lag's rules
    def free_later(self, seq_ids: list[str]) -> None:
        """Frees these ended sequences at the kvstore once no launched step can write their
        blocks: after the step in flight is processed, or in the next kvstore call."""
        if self.inflight is not None:
            self.inflight.frees_after += seq_ids
        else:
            self.kvsync.frees += seq_ids

    def settle(self) -> list[int]:
        """Makes the copy-on-write copies the kvstore asked for now, then waits until the
        device finished them and every launched step. Returns the copies' destinations."""
        copies, self.kvsync.copies = self.kvsync.copies, []
        self.runner.copy_blocks(copies)
        self.quiesce()
        if copies and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        return [dst for _, dst in copies]

    def quiesce(self) -> None:
        """Waits until the device finished every launched step."""
        if self.inflight is not None and self.inflight.events is not None:
            self.inflight.events[1].synchronize()

    def drop(self) -> None:
        """Forgets the step in flight, after the device finished it (the engine rebuilds its
        state; the pool may be unmapped next)."""
        try:
            self.quiesce()
        finally:
            self.inflight = None
