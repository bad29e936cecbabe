"""The compute worker's engine loop: Redis requests in, token deltas out, KV in the kvstore's pool.

One step (single-threaded), with the device's work overlapped by the host's
(``compute.model_step``; docs/architecture.md, "One engine step"):
1. take new requests from the Redis consumer group while there is room;
2. launch the next model step (plan, copy-on-write copies, pack, forward and token draw enqueued
   on the device; decodes whose last token is still on the device are fed from it);
3. process the step launched before (its ids, stop checks and detokenization, forks, ends);
4. send one kvstore ``Step`` (``compute.kvsync``): free finished sequences, report every
   running sequence's new tokens and computed count, resume/admit what fits; its reply is
   taken in at the next turn, right after the launch of step 2 (the daemon works on it
   meanwhile; the tables' two lookahead slots let that launch feed two tokens ahead);
5. hand the deltas, acks, abort/gateway checks and a read of new requests (as many as there is
   room for) to Redis as one pipelined batch (``compute.publisher``; the replies are read a
   step later, and the requests read are taken at step 1 of the next step: a busy engine never
   waits for Redis to hand it requests);
6. (next turn, after 2) apply the kvstore's reply; when it has no block for a running sequence,
   preempt the latest arrival (the kvstore's cost model picks swap or recompute) and retry, one
   more round trip.

``n > 1``: a request's first sampling row draws n tokens (one seeded stream per branch); the
branches beyond the first are forked from it at the kvstore in the same step (the prompt's blocks
shared, the last one copied on write) and stream under their own index. A branch that ends on
its first token is never forked.

The worker holds nothing that cannot be rebuilt: request state is in Redis (the request entry,
its output stream) and the KV blocks are the kvstore's. A live worker renews its claim on its
requests (``queue_worker.touch``); the requests of a dead one are taken over
(``queue_worker.claim_stale``), rebuilt from the tokens already streamed and ``adopt``ed at the
kvstore, which keeps their blocks for a grace period, so nothing is prefilled again (if the
blocks are gone, it recomputes). The same path serves this worker itself: at startup it takes
back what a previous process under its id left pending (``queue_worker.claim_own``), and when it
loses the kvstore or Redis (a timeout, a restart, a connection error) or finds the kvstore's
state differs from its own, it drops its in-memory state, registers again (mapping the
kvstore's new pool if it restarted), and rebuilds its requests from Redis, retrying with backoff
until both answer.
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
from collections.abc import Callable, Mapping
from types import MappingProxyType

import redis
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.admission import ModelLimits
from compute.faults import Faults, RequestError
from compute.grammar import Grammars, GuidesUnsupported
from compute.heartbeat import Heartbeat
from compute.intake import Intake
from compute.kvsync import Diverged, KVSync, Sent
from compute.model_step import ModelStep
from compute.profile import RecomputeProfile
from compute.publisher import Publisher
from compute.registry import Requests
from compute.requests import Active
from compute.runner import ModelRunner
from compute.scheduler import Scheduler, SchedulerConfig
from compute.timeline import TimelineLog
from contracts import queue_keys, queue_worker
from contracts.records import ErrorCode, FinishReason, OutputRecord
from contracts.tokenizer import output_decoder
from kernels.compile_watch import CompileWatch
from kvstore import protocol as p
from kvstore.client import KVClient, KVStoreError, KVStoreTimeout
from kvstore.mapping import map_pool

log = logging.getLogger("pagedserve.compute")
# What a worker survives by rebuilding its state: the kvstore or Redis away, or out of step.
RECOVERABLE = (KVStoreTimeout, KVStoreError, redis.RedisError, Diverged)
RETRY_MAX_S = 5.0
TIMELINE_EVERY_S = 1.0  # how often a step carries the running totals to the kvstore


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
        claim_idle_ms: int = queue_keys.CLAIM_IDLE_MS,
        cuda_graph_max_batch: int = 0,
        cuda_graph_max_tokens: int = 0,
        recompute_profile: RecomputeProfile | None = None,
        profile_origin: p.ProfileOrigin | None = None,
        heartbeat: bool = False,
    ) -> None:
        """Registers at the kvstore, maps its pool and takes back the requests a previous
        process under ``worker_id`` left pending. ``claim_idle_ms``: a pending request untouched
        this long belongs to a dead worker and this one takes it over (live workers renew theirs
        every ``claim_idle_ms / 4``). ``cuda_graph_max_batch``: decode steps up to that size
        replay CUDA graphs; ``cuda_graph_max_tokens``: other steps up to that many tokens
        replay CUDA graphs of mixed steps (CUDA only, ``ModelRunner``). The profiles go to the
        kvstore's cost model (``compute.profile``), with ``profile_origin``. ``heartbeat``: a
        thread keeps its leases while a step is long (``compute.heartbeat``; the worker
        process's engine has one)."""
        self.worker_id = worker_id
        self.model = model
        self.tokenizer = tokenizer
        self.kv = kv
        self.redis = r
        self.config = config
        self.prefill_profile = prefill_profile
        self.recompute_profile = recompute_profile or RecomputeProfile([], [])
        self.profile_origin = profile_origin
        self.claim_idle_ms = claim_idle_ms
        self.cuda_graph_max_batch = cuda_graph_max_batch
        self.cuda_graph_max_tokens = cuda_graph_max_tokens
        eos = model.generation_config.eos_token_id
        self._decode = output_decoder(tokenizer)
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        self.accepting = True  # takes new requests from Redis
        # host seconds per phase of step(): redis_in (taking requests), launch (plan, pack,
        # enqueue the forward and the draw), process (waiting for the device, then the tokens'
        # host work), kvstore (sending the Step, waiting for its reply: kv_wait, applying it),
        # redis_out (handing the records to the publisher); compile (Triton variants built after
        # start-up, part of launch, where kernels are launched: ``kernels.compile_watch``)
        self.phase_s: dict[str, float] = defaultdict(float)
        self.idle_s = 0.0  # an idle engine waiting for requests (in no phase), a counter
        self.steps = 0  # turns of step() that had work (an idle wait is not a step), a counter
        self._timeline_sent_at = 0.0
        self._wants_heartbeat = heartbeat
        self.heartbeat: Heartbeat | None = None  # started at the first registration
        self.publisher = Publisher(r, worker_id)
        self.runner: ModelRunner | None = None
        self._pool: p.PoolInfo | None = None
        self.limits = ModelLimits.of(model)  # what a request may ask of the model
        # made for the first guided request (or why the model has none)
        self._grammars: Grammars | GuidesUnsupported | None = None
        try:
            self._connect(redeliver=True)
        except BaseException:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            raise
        # from here on a Triton kernel variant built stalls every request: logged, timed as
        # the ``compile`` phase
        self.compiles = CompileWatch(self._compiled)
        if model.device.type == "cuda":
            self.compiles.install()

    def _compiled(self, kernel: str, seconds: float) -> None:
        self.phase_s["compile"] += seconds

    # ------------------------------------------------------------------ connecting
    def _connect(self, redeliver: bool) -> None:
        """Registers (mapping the pool when it is new), starts from empty state and takes back
        this worker's pending requests from Redis (``redeliver``: as a new delivery)."""
        reply = self.kv.call(
            p.Register(
                self.worker_id,
                self.prefill_profile,
                str(self.model.device),
                os.getpid(),
                self.recompute_profile.points,
                self.recompute_profile.graph_buckets,
                self.profile_origin,
            )
        )
        if self._wants_heartbeat and self.heartbeat is None:  # before the graphs' capture
            self.heartbeat = Heartbeat(
                self.kv.endpoint, self.redis, self.worker_id, reply.lease_timeout_s / 3
            )
            self.heartbeat.start()
        if reply.pool != self._pool:
            self._map(reply.pool)
        self.scheduler = Scheduler(self.config, reply.pool.block_size)
        self.requests = Requests(
            self.scheduler, self._decode, self.eos_ids, self.worker_id, self.grammars
        )
        self.kvsync = KVSync(self.kv, self.worker_id, self.requests)
        self._sent: Sent | None = None  # the last Step, its reply taken in after the next launch
        self.faults = Faults(RECOVERABLE)  # requests whose own work raised, to end
        assert self.runner is not None
        self.model_step = ModelStep(
            self.runner, self.requests, self.kvsync, self._decode, self.phase_s, self.faults
        )
        self._finals: list[OutputRecord] = []  # ended requests' records, to publish
        self._acks: list[str] = []  # their entries, to ack
        self.intake = Intake(
            self.redis,
            self.worker_id,
            # 0: the kvstore's lease, its failure detector (when it lets others adopt the blocks)
            self.claim_idle_ms or int(reply.lease_timeout_s * 1000),
            self.requests,
            self.model_step.free_later,
            self.faults,
            self.limits,
        )
        queue_worker.ensure_group(self.redis)
        for entry_id, record in queue_worker.claim_own(self.redis, self.worker_id, redeliver):
            self.intake.take_over(entry_id, record)
        log.info(
            "worker %s registered: %d GPU blocks (at most %d per request), block size %d; "
            "%d requests of its own taken back",
            self.worker_id,
            reply.num_gpu_blocks,
            reply.admission_limit_blocks,
            reply.pool.block_size,
            len(self.active),
        )

    def _map(self, info: p.PoolInfo) -> None:
        """Maps the kvstore's pool (a new one after the kvstore restarted: the old mapping is
        dropped first) and builds the runner over it (capturing CUDA graphs again)."""
        if self.runner is not None:
            log.warning("the kvstore's pool is new: mapping it again")
        self.runner = None  # release the old mapping before taking the new one
        pool = map_pool(info)  # [blocks, layers, 2, block, kv_heads, d], shared
        if pool.device.type != self.model.device.type:
            raise RuntimeError(
                f"the kvstore's pool is on {pool.device.type}, the model on "
                f"{self.model.device.type}: start both on the same device"
            )
        graphs = min(self.cuda_graph_max_batch, self.config.max_num_seqs)
        tokens = min(self.cuda_graph_max_tokens, self.config.max_num_batched_tokens)
        self.runner = ModelRunner(
            self.model, pool, info.block_size, graphs, tokens, self.config.max_num_seqs
        )
        self._pool = info

    def recover(self, error: Exception, stop: Callable[[], bool]) -> bool:
        """After a ``RECOVERABLE`` error: forgets every request (nothing of them is lost: Redis
        and the kvstore hold it) and connects again, retrying with backoff until it works
        (True) or ``stop()`` (False)."""
        log.warning("worker %s lost the kvstore or Redis (%s); rebuilding", self.worker_id, error)
        if self._sent is not None:  # its reply is not waited for: the state is rebuilt
            self.kv.forget(self._sent.call_id)
            self._sent = None
        self.model_step.drop()
        self._drain_publisher()
        delay = 0.25
        while not stop():
            try:
                self._connect(redeliver=False)
                return True
            except RECOVERABLE as err:
                # a kvstore timeout has waited already (and its Register waits on for the next
                # daemon): no backoff on top of it
                wait = 0.0 if isinstance(err, KVStoreTimeout) else delay
                log.warning("still cannot serve (%s): retrying in %.1f s", err, wait)
                time.sleep(wait)
                delay = min(2 * delay, RETRY_MAX_S)
        return False

    def _drain_publisher(self) -> None:
        """Waits for the publisher's job; its error (Redis away) is the recovery's to handle."""
        try:
            self.publisher.wait()
        except redis.RedisError as err:
            log.warning("the last records were not published: %s", err)

    @property
    def active(self) -> dict[str, Active]:
        return self.requests.active

    @property
    def idle(self) -> bool:
        """No request in hand, no step on the device and nothing left to publish."""
        return (
            not self.active
            and not self.intake.incoming
            and not self._finals
            and self.model_step.inflight is None
            and self.publisher.idle
        )

    @property
    def unanswered_reports(self) -> Mapping[str, int]:
        """Sequences the last Step reported, whose reply is not applied yet -> the token count
        it told the kvstore (a frozen view: tests compare it with the kvstore's)."""
        return MappingProxyType(self._sent.reporting if self._sent is not None else {})

    @property
    def tokens_computed(self) -> int:
        """Tokens run through the model (prefill + decode) by this state, a counter."""
        return self.model_step.tokens_computed

    # ------------------------------------------------------------------ the loop
    def step(self, block_ms: int | None = None) -> bool:
        """One engine step; False when there was nothing to do. Launches the next model step,
        applies the kvstore's reply to the last turn's Step, processes the step launched before
        (its host work overlaps the device's work on the new one), sends one kvstore Step and
        writes one pipelined Redis batch."""
        clock = time.perf_counter()
        waits = self.idle  # nothing in hand: the read may wait for a request
        room = self.config.max_num_seqs - len(self.active) - len(self.intake.incoming)
        self.intake.take(room, self.accepting, waits, block_ms if waits else None)
        if waits:
            now = time.perf_counter()
            self.idle_s += now - clock
            clock = now
        else:
            clock = self._phase("redis_in", clock)
        model = self.model_step
        launched = model.launch()
        clock = self._phase("launch", clock)
        earlier, model.inflight = model.inflight, launched
        self.end_faults()  # requests whose launch work failed: freed after the launched step
        if launched is not None and not launched.sync:
            clock = self._take_reply(clock)  # the kvstore answered while the step was launched
        outputs = [model.process(earlier)] if earlier is not None else []
        if launched is not None and launched.sync:
            model.inflight = None
            outputs.append(model.process(launched))
        self.end_faults()
        clock = self._phase("process", clock)
        clock = self._take_reply(clock)  # nothing launched (or a forking step): after process
        if clock - self._timeline_sent_at >= TIMELINE_EVERY_S:  # the admin page's step timeline
            self._timeline_sent_at = clock
            self.kvsync.timeline = p.StepTimeline(
                self.steps,
                model.tokens_computed,
                model.device_s,
                dict(self.phase_s),
                self.scheduler.held_steps,
            )
        self._sent = self.kvsync.send({seq_id for out in outputs for seq_id in out.computed})
        clock = self._phase("kvstore", clock)
        records = [record for out in outputs for record in out.records] + self._finals
        acks = [a.entry_id for out in outputs for a in out.done] + self._acks
        self._finals, self._acks = [], []
        active = self.active
        found = self.publisher.wait()  # the last job's: checks, and the requests it read
        self.intake.incoming += found.requests
        busy = bool(active) or model.inflight is not None  # else: the next step waits on Redis
        room = self.config.max_num_seqs - len(active) - len(self.intake.incoming)
        read = room if busy and self.accepting else 0
        self.publisher.submit(records, acks, list(active), self.requests.gateways(), read)
        self._phase("redis_out", clock)
        if found.checked is not None:
            for req_id in found.checked.aborted:
                if req_id in active:
                    self._end(active[req_id], "abort")
            self._end_orphans(found.checked.gateways_gone)
        worked = bool(self.active or records or self.intake.incoming) or model.inflight is not None
        if worked:
            self.steps += 1
        if self.heartbeat is not None:
            self.heartbeat.beat(tuple(self.intake.held()))
        return worked

    def _take_reply(self, clock: float) -> float:
        """Receives and applies the reply to the last Step, if not done yet. After a launch
        (``model.inflight`` the launched step, so a preemption waits for it and a refusal's
        frees wait until it is processed), or with nothing on the device."""
        if self._sent is None:
            return clock
        sent, self._sent = self._sent, None
        reply = self.kvsync.receive(sent)
        self.phase_s["kv_wait"] += time.perf_counter() - clock  # inside kvstore, like wait
        for refusal in {id(r.active): r for r in self.kvsync.apply(sent, reply)}.values():
            log.error("request %s failed: %s", refusal.active.record.req_id, refusal.message)
            self._end(refusal.active, "error", refusal.message, refusal.code)
        return self._phase("kvstore", clock)

    def end_faults(self) -> None:
        """Ends the requests whose own work raised (``compute.faults``) with their error."""
        for fault in self.faults.take():
            active = self.active.get(fault.req_id)
            if active is not None:
                self._end(active, "error", fault.message, fault.code)

    def _end_orphans(self, missing: set[str]) -> None:
        """Ends the requests of the gateways gone (``Intake.gone``)."""
        for gateway in self.intake.gone(missing):
            orphans = [a for a in self.active.values() if a.record.gateway == gateway]
            log.warning("gateway %s is gone: aborting its %d requests", gateway, len(orphans))
            for request in orphans:
                self._end(request, "error", f"its gateway {gateway} is gone", "unavailable")

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.phase_s[name] += now - since
        return now

    def grammars(self) -> Grammars:
        """The worker's grammar compiler (its tokenizer's vocabulary, as wide as the logits),
        made once. Raises ``RequestError`` (unsupported_parameter) for a model whose tokenizer
        the grammar engine cannot read."""
        if self._grammars is None:
            try:
                self._grammars = Grammars(self.tokenizer, self.limits.logits)
            except GuidesUnsupported as err:
                self._grammars = err
        if isinstance(self._grammars, GuidesUnsupported):
            raise RequestError(str(self._grammars), "unsupported_parameter")
        return self._grammars

    def _end(
        self,
        active: Active,
        reason: FinishReason,
        error: str | None = None,
        code: ErrorCode | None = None,
    ) -> None:
        """Ends a request before it finished (a client abort, its gateway gone, a refusal, a
        fault): its sequences are forgotten now and freed at the kvstore once no launched step
        writes them; its final record is published and its entry acked in the next Redis round
        trip."""
        if active.record.req_id not in self.active:  # ended already
            return
        self.model_step.free_later(self.requests.remove(active))
        final = OutputRecord(
            active.record.req_id,
            finish_reason=reason,
            error=error,
            error_code=code,
            prompt_tokens=len(active.record.prompt_token_ids),
            cached_tokens=active.cached_tokens,
            final=True,
        )
        self._finals.append(final)
        self._acks.append(active.entry_id)

    def run_forever(self, signals: list[int]) -> None:
        """Steps until a signal arrives (``signals`` grows, in a signal handler); when idle, each
        step waits up to 100 ms for a request on Redis. After the first signal it takes no new
        request and drains the running ones; a second signal returns at once. Losing the
        kvstore or Redis does not stop it: it rebuilds (``recover``) and goes on; a signal while
        it rebuilds stops it at once (it holds no request then). Every 10 s of work it logs its
        per-step timeline (``compute.timeline``)."""
        timeline = TimelineLog()
        connected = True
        while len(signals) < 2:
            model = self.model_step
            line = timeline.tick(
                self.phase_s,
                self.steps,
                model.tokens_computed,
                model.device_s,
                held=self.scheduler.held_steps,
            )
            if line is not None:
                log.info("timeline: %s", line)
            if signals:
                if self.idle:
                    break
                if self.accepting:
                    log.info("draining %d requests (signal again to stop now)", len(self.active))
                self.accepting = False
            try:
                self.step(block_ms=100)
            except RECOVERABLE as err:
                connected = self.recover(err, lambda: bool(signals))
                if not connected:
                    break
        self._drain_publisher()
        self.publisher.close()
        self.compiles.uninstall()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if not connected:
            log.warning("stopping without the kvstore or Redis: not unregistering")
            return
        try:
            self.kv.call(p.Unregister(self.worker_id))
        except (KVStoreTimeout, KVStoreError) as err:
            log.warning("could not unregister from the kvstore: %s", err)
