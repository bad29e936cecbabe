"""The compute worker's engine loop: Redis requests in, token deltas out, KV in the kvstore's pool.

``Engine`` lives as long as the process: the model, the runner over the kvstore's pool, the
publisher, the heartbeat and the timeline. What one connection to the kvstore and Redis holds is its
``Session`` (``compute.loop.session``): dropped and built again on recovery.

One step (single-threaded), with the device's work overlapped by the host's (docs/architecture.md,
"One engine step"). Each of its three one-step lags is a submit/collect pair on its owner: the
model step (``ModelStep.launch``/``collect``), the kvstore's Step (``KVSync.submit``/``collect``)
and the Redis job (``Publisher.submit``/``collect``):
1. take new requests from the Redis consumer group while there is room (``compute.loop.intake``);
2. launch the next model step (plan, copy-on-write copies, pack, forward and token draw enqueued
   on the device; decodes whose last token is still on the device are fed from it);
3. collect the step launched before (its ids, stop checks and detokenization, forks, ends) and,
   while the device computes, the kvstore's reply to the last Step: when it has no block for a
   running sequence, preempt the latest arrival (the kvstore's cost model picks swap or
   recompute) and retry, one more round trip;
4. submit one kvstore ``Step`` (``compute.loop.kvsync``) from what that processing handed over: free
   finished sequences, report every running sequence's new tokens and computed count,
   resume/admit what fits; its reply is collected at the next turn (the daemon works on it
   meanwhile; the tables' two lookahead slots let the next launch feed two tokens ahead);
5. collect the last Redis job and submit this step's, one pipelined batch: the deltas, acks,
   abort/gateway checks and a read of new requests, as many as there is room for
   (``compute.loop.publisher``: a busy engine never waits for Redis to hand it requests).
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Mapping

import redis
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.batch.admission import ModelLimits
from compute.batch.registry import Requests
from compute.batch.requests import Active
from compute.batch.scheduler import Scheduler, SchedulerConfig
from compute.loop.backoff import retry_with_backoff
from compute.loop.heartbeat import Heartbeat
from compute.loop.kvsync import Diverged
from compute.loop.model_step import ModelStep
from compute.loop.publisher import Publisher
from compute.loop.rank import build_runner
from compute.loop.session import Session
from compute.loop.timeline import TimelineLog
from compute.model.profile import RecomputeProfile
from compute.model.runner import ModelRunner
from compute.parallel.layers import TPGroup
from compute.parallel.step_plan import RunnerSettings
from compute.sampling.grammar import GrammarsOnce
from contracts import queue_keys
from contracts.queue_keys import Checked
from contracts.records import OutputRecord
from contracts.tokenizer import output_decoder
from kernels.compile_watch import CompileWatch
from kvstore import protocol as p
from kvstore.client import KVClient, KVStoreError, KVStoreTimeout

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
        pool: int = 0,
        node: str = "",
        group: TPGroup | None = None,
    ) -> None:
        """Registers at the kvstore, maps its pool and takes back the requests a previous
        process under ``worker_id`` left pending. ``claim_idle_ms``: a pending request untouched
        this long belongs to a dead worker and this one takes it over (live workers renew theirs
        every ``claim_idle_ms / 4``). ``cuda_graph_max_batch``: decode steps up to that size
        replay CUDA graphs; ``cuda_graph_max_tokens``: other steps up to that many tokens
        replay CUDA graphs of mixed steps (CUDA only, ``ModelRunner``). The profiles go to the
        kvstore's cost model (``compute.model.profile``), with ``profile_origin``. ``heartbeat``: a
        thread keeps its leases while a step is long (``compute.loop.heartbeat``; the worker
        process's engine has one). ``pool``: its pool at the kvstore of host ``node`` (empty: the
        first), whose stream it reads (``queue_keys.request_stream``). ``group``: this is rank 0
        of a tensor-parallel group, ``model`` its shards (``compute.loop.rank``)."""
        self.worker_id, self.group = worker_id, group
        self.pool, self.stream = pool, queue_keys.request_stream(pool, node)
        self.model = model
        self.tokenizer = tokenizer
        self.kv, self.redis = kv, r
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
        # host seconds per phase of step(): redis_in (taking requests), launch (plan, pack, enqueue
        # the forward and the draw), process (waiting for the device, then the tokens' host
        # work), kvstore (sending the Step, waiting for its reply: kv_wait, applying it),
        # redis_out (handing the records to the publisher); compile (Triton variants built after
        # start-up, part of launch: ``kernels.compile_watch``); launch and process are the model
        # step's too (``phases()`` reads both)
        self._phase_s: dict[str, float] = defaultdict(float)
        self._model_phases: dict[str, float] = {}  # a dropped session's model step's phases
        self.idle_s = 0.0  # an idle engine waiting for requests (in no phase), a counter
        self.steps = 0  # turns of step() that had work (an idle wait is not a step), a counter
        self._timeline_sent_at = 0.0
        self._clock = time.perf_counter()  # when the last phase of step() ended
        self._wants_heartbeat = heartbeat
        self.heartbeat: Heartbeat | None = None  # started at the first registration
        self.publisher = Publisher(r, worker_id, stream=self.stream)
        self.runner: ModelRunner | None = None
        self.session: Session  # what _connect builds: dropped and built again on recovery
        self._pool: p.PoolInfo | None = None
        self.limits = ModelLimits.of(model)  # what a request may ask of the model
        self.grammars = GrammarsOnce(tokenizer, self.limits.logits)  # at the first guide
        try:
            self._connect(redeliver=True)
        except BaseException:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            raise
        # from here on a Triton kernel variant built stalls every request: logged, timed (compile)
        self.compiles = CompileWatch(self._compiled)
        if model.device.type == "cuda":
            self.compiles.install()

    def _compiled(self, kernel: str, seconds: float) -> None:
        self._phase_s["compile"] += seconds

    # ------------------------------------------------------------------ connecting
    def _connect(self, redeliver: bool) -> None:
        """Registers (mapping the pool when it is new) and opens a new session, which takes
        back this worker's pending requests from Redis (``redeliver``: as a new delivery)."""
        reply = self.kv.call(
            p.Register(
                self.worker_id,
                self.prefill_profile,
                str(self.model.device),
                os.getpid(),
                self.recompute_profile.points,
                self.recompute_profile.graph_buckets,
                self.profile_origin,
                self.pool,
            )
        )
        if self._wants_heartbeat and self.heartbeat is None:  # before the graphs' capture
            interval = reply.lease_timeout_s / 3
            self.heartbeat = Heartbeat(
                self.kv.endpoint, self.redis, self.worker_id, interval, stream=self.stream
            )
            self.heartbeat.start()
        if reply.pool != self._pool:
            self._map(reply.pool)
        assert self.runner is not None
        session = Session(
            self.kv,
            self.redis,
            self.worker_id,
            self.config,
            reply.pool.block_size,
            self.runner,
            self._decode,
            self.eos_ids,
            self.grammars,
            self.limits,
            self._model_phases,  # the session before's totals, when this one replaces it
            # 0: the kvstore's lease, its failure detector (when it lets others adopt the blocks)
            self.claim_idle_ms or int(reply.lease_timeout_s * 1000),
            RECOVERABLE,
            self.stream,
        )
        session.open(self.redis, self.worker_id, redeliver)
        self.session = session
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
        dropped first) and builds the runner over it (capturing CUDA graphs again; in a group,
        every rank builds its own)."""
        if self.runner is not None:
            log.warning("the kvstore's pool is new: mapping it again")
        self.runner = None  # release the old mapping before taking the new one
        graphs = min(self.cuda_graph_max_batch, self.config.max_num_seqs)
        tokens = min(self.cuda_graph_max_tokens, self.config.max_num_batched_tokens)
        settings = RunnerSettings(info.block_size, graphs, tokens, self.config.max_num_seqs)
        self.runner = build_runner(self.model, info, settings, self.group)
        self._pool = info

    def recover(self, error: Exception, stop: Callable[[], bool]) -> bool:
        """After a ``RECOVERABLE`` error: drops the session (nothing of its requests is lost:
        Redis and the kvstore hold them) and connects again, retrying with backoff until it
        works (True) or ``stop()`` (False)."""
        log.warning("worker %s lost the kvstore or Redis (%s); rebuilding", self.worker_id, error)
        self._model_phases = dict(self.session.model.phase_s)
        self.session.drop()
        self.publisher.drain()

        def connect() -> bool:
            self._connect(redeliver=False)
            return True

        # a kvstore timeout has waited already (its Register waits on for the next daemon)
        retried = retry_with_backoff(
            connect, stop, RECOVERABLE, RETRY_MAX_S, "still cannot serve", (KVStoreTimeout,)
        )
        return retried is not None

    @property
    def active(self) -> dict[str, Active]:
        return self.session.requests.active

    @property
    def idle(self) -> bool:
        """No request in hand, no step on the device and nothing left to publish."""
        return self.session.idle and self.publisher.idle

    @property
    def unanswered_reports(self) -> Mapping[str, int]:
        """Sequences the last Step reported, whose reply is not applied yet -> the token count
        it told the kvstore (a frozen view: tests compare it with the kvstore's)."""
        return self.session.kvsync.unanswered_reports

    @property
    def model_step(self) -> ModelStep:
        """The session's launched steps and their counters (read by benchmarks and tests)."""
        return self.session.model

    @property
    def scheduler(self) -> Scheduler:
        """The session's scheduler (read by benchmarks and tests)."""
        return self.session.scheduler

    @property
    def requests(self) -> Requests:
        """The session's requests and their sequences (read by benchmarks and tests)."""
        return self.session.requests

    @property
    def tokens_computed(self) -> int:
        """Tokens run through the model (prefill + decode) by this session, a counter."""
        return self.session.model.tokens_computed

    def phases(self) -> dict[str, float]:
        """Host seconds per phase, the engine's and its model step's (a copy: read only)."""
        return {**self._phase_s, **self.session.model.phase_s}

    # ------------------------------------------------------------------ the loop
    def step(self, block_ms: int | None = None) -> bool:
        """One engine step; False when there was nothing to do. Takes requests in, launches
        the next model step, processes the one launched before (its host work overlaps the
        device's work on the new one; the kvstore's reply to the last turn's Step is taken in
        meanwhile, ``_take_reply``), sends one kvstore Step and writes one pipelined Redis
        batch."""
        s = self.session
        self._take_requests(block_ms)
        s.model.launch()  # step N+1 on the device
        self._phase("launch")
        s.end_faults()  # requests whose launch work failed: freed after the launched step
        out = s.model.collect(self._take_reply)  # step N's host work
        s.end_faults()
        self._phase("process")
        s.kvsync.submit(out.computed, out.forks, out.finals, out.copied, self._timeline())
        self._phase("kvstore")
        ended, acks = s.take_ended()
        records = out.records + ended
        checked = self._publish(records, [a.entry_id for a in out.done] + acks)
        self._phase("redis_out")
        s.end_checked(checked)
        worked = bool(self.active or records or s.intake.incoming) or s.model.on_device
        if worked:
            self.steps += 1
        if self.heartbeat is not None:
            self.heartbeat.beat(tuple(s.intake.held()))
        return worked

    def _take_requests(self, block_ms: int | None) -> None:
        """Starts the requests read, takes over those of dead workers; an idle engine reads
        Redis itself, waiting up to ``block_ms`` for a request (idle time, in no phase)."""
        self._clock = time.perf_counter()
        waits = self.idle  # nothing in hand: the read may wait for a request
        room = self.session.room(self.config.max_held)
        self.session.intake.take(room, self.accepting, waits, block_ms if waits else None)
        if waits:
            now = time.perf_counter()
            self.idle_s += now - self._clock
            self._clock = now
        else:
            self._phase("redis_in")

    def _take_reply(self) -> None:
        """Takes in the kvstore's reply to the last Step (``KVSync.collect``) and ends what it
        refused; ``ModelStep.collect`` calls it while a launched step computes, or once the
        device has nothing left (``process`` is timed up to here then)."""
        s = self.session
        s.end_faults()
        if not s.model.overlapped:
            self._phase("process")
        collected = s.kvsync.collect(s.model.settle)
        self._phase_s["kv_wait"] += collected.wait_s  # inside kvstore, like wait
        s.end_refused(collected.refusals)
        self._phase("kvstore")

    def _timeline(self) -> p.StepTimeline | None:
        """The running totals for the admin page's step timeline, about once a second."""
        if self._clock - self._timeline_sent_at < TIMELINE_EVERY_S:
            return None
        self._timeline_sent_at = self._clock
        m, held = self.session.model, self.session.scheduler.held_steps
        return p.StepTimeline(self.steps, m.tokens_computed, m.device_s, self.phases(), held)

    def _publish(self, records: list[OutputRecord], acks: list[str]) -> Checked | None:
        """Reads the replies of the last Redis job (its requests join the intake) and writes
        this step's: the records, the acks, the checks and a read of as many new requests as
        there is room for while busy (else the next step reads, waiting). What the last job
        checked."""
        s = self.session
        found = self.publisher.collect()
        s.intake.found(found.requests)
        busy = bool(self.active) or s.model.on_device  # else: the next step waits on Redis
        read = s.room(self.config.max_held) if busy and self.accepting else 0
        self.publisher.submit(records, acks, list(self.active), s.requests.gateways(), read)
        return found.checked

    def _phase(self, name: str) -> None:
        """Adds the time since the last phase ended to phase ``name``."""
        now = time.perf_counter()
        self._phase_s[name] += now - self._clock
        self._clock = now

    def run_forever(self, signals: list[int]) -> None:
        """Steps until a signal arrives (``signals`` grows, in a signal handler); when idle, each
        step waits up to 100 ms for a request on Redis. After the first signal it takes no new
        request and drains the running ones; a second signal returns at once. Losing the
        kvstore or Redis does not stop it: it rebuilds (``recover``) and goes on; a signal while
        it rebuilds stops it at once (it holds no request then). Every 10 s of work it logs its
        per-step timeline (``compute.loop.timeline``)."""
        timeline = TimelineLog()
        connected = True
        while len(signals) < 2:
            model, held = self.session.model, self.session.scheduler.held_steps
            line = timeline.tick(
                self.phases(), self.steps, model.tokens_computed, model.device_s, held=held
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
        self.publisher.drain()
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
