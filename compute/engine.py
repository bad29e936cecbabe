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
Beam search (``beam_width > 1``): the live beams are sequences that share blocks through fork
(``compute.beams``); the request publishes its ``n`` best hypotheses when the search ends. Taking
over an ``n > 1`` request adopts each unfinished branch; a beam search restarts on the prompt's
blocks (nothing of it was streamed), which gives the same answer: its scoring is deterministic.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict

import redis
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.beams import BeamGroup
from compute.requests import Active, Branch, output_record
from compute.runner import ModelRunner, ScheduledChunk
from compute.sampling import RowState, StopChecker, sample
from compute.scheduler import Scheduler, SchedulerConfig, SeqStatus, Sequence
from gateway import queue
from kvstore import protocol as p
from kvstore.client import KVClient
from kvstore.device import map_pool

log = logging.getLogger("pagedserve.compute")


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
        cuda_graph_max_batch: int = 0,
    ) -> None:
        """``claim_idle_ms``: a pending request untouched this long belongs to a dead worker and
        this one takes it over (live workers renew theirs every ``claim_idle_ms / 4``).
        ``cuda_graph_max_batch``: decode steps up to that size replay CUDA graphs (CUDA only)."""
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
        graphs = min(cuda_graph_max_batch, config.max_num_seqs)
        self.runner = ModelRunner(model, pool, reply.pool.block_size, graphs)
        self.scheduler = Scheduler(config, reply.pool.block_size)
        self.active: dict[str, Active] = {}  # by request id
        self.branch_of: dict[str, tuple[Active, Branch]] = {}  # by sequence id
        self.beam_of: dict[str, Active] = {}  # by sequence id, the live beams
        self.adopting: set[str] = set()  # taken over from a dead worker: adopt them, not admit
        self.forks: dict[str, list[str]] = {}  # parent -> children, for this step's kvstore call
        self.copies: list[tuple[int, int]] = []
        self.accepting = True  # takes new requests from Redis
        self.claim_idle_ms = claim_idle_ms
        self.tokens_computed = 0  # tokens run through the model (prefill + decode), a counter
        # host seconds per phase of step(): redis_in (incl. waiting for requests), model
        # (forward, sampling: it waits for the GPU), kvstore, redis_out
        self.phase_s: dict[str, float] = defaultdict(float)
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
        clock = time.perf_counter()
        self._take_requests(block_ms if not self.active else None)
        clock = self._phase("redis_in", clock)
        records, frees, done, computed = self._forward_and_sample()
        clock = self._phase("model", clock)
        self._kv_step(frees, computed)
        clock = self._phase("kvstore", clock)
        aborted = queue.step(self.redis, records, [a.entry_id for a in done], list(self.active))
        self._phase("redis_out", clock)
        for req_id in aborted:
            self._end(self.active[req_id], "abort")
        return bool(self.active) or bool(records)

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_s[name] += now - since
        return now

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
            self._start(entry_id, record)

    def _start(self, entry_id: str, record: queue.RequestRecord) -> Active:
        """A request from its first token: its first branch, or its beam search's root."""
        seq = self.scheduler.add(record.req_id, record.prompt_token_ids)
        active = Active(entry_id, record, {})
        self.active[record.req_id] = active
        params = record.params
        if params.beam_width > 1:
            active.beams = BeamGroup(seq, params, self.eos_ids, self.worker_id)
            self.beam_of[seq.seq_id] = active
        else:
            self._add_branch(active, seq, 0)
        return active

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
        if record.params.beam_width > 1 or not streamed.sequences:  # start again, on its blocks
            log.info("taking over %s from its start", record.req_id)
            self._start(entry_id, record)
            self.adopting.add(record.req_id)
            return 1
        counts = {i: len(seq.token_ids) for i, seq in streamed.sequences.items()}
        log.info("taking over %s after %s streamed tokens per branch", record.req_id, counts)
        active = Active(entry_id, record, {}, live=0)
        self.active[record.req_id] = active
        for index in range(record.params.n):
            streamed_seq = streamed.sequences[index]  # all n stream from the first token on
            if streamed_seq.finish_reason is not None:
                continue
            seq_id = record.req_id if index == 0 else f"{record.req_id}#{index}"
            generated = streamed_seq.token_ids
            seq = self.scheduler.add(seq_id, record.prompt_token_ids, generated)
            branch = self._add_branch(active, seq, index)
            self.adopting.add(seq_id)
            active.live += 1
            for token in generated:  # the stop checker and the seeded stream continue from here
                branch.stop.append(token)
        return 1

    def _decode(self, token_ids: list[int]) -> str:
        """Output text, special tokens (BOS, PAD, ...) left out as vLLM does by default."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _add_branch(self, active: Active, seq: Sequence, index: int) -> Branch:
        record = active.record
        context = record.prompt_token_ids[-4:]
        stop = StopChecker(record.params, self.eos_ids, self._decode, context)
        branch = Branch(index, seq, stop)
        active.branches[index] = branch
        self.branch_of[seq.seq_id] = (active, branch)
        return branch

    def _forward_and_sample(
        self,
    ) -> tuple[list[queue.OutputRecord], list[str], list[Active], set[str]]:
        """The step's forward pass and token choice. Returns the deltas, the sequences to free,
        the requests that are done and the ids of the sequences whose KV was computed."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return [], [], [], set()
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
        searches: dict[str, Active] = {}  # beam searches that got logits this step
        for i, chunk in enumerate(chunks):
            if not chunk.samples:
                continue
            if (beam_owner := self.beam_of.get(chunk.seq.seq_id)) is not None:
                beam_owner.beams.computed(chunk.seq, logits[i])  # type: ignore[union-attr]
                searches[beam_owner.record.req_id] = beam_owner
                continue
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
        records: list[queue.OutputRecord] = []
        frees: list[str] = []
        for (active, k), token in zip(owners, tokens, strict=True):
            if k not in active.branches:  # a new branch, forked from the first
                parent = active.branches[0].seq.seq_id
                child = self.scheduler.fork(parent, f"{parent}#{k}", token)
                self.forks.setdefault(parent, []).append(child.seq_id)
                self._add_branch(active, child, k)
                active.live += 1
            branch = active.branches[k]
            update = branch.stop.append(token)
            if update.finish_reason is not None:
                active.live -= 1
                frees.append(branch.seq.seq_id)
            records.append(
                output_record(
                    active, k, [token], update.finish_reason, active.live == 0, update.text
                )
            )
        for active in searches.values():
            records += self._beam_round(active, frees)
        done = [a for a in self.active.values() if a.live == 0]
        for seq_id in frees:
            self.branch_of.pop(seq_id, None)
            self.beam_of.pop(seq_id, None)
            self.scheduler.finish(seq_id)
        for active in done:
            del self.active[active.record.req_id]
        return records, frees, done, {c.seq.seq_id for c in chunks}

    def _beam_round(self, active: Active, frees: list[str]) -> list[queue.OutputRecord]:
        """Advances a beam search whose live beams all have their logits; adds the sequences
        it drops to ``frees``. Once it is done, the request's n best hypotheses."""
        beams = active.beams
        assert beams is not None
        if not beams.ready():
            return []
        round_ = beams.advance(self.scheduler)
        frees += round_.frees
        for parent, children in round_.forks.items():
            self.forks.setdefault(parent, []).extend(children)
            for child in children:
                self.beam_of[child] = active
        if not beams.done:
            return []
        active.live = 0
        best = beams.best(active.record.params.n, self._decode)
        return [
            output_record(active, k, tokens, reason, k == len(best) - 1, text)
            for k, (tokens, reason, text) in enumerate(best)
        ]

    # ------------------------------------------------------------------ kvstore
    def _kv_step(self, frees: list[str], computed: set[str]) -> None:
        """Frees ``frees``, forks new sequences, reports the progress of every running sequence
        ``computed`` this step or holding unreported tokens (decodes as one columnar
        TokenBatch), resumes and admits what the scheduler places."""
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

    def _owner(self, seq_id: str) -> Active:
        branch = self.branch_of.get(seq_id)
        return branch[0] if branch is not None else self.beam_of[seq_id]

    def _admit_item(self, seq: Sequence) -> p.AdmitItem:
        salt = self._owner(seq.seq_id).record.salt
        return p.AdmitItem(seq.seq_id, seq.token_ids, salt, adopt=seq.seq_id in self.adopting)

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
                self._owner(seq.seq_id).cached_tokens = placed.num_cached_tokens
                self.adopting.discard(seq.seq_id)
            for placed in reply.resumed:  # the kvstore knows what it held when preempted
                seq = self.scheduler.seqs[placed.req_id]
                self.scheduler.placed(
                    seq.seq_id, placed.block_ids, placed.num_computed, seq.num_reported
                )
            for error in reply.errors:
                if error.op == "admit" and error.code == "unknown_request":
                    self.adopting.discard(error.req_id)  # its blocks are gone: recompute
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

    def _end(self, active: Active, reason: str) -> None:
        """Ends a request early (client abort): frees its sequences, publishes a final record,
        acks it."""
        held = [seq.seq_id for seq in active.held()]
        if held:
            self._call(p.Step(self.worker_id, frees=held))
        seqs = [b.seq for b in active.branches.values()] + (
            active.beams.live if active.beams else []
        )
        for seq in seqs:
            if self.branch_of.pop(seq.seq_id, None) or self.beam_of.pop(seq.seq_id, None):
                self.scheduler.finish(seq.seq_id)
            self.adopting.discard(seq.seq_id)
        del self.active[active.record.req_id]
        record = output_record(active, 0, [], reason, final=True)
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
