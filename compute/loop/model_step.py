"""The engine's model work, overlapped with its host work: ``ModelStep``.

``launch`` plans a step (``Scheduler.schedule``), packs it, enqueues its forward and its token
draw, the ids copied to pinned host memory, without waiting (``compute.loop.launched``).
``collect`` processes the step launched before: it waits for its ids, does its host work (tokens
join their sequences, stops and detokenization, forks, ends) and returns the records with what
the kvstore must hear (``Processed``). On the CPU the forward runs inside ``launch``.

The engine launches step N+1 before it processes step N, so the host's work on step N (and the
kvstore and Redis traffic after it) runs while the device computes step N+1. A sequence whose
token of step N is still on the device runs its decode in step N+1 with that token gathered on
the device from step N's draw (the scheduler's ``fed`` chunks). The lag has consequences, each
handled here:

* a sequence that stops at step N (EOS, a stop string) may compute one more token in step N+1,
  dropped when N+1 is processed; ``max_tokens`` is known ahead: never fed past;
* a sequence's blocks may be written by a launched step until it is processed: a sequence that
  ends is freed at the kvstore only after the step in flight when it ended is processed
  (``free_later``), and a preemption waits for the device first, after the copy-on-write
  copies owed are made (``settle``);
* a step whose host work needs its logits (beam search reads them) or forks branches (a first
  token that fans out to ``n``) is processed at once, before the next launch and any kvstore
  call (``Launched.sync``); a sequence that fans out is not ``feedable``: its forks must reach
  the kvstore before it writes its shared last block.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from compute.batch.logprobs import Logprobs, split_prompt_rows
from compute.batch.registry import Requests
from compute.batch.requests import Active, Branch, output_record
from compute.batch.scheduler import Chunk, SeqStatus
from compute.faults import Faults
from compute.loop.kvsync import final_item
from compute.loop.launched import (
    Drawing,
    Launched,
    Processed,
    Row,
    collector,
    draw,
    feed,
    scheduled,
)
from compute.loop.timeline import PathTotals
from compute.model.runner import ModelRunner
from compute.sampling.penalties import ProcessedRow
from compute.sampling.sampling import RowState
from contracts.records import OutputRecord, SamplingParams
from kvstore import protocol as p

__all__ = ["Launched", "ModelStep", "Processed"]

log = logging.getLogger("pagedserve.compute")


class ModelStep:
    """Owns the launched steps not processed yet: the one in flight (``launch`` puts it on the
    device) and the one before it, which ``collect`` processes; one per engine session."""

    def __init__(
        self,
        runner: ModelRunner,
        requests: Requests,
        decode: Callable[[Sequence[int]], str],
        phase_s: Mapping[str, float],
        faults: Faults,
        free: Callable[[list[str]], None],
        owed_copies: Callable[[], list[tuple[int, int]]],
    ) -> None:
        """``phase_s``: the phase totals of the session before, to go on from (copied);
        ``faults``: the per-request fault boundaries (``compute.faults``) in which each
        request's own work runs; a request that fails there draws nothing more and is skipped
        until the engine ends it. ``free``: frees ended sequences at the kvstore with its next
        Step (``KVSync.free``), called once no launched step writes them; ``owed_copies``: the
        copy-on-write copies the kvstore asked for, which the runner makes before its next
        forward (``KVSync.take_copies``)."""
        self.runner = runner
        self.requests = requests
        self.scheduler = requests.scheduler
        self.decode = decode
        self._free = free
        self._owed_copies = owed_copies
        self._inflight: Launched | None = None  # the step launched last, on the device
        self._earlier: Launched | None = None  # the one before it, for ``collect``
        # host seconds per part of launch (plan, forward: pack and enqueue, draw: enqueue the
        # sampling) and of process (wait: for the device), which the engine's timeline reads
        self.phase_s = dict(phase_s)
        self.tokens_computed = 0  # tokens run through the model (prefill + decode), a counter
        self.tokens_fed = 0  # of those, tokens fed from the device (overlapped decodes)
        self.device_s = 0.0  # device seconds of processed steps (CUDA), a counter
        self.by_path = PathTotals()  # the same, per forward path
        self.faults = faults

    @property
    def on_device(self) -> bool:
        """Whether a launched step is not processed yet."""
        return self._inflight is not None or self._earlier is not None

    @property
    def overlapped(self) -> bool:
        """Whether the step launched last computes while the host works (it is not ``sync``)."""
        return self._inflight is not None and not self._inflight.sync

    # ------------------------------------------------------------------ the lag
    def launch(self) -> None:
        """Launches the next step, if anything can run; the one in flight becomes ``collect``'s."""
        assert self._earlier is None, "the step before was not collected"
        launched = self._launch()
        self._earlier, self._inflight = self._inflight, launched

    def collect(self, reply: Callable[[], None]) -> Processed:
        """Processes the step launched before the last ``launch``, then the last one if it is
        ``sync`` (processed at once, before the next launch and any kvstore call). ``reply``
        (the kvstore's reply to the last Step, taken in) runs while the device still computes
        what may be preempted: before this host work when the step launched last overlaps it,
        else after it (nothing on the device; a sync step: its forks are off sequences that
        must still be running)."""
        earlier, self._earlier = self._earlier, None
        overlapped = self.overlapped
        if overlapped:
            reply()
        outputs = [self._process(earlier)] if earlier is not None else []
        if self._inflight is not None and self._inflight.sync:
            launched, self._inflight = self._inflight, None
            outputs.append(self._process(launched))
        if not overlapped:
            reply()
        return Processed.merged(outputs) if outputs else Processed()

    # ------------------------------------------------------------------ launching
    def _launch(self) -> Launched | None:
        """Plans and enqueues the next step; None when nothing can run. Mutates the scheduler
        (``launched``: computed counts, in-flight tokens), never waits for the device."""
        clock = time.perf_counter()
        chunks = self.scheduler.schedule(self.requests.sequences())
        if not chunks:
            return None
        clock = self._phase("plan", clock)
        cuda = self.runner.device.type == "cuda"
        events = None
        if cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        copies = self._owed_copies()
        self.runner.copy_blocks(copies)
        collects = [collector(c, self.requests) for c in chunks]
        pairs = zip(chunks, collects, strict=True)
        inputs = [scheduled(c, a is not None) for c, a in pairs]
        logits = self.runner.forward(inputs, feed(chunks, self._inflight))
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
            drawing = Drawing(rows, states, processed, guided)
            source = self._inflight
            sampled, host, logprobs = draw(logits, chunks, drawing, source, self.faults, cuda)
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
        generated = chunk.seq.num_generated + chunk.seq.inflight  # the position being drawn
        fan_out = params.n if generated == 0 and branch.index == 0 else 1
        made: list[tuple[Row, RowState, ProcessedRow | None]] = []
        for k in range(branch.index, branch.index + fan_out):
            processed = None
            if active.processed:
                at = first + len(made)
                processed = self._processed_row(at, chunk, params, generated, branch)
            row = Row(i, active, k, forks=k != branch.index)
            made.append((row, RowState(params, k, generated), processed))
        return made

    def _processed_row(
        self, row: int, chunk: Chunk, params: SamplingParams, generated: int, branch: Branch
    ) -> ProcessedRow:
        """What ``compute.sampling.penalties`` reads of a row drawing ``chunk``'s sequence's next
        token: its tokens (the newest one still on the device if the chunk is fed) and, while under
        ``min_tokens``, its stop ids to mask."""
        seq = chunk.seq
        fed = self._inflight.row_of[seq.seq_id] if chunk.fed and self._inflight else -1
        banned = sorted(branch.stop.stop_token_ids) if generated < params.min_tokens else []
        prompt, output = seq.token_ids[: seq.num_prompt], seq.token_ids[seq.num_prompt :]
        return ProcessedRow(row, params, prompt, output, fed, banned)

    # ------------------------------------------------------------------ processing
    def _process(self, launched: Launched) -> Processed:
        """Waits for ``launched`` and does its host work. Mutates the scheduler and requests
        (tokens, forks, ends); returns the forks and ends for the kvstore with the records, and
        frees what ended (``free_later``: a later launched step may still write it)."""
        clock = time.perf_counter()
        tokens = launched.wait()
        clock = self._phase("wait", clock)
        prompt = launched.prompt
        if prompt is not None:  # before the first records, which carry them
            prompt.store_each(self.faults)
        device_s = launched.device_ms() / 1e3
        self.device_s += device_s
        self.by_path.add(launched.path, device_s, launched.num_tokens)
        self._free(launched.frees_after)  # nothing on the device writes them now
        for chunk in launched.chunks:
            self.scheduler.processed(chunk)
        live = [
            (i, row, token)
            for i, (row, token) in enumerate(zip(launched.rows, tokens, strict=True))
            if self._live(launched.chunks[row.chunk])  # else it ended while this ran
        ]
        for _, row, token in live:
            if row.forks:  # counted before any branch can finish: ``final`` stays right
                row.active.branch_started()
            else:
                self.scheduler.sampled(launched.chunks[row.chunk].seq, token)
        records: list[OutputRecord] = []
        frees: list[str] = []
        forks: dict[str, list[str]] = {}  # parent -> children, for the kvstore
        finals: list[p.AppendItem] = []  # ended sequences' last progress, for the kvstore
        for i, row, token in live:
            req_id = row.active.record.req_id
            if not self.faults.failed(req_id):
                try:
                    record = self._take(row, token, launched.logprobs, i, frees, finals, forks)
                    records.append(record)
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
                    records += self._beam_round(search, frees, forks)
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
        computed = {c.seq.seq_id for c in launched.chunks}  # and its copies are complete now
        return Processed(records, done, computed, forks, finals, launched.copied)

    def _take(
        self,
        row: Row,
        token: int,
        logprobs: Logprobs | None,
        at: int,
        frees: list[str],
        finals: list[p.AppendItem],
        forks: dict[str, list[str]],
    ) -> OutputRecord:
        """Row ``at``'s drawn ``token`` joins its branch (forked now if the row forks): its
        grammar and stop checker take it; a branch it ends goes to ``frees`` (and its last
        progress to ``finals``), a fork that goes on to ``forks``. Its record."""
        active, k = row.active, row.branch
        branch = self.requests.fork_branch(active, k, token) if row.forks else active.branches[k]
        seq = branch.seq  # has the token already (``Scheduler.sampled``, or the fork's first)
        offset = seq.num_generated - 1
        if not branch.accept(offset, token):
            log.error("%s: token %d outside its grammar", seq.seq_id, token)
        update = branch.stop.append(token, last=seq.last_allowed(offset))
        if update.finish_reason is not None:
            active.branch_ended()
            if row.forks:  # it ends where it starts: the kvstore never needs to know it
                self.requests.finish(seq.seq_id)
            else:
                frees.append(seq.seq_id)
                finals.append(final_item(seq))
        elif row.forks:
            parent = active.branches[0].seq.seq_id
            forks.setdefault(parent, []).append(seq.seq_id)
        logprob = logprobs.of(at) if logprobs is not None else None
        reason, text, final = update.finish_reason, update.text, active.live == 0
        listed = None if logprob is None else [logprob]
        return output_record(active, k, [token], reason, final, text, offset, logprobs=listed)

    def _live(self, chunk: Chunk) -> bool:
        return chunk.seq.status is not SeqStatus.FINISHED

    def _beam_round(
        self, active: Active, frees: list[str], forks: dict[str, list[str]]
    ) -> list[OutputRecord]:
        """Advances a beam search whose live beams all have their logits; adds the sequences
        it drops to ``frees``, those it forks to ``forks``. Once it is done, the request's n
        best hypotheses."""
        beams = active.beams
        assert beams is not None
        if not beams.ready():
            return []
        round_ = beams.advance(self.scheduler)
        frees += round_.frees
        for parent, children in round_.forks.items():
            forks.setdefault(parent, []).extend(children)
        self.requests.add_beams(active)
        if not beams.done:
            return []
        active.search_ended()
        best = beams.best(active.record.params.n, self.decode)
        return [
            output_record(active, k, tokens, reason, k == len(best) - 1, text)
            for k, (tokens, reason, text) in enumerate(best)
        ]

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_s[name] = self.phase_s.get(name, 0.0) + now - since
        return now

    # ------------------------------------------------------------------ the lag's rules
    def free_later(self, seq_ids: list[str]) -> None:
        """Frees these ended sequences at the kvstore once no launched step can write their
        blocks: after the step in flight is processed, or in the next kvstore call."""
        if self._inflight is not None:
            self._inflight.free_after(seq_ids)
        else:
            self._free(seq_ids)

    def settle(self) -> list[int]:
        """Makes the copy-on-write copies the kvstore asked for now, then waits until the
        device finished them and every launched step. Returns the copies' destinations."""
        copies = self._owed_copies()
        self.runner.copy_blocks(copies)
        self.quiesce()
        if copies and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        return [dst for _, dst in copies]

    def quiesce(self) -> None:
        """Waits until the device finished every launched step."""
        if self._inflight is not None and self._inflight.events is not None:
            self._inflight.events[1].synchronize()

    def drop(self) -> None:
        """Forgets the steps not processed, after the device finished them (the engine
        rebuilds its state; the pool may be unmapped next)."""
        try:
            self.quiesce()
        finally:
            self._inflight = self._earlier = None
