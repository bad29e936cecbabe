"""The compute worker's engine loop: Redis requests in, token deltas out, KV in the kvstore's pool.

One step (single-threaded):
1. take new requests from the Redis consumer group while there is room;
2. run one packed forward over the scheduler's chunks (decodes first, then prefill chunks),
   after performing the copy-on-write copies the kvstore asked for;
3. sample, check stop conditions;
4. one kvstore round trip: free finished sequences, report every running sequence's new tokens
   and computed count, resume/admit what fits; when the kvstore has no block for a running
   sequence, preempt the latest arrival (the kvstore's cost model picks swap or recompute) and
   retry, one more round trip each;
5. one Redis round trip: publish the deltas, ack finished requests, check for aborts.

``n > 1``: a request's first sampling row draws n tokens (one seeded stream per branch); the
branches beyond the first are forked from it at the kvstore in the same step (the prompt's blocks
shared, the last one copied on write) and stream under their own index.

The worker holds nothing that cannot be rebuilt: request state is in Redis (the request entry,
its output stream) and the KV blocks are the kvstore's. A live worker renews its claim on its
requests (``queue.touch``); the requests of a dead one are taken over (``queue.claim_stale``),
rebuilt from the tokens already streamed and ``adopt``ed at the kvstore, which keeps their
blocks for a grace period, so nothing is prefilled again (if the blocks are gone, it recomputes).
Not yet here: beam search (the bookkeeping is in ``compute.sampling.BeamSearch``), taking over
n > 1 requests (they fail with an error record), CUDA graphs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import redis
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.runner import ModelRunner, ScheduledChunk
from compute.sampling import RowState, StopChecker, sample
from compute.scheduler import Scheduler, SchedulerConfig, SeqStatus, Sequence
from gateway import queue
from kvstore import protocol as p
from kvstore.client import KVClient
from kvstore.device import map_pool

log = logging.getLogger("pagedserve.compute")


@dataclass
class Branch:
    """One of a request's n sequences (index 0 is the request's own kvstore request)."""

    index: int
    seq: Sequence
    stop: StopChecker


@dataclass
class Active:
    """A request this worker serves; its branches beyond the first are forked after the prompt."""

    entry_id: str
    record: queue.RequestRecord
    branches: list[Branch]
    live: int = 1  # branches not finished
    cached_tokens: int = 0
    adopt: bool = False  # taken over from a dead worker: adopt its kvstore request first


class Engine:
    def __init__(
        self,
        worker_id: str,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        kv: KVClient,
        r: redis.Redis,
        config: SchedulerConfig,
        prefill_profile: list[tuple[int, float]],
        claim_idle_ms: int = queue.CLAIM_IDLE_MS,
    ) -> None:
        """``claim_idle_ms``: a pending request untouched this long belongs to a dead worker and
        this one takes it over (live workers renew theirs every ``claim_idle_ms / 4``)."""
        self.worker_id = worker_id
        self.tokenizer = tokenizer
        self.kv = kv
        self.redis = r
        reply = kv.call(p.Register(worker_id, prefill_profile, str(model.device), os.getpid()))
        assert isinstance(reply, p.Registered)
        pool = map_pool(reply.pool)  # [blocks, layers, 2, block, kv_heads, d], shared
        if pool.device.type != model.device.type:
            raise RuntimeError(
                f"the kvstore's pool is on {pool.device.type}, the model on "
                f"{model.device.type}: start both on the same device"
            )
        self.runner = ModelRunner(model, pool, reply.pool.block_size)
        self.scheduler = Scheduler(config, reply.pool.block_size)
        self.active: dict[str, Active] = {}  # by request id
        self.branch_of: dict[str, tuple[Active, Branch]] = {}  # by sequence id
        self.forks: dict[str, list[str]] = {}  # parent -> children, for this step's kvstore call
        self.copies: list[tuple[int, int]] = []
        self.accepting = True  # takes new requests from Redis
        self.claim_idle_ms = claim_idle_ms
        self.tokens_computed = 0  # tokens run through the model (prefill + decode), a counter
        self._next_lease_check = 0.0
        eos = model.generation_config.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        queue.ensure_group(r)
        log.info(
            "worker %s: %d GPU blocks, block size %d",
            worker_id,
            reply.num_gpu_blocks,
            reply.pool.block_size,
        )

    # ------------------------------------------------------------------ the loop
    def step(self, block_ms: int | None = None) -> bool:
        """One engine step; False when there was nothing to do."""
        self._take_requests(block_ms if not self.active else None)
        records, finished, computed = self._forward_and_sample()
        done = self._kv_step(finished, computed)
        aborted = queue.step(self.redis, records, [a.entry_id for a in done], list(self.active))
        for req_id in aborted:
            self._end(self.active[req_id], "abort")
        return bool(self.active) or bool(records)

    def _take_requests(self, block_ms: int | None) -> None:
        room = self.scheduler.config.max_num_seqs - len(self.active)
        if time.monotonic() >= self._next_lease_check:
            self._next_lease_check = time.monotonic() + self.claim_idle_ms / 4000
            self._renew_leases()
            if room > 0 and self.accepting:
                for entry_id, record in queue.claim_stale(
                    self.redis, self.worker_id, self.claim_idle_ms, room
                ):
                    room -= self._take_over(entry_id, record)
        if room <= 0 or not self.accepting:
            return
        for entry_id, record in queue.read_requests(self.redis, self.worker_id, room, block_ms):
            seq = self.scheduler.add(record.req_id, record.prompt_token_ids)
            active = Active(entry_id, record, [])
            self.active[record.req_id] = active
            self._add_branch(active, seq)

    def _renew_leases(self) -> None:
        """Keeps other workers from taking over this one's requests (``queue.touch``)."""
        entries = {a.entry_id: req_id for req_id, a in self.active.items()}
        lost = set(entries) - set(queue.touch(self.redis, self.worker_id, list(entries)))
        for entry_id in lost:  # another worker serves it now
            log.warning("request %s was taken over by another worker", entries[entry_id])

    def _take_over(self, entry_id: str, record: queue.RequestRecord) -> int:
        """A dead worker's request: continue it from the tokens it already streamed, on the
        kvstore's blocks if they are still there (``adopt``). Returns 1 if it became active."""
        streamed = queue.read_streamed(self.redis, record.req_id)
        if streamed.final:  # it finished; only the ack was lost
            queue.ack(self.redis, [entry_id])
            return 0
        generated = streamed.sequences[0].token_ids if 0 in streamed.sequences else []
        if record.params.n > 1 and streamed.sequences:
            error = queue.OutputRecord(
                record.req_id,
                0,
                [],
                None,
                "error",
                "its worker died; n > 1 requests cannot resume yet",
                final=True,
            )
            queue.step(self.redis, [error], [entry_id])
            return 0
        log.info("taking over %s after %d streamed tokens", record.req_id, len(generated))
        seq = self.scheduler.add(record.req_id, record.prompt_token_ids, generated)
        active = Active(entry_id, record, [], adopt=True)
        self.active[record.req_id] = active
        branch = self._add_branch(active, seq)
        for token in generated:  # the stop checker and the seeded stream continue from here
            branch.stop.append(token)
        return 1

    def _add_branch(self, active: Active, seq: Sequence) -> Branch:
        record = active.record
        context = record.prompt_token_ids[-4:]
        stop = StopChecker(record.params, self.eos_ids, self.tokenizer.decode, context)
        branch = Branch(len(active.branches), seq, stop)
        active.branches.append(branch)
        self.branch_of[seq.seq_id] = (active, branch)
        return branch

    def _forward_and_sample(self) -> tuple[list[queue.OutputRecord], list[Branch], set[str]]:
        """The step's forward pass; returns the deltas, the finished branches and the ids of
        the sequences whose KV was computed."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return [], [], set()
        self.runner.copy_blocks(self.copies)
        self.copies = []
        batch = [
            ScheduledChunk(
                c.seq.token_ids[c.start : c.start + c.num_tokens], c.start, c.seq.block_ids
            )
            for c in chunks
        ]
        logits = self.runner.forward(batch)  # [chunks, vocab]
        self.tokens_computed += sum(c.num_tokens for c in chunks)
        # Sampling rows: one per sampling chunk, n for a request's first token (its n branches).
        rows: list[int] = []
        owners: list[tuple[Active, int]] = []
        states: list[RowState] = []
        for i, chunk in enumerate(chunks):
            if chunk.samples:
                active, branch = self.branch_of[chunk.seq.seq_id]
                params = active.record.params
                fan_out = params.n if branch.stop.num_generated == 0 and branch.index == 0 else 1
                for k in range(branch.index, branch.index + fan_out):
                    rows.append(i)
                    owners.append((active, k))
                    states.append(RowState(params, k, branch.stop.num_generated))
        tokens = sample(logits[rows], states).token_ids.tolist() if rows else []
        own = {
            i: t
            for i, (a, k), t in zip(rows, owners, tokens, strict=True)
            if k == self.branch_of[chunks[i].seq.seq_id][1].index
        }
        for i, chunk in enumerate(chunks):
            self.scheduler.computed(chunk, own.get(i))
        records, finished = [], []
        for (active, k), token in zip(owners, tokens, strict=True):
            if k == len(active.branches):  # a new branch, forked from the first
                parent = active.branches[0].seq.seq_id
                child = self.scheduler.fork(parent, f"{parent}#{k}", token)
                self.forks.setdefault(parent, []).append(child.seq_id)
                self._add_branch(active, child)
                active.live += 1
            branch = active.branches[k]
            update = branch.stop.append(token)
            if update.finish_reason is not None:
                active.live -= 1
                finished.append(branch)
            records.append(
                self._record(active, k, [token], update.finish_reason, final=active.live == 0)
            )
        return records, finished, {c.seq.seq_id for c in chunks}

    # ------------------------------------------------------------------ kvstore
    def _kv_step(self, finished: list[Branch], computed: set[str]) -> list[Active]:
        """Frees the finished branches, forks new ones, reports the progress of every running
        sequence ``computed`` this step or holding unreported tokens (decodes as one columnar
        TokenBatch), resumes and admits what the scheduler places. Returns the requests that
        are done (every branch finished)."""
        frees = [branch.seq.seq_id for branch in finished]
        done = []
        for branch in finished:
            active, _ = self.branch_of.pop(branch.seq.seq_id)
            self.scheduler.finish(branch.seq.seq_id)
            if active.live == 0 and self.active.pop(active.record.req_id, None) is not None:
                done.append(active)  # once, though several branches may end in one step
        forks = [p.ForkItem(parent, children) for parent, children in self.forks.items()]
        self.forks = {}
        decodes, appends = [], []
        for seq in self.scheduler.running():
            if len(seq.unreported) == 1 and seq.num_computed == seq.num_reported:
                decodes.append(seq)
            elif seq.unreported or seq.seq_id in computed:
                appends.append(p.AppendItem(seq.seq_id, seq.unreported, seq.num_computed))
        tokens = (
            p.TokenBatch(
                [s.seq_id for s in decodes],
                [s.token_ids[-1] for s in decodes],
                [s.num_computed for s in decodes],
            )
            if decodes
            else None
        )
        to_place = self.scheduler.to_place()
        reporting = [s.seq_id for s in decodes] + [a.req_id for a in appends]
        reply = self._call(
            p.Step(
                self.worker_id,
                frees=frees,
                forks=forks,
                appends=appends,
                tokens=tokens,
                resumes=[s.seq_id for s in to_place if s.status is SeqStatus.PREEMPTED],
                admits=[self._admit_item(s) for s in to_place if s.status is SeqStatus.WAITING],
            )
        )
        self._apply(reply, reporting)
        return done

    def _admit_item(self, seq: Sequence) -> p.AdmitItem:
        active = self.active[seq.seq_id]
        return p.AdmitItem(seq.seq_id, seq.token_ids, active.record.salt, adopt=active.adopt)

    def _apply(self, reply: p.StepReply, reporting: list[str]) -> None:
        """Takes in a step reply; while a running sequence got no block for its new tokens,
        preempts the latest arrival and retries (one more round trip each)."""
        while True:
            refused = {e.req_id for e in reply.errors if e.op == "append"}
            for placed in reply.forked:  # before the same reply's copy-on-write changes
                assert self.scheduler.seqs[placed.req_id].block_ids[: len(placed.block_ids)] == (
                    placed.block_ids
                ), f"{placed.req_id}: the fork's table differs from the kvstore's"
            for seq_id in reporting:  # accepted, whether or not its table changed
                if seq_id not in refused:
                    self.scheduler.reported(seq_id)
            for grown in reply.appended:
                self.copies += self.scheduler.grown(grown.req_id, grown.new_block_ids, grown.copies)
            for req_id, _mode in reply.preempted:
                self.scheduler.preempted(req_id)
            for placed in reply.admitted:  # the kvstore knows every token we sent
                seq = self.scheduler.seqs[placed.req_id]
                self.scheduler.placed(
                    seq.seq_id, placed.block_ids, placed.num_computed, len(seq.token_ids)
                )
                self.active[seq.seq_id].cached_tokens = placed.num_cached_tokens
                self.active[seq.seq_id].adopt = False
            for placed in reply.resumed:  # the kvstore knows what it held when preempted
                seq = self.scheduler.seqs[placed.req_id]
                self.scheduler.placed(
                    seq.seq_id, placed.block_ids, placed.num_computed, seq.num_reported
                )
            for error in reply.errors:
                if error.op == "admit" and error.code == "unknown_request":
                    self.active[error.req_id].adopt = False  # its blocks are gone: recompute
                elif error.op == "admit" and error.code == "conflict":
                    pass  # the kvstore's lease on the dead worker has not run out: retry
                elif error.code != "no_space":
                    raise RuntimeError(f"kvstore refused {error.op} of {error.req_id}: {error}")
            starved = [
                e.req_id
                for e in reply.errors
                if e.op == "append" and self.scheduler.seqs[e.req_id].status is SeqStatus.RUNNING
            ]
            if not starved:
                return
            victim = self.scheduler.victim()
            assert victim is not None, "no running sequence to preempt"
            retry = [self.scheduler.seqs[r] for r in starved if r != victim.seq_id]
            reporting = [seq.seq_id for seq in retry]
            reply = self._call(
                p.Step(
                    self.worker_id,
                    preempts=[victim.seq_id],
                    appends=[p.AppendItem(s.seq_id, s.unreported, s.num_computed) for s in retry],
                )
            )
            log.info("preempted %s for lack of blocks: %s", victim.seq_id, reply.preempted)

    def _call(self, body: p.Step) -> p.StepReply:
        reply = self.kv.call(body)
        assert isinstance(reply, p.StepReply)
        return reply

    # ------------------------------------------------------------------ outputs
    def _record(
        self, active: Active, index: int, tokens: list[int], reason: str | None, final: bool
    ) -> queue.OutputRecord:
        return queue.OutputRecord(
            active.record.req_id,
            index,
            tokens,
            None,
            reason,  # type: ignore[arg-type]
            prompt_tokens=len(active.record.prompt_token_ids),
            cached_tokens=active.cached_tokens,
            final=final,
        )

    def _end(self, active: Active, reason: str) -> None:
        """Ends a request early (client abort): frees its sequences, publishes a final record,
        acks it."""
        held = [b.seq.seq_id for b in active.branches if b.seq.status is not SeqStatus.WAITING]
        if held:
            self._call(p.Step(self.worker_id, frees=held))
        for branch in active.branches:
            if self.branch_of.pop(branch.seq.seq_id, None) is not None:
                self.scheduler.finish(branch.seq.seq_id)
        del self.active[active.record.req_id]
        record = self._record(active, 0, [], reason, final=True)
        queue.step(self.redis, [record], [active.entry_id])

    def run_forever(self, signals: list[int]) -> None:
        """Steps until a signal arrives (``signals`` grows, in a signal handler); when idle, each
        step waits up to 100 ms for a request on Redis. After the first signal it takes no new
        request and drains the running ones; a second signal returns at once."""
        while len(signals) < 2:
            if signals:
                if not self.active:
                    break
                if self.accepting:
                    log.info("draining %d requests (signal again to stop now)", len(self.active))
                self.accepting = False
            self.step(block_ms=100)
        self.kv.call(p.Unregister(self.worker_id))
