"""The worker's side of the kvstore: one ``Step`` round trip per engine step keeps the kvstore's
block tables and the scheduler's in step.

``KVSync`` owns the kvstore bookkeeping between two steps: the forks and frees to send, the
copy-on-write copies the kvstore asked for (the runner performs them before its next forward).
``step`` sends the step's work, applies the reply to the scheduler (placements, new blocks,
preemptions; while a running sequence got no block for its new tokens, it preempts the latest
arrival and retries, one more round trip each) and returns the requests the kvstore refused for
good (``Refusal``), for the engine to end with an error.

An error that says the kvstore's state is not what this worker thinks (an unknown request, one
owned by another worker, a table that differs) raises ``Diverged``: the engine then rebuilds its
requests from Redis and adopts their blocks again, as after an outage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from compute.registry import Requests
from compute.requests import Active
from compute.scheduler import SeqStatus, Sequence
from contracts.records import ErrorCode
from kvstore import protocol as p
from kvstore.client import KVClient

log = logging.getLogger("pagedserve.compute")
_DIVERGED = ("unknown_request", "not_owner", "wrong_state")
_REQUESTS_FAULT = ("too_large", "bad_argument")  # refusals whose cause lies in the request


class Diverged(Exception):
    """The kvstore's view of this worker's requests differs from the worker's."""


@dataclass(frozen=True)
class Refusal:
    """The kvstore refused a request for good (too large for the pool, a bad argument)."""

    active: Active
    message: str
    code: ErrorCode


@dataclass(frozen=True)
class Sent:
    """A Step sent to the kvstore whose reply is not applied yet."""

    body: p.Step
    call_id: int
    reporting: dict[str, int]  # sequences whose unreported tokens it reports -> their count
    # the scheduler's sequences when it was sent: one that left before the reply (ended,
    # aborted, taken over) is not the scheduler's any more, and the reply's items about it
    # are dropped
    seqs: dict[str, Sequence]


@dataclass
class KVSync:
    kv: KVClient
    worker_id: str
    requests: Requests
    forks: dict[str, list[str]] = field(default_factory=dict)  # parent -> children, to send
    frees: list[str] = field(default_factory=list)  # sequences to free, to send
    finals: list[p.AppendItem] = field(default_factory=list)  # ended sequences' last progress
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) the runner owes
    copied: list[int] = field(default_factory=list)  # dst blocks of copies seen complete
    # Makes the copies owed now and waits until no launched step can still write the pool;
    # returns the copies' destinations. Called before a preemption, whose swap-out reads the
    # victim's blocks and whose freed blocks may go to another request (which an owed copy
    # made later would overwrite).
    quiesce: Callable[[], list[int]] = field(default=lambda: [])
    timeline: p.StepTimeline | None = None  # the engine's totals, for the next step to carry

    def send(self, computed: set[str]) -> Sent:
        """Sends the step's forks and frees, reports the progress of every running sequence
        ``computed`` this step or holding unreported tokens (decodes as one columnar
        TokenBatch), resumes and admits what the scheduler places. Returns without waiting
        for the reply (``receive``, then ``apply``). Until then the engine may launch a step
        (which feeds tokens into the lookahead slots of the tables it has), process one
        (tokens sampled meanwhile stay unreported) and end requests; it sends no other Step."""
        scheduler = self.requests.scheduler
        forks = [p.ForkItem(parent, children) for parent, children in self.forks.items()]
        frees, self.forks, self.frees = self.frees, {}, []
        finals, self.finals = self.finals, []
        copied, self.copied = self.copied, []
        decodes, appends, reporting = [], [], {}
        for seq in scheduler.running():
            if len(seq.unreported) == 1 and seq.num_done == seq.num_reported:
                decodes.append(seq)
            elif seq.unreported or seq.seq_id in computed:
                appends.append(p.AppendItem(seq.seq_id, seq.unreported, seq.num_done))
            else:
                continue
            reporting[seq.seq_id] = len(seq.token_ids)
        tokens = (
            p.TokenBatch(
                [s.seq_id for s in decodes],
                [s.token_ids[-1] for s in decodes],
                [s.num_done for s in decodes],
            )
            if decodes
            else None
        )
        to_place = scheduler.to_place()
        body = p.Step(
            self.worker_id,
            frees=frees,
            finals=finals,
            forks=forks,
            appends=appends,
            tokens=tokens,
            resumes=[s.seq_id for s in to_place if s.status is SeqStatus.PREEMPTED],
            admits=[self._admit_item(s) for s in to_place if s.status is SeqStatus.WAITING],
            timeline=self.timeline,
            copied=copied,
        )
        self.timeline = None
        return Sent(body, self.kv.send(body), reporting, dict(scheduler.seqs))

    def receive(self, sent: Sent) -> p.StepReply:
        """Waits for the reply to ``sent``; ``apply`` takes it in."""
        reply = self.kv.receive(sent.body, sent.call_id)
        assert isinstance(reply, p.StepReply)
        return reply

    def apply(self, sent: Sent, reply: p.StepReply) -> list[Refusal]:
        """Takes in the reply to ``sent`` (see ``_apply``); returns the refused requests."""
        return self._apply(reply, sent.reporting, sent.seqs)

    def call(self, body: p.Step) -> p.StepReply:
        return self.kv.call(body)

    def ended(self, seq: Sequence) -> None:
        """``seq`` ended: its last progress goes with the next step (``Step.finals``), so the
        blocks it computed join the prefix index even if it is freed in the same step."""
        self.finals.append(p.AppendItem(seq.seq_id, [], min(seq.num_done, seq.num_reported)))

    def _admit_item(self, seq: Sequence) -> p.AdmitItem:
        owner = self.requests.owner(seq.seq_id)
        assert owner is not None, f"{seq.seq_id}: a sequence of no request"
        adopt = seq.seq_id in self.requests.adopting
        reuse = owner.prompt_logprobs is None  # else a cached part would have no logits
        return p.AdmitItem(
            seq.seq_id, seq.token_ids, owner.record.salt, adopt=adopt, reuse_prefix=reuse
        )

    def _apply(
        self, reply: p.StepReply, reporting: dict[str, int], sent: dict[str, Sequence]
    ) -> list[Refusal]:
        """Takes in a step reply; while a running sequence got no block for its new tokens,
        preempts the latest arrival and retries (one more round trip each). Items about
        sequences that left since the Step was sent (not ``sent``'s any more) are dropped; one
        the kvstore admitted meanwhile is freed with the next Step (nothing ran on it)."""
        scheduler, refusals = self.requests.scheduler, []
        seqs = scheduler.seqs

        def live(seq_id: str) -> Sequence | None:
            seq = seqs.get(seq_id)
            return seq if seq is not None and sent.get(seq_id, seq) is seq else None

        while True:
            refused = {e.req_id for e in reply.errors if e.op == "append"}
            for placed in reply.forked:  # before the same reply's copy-on-write changes
                if (forked := live(placed.req_id)) is None:
                    continue
                if forked.block_ids[: len(placed.block_ids)] != placed.block_ids:
                    raise Diverged(f"{placed.req_id}: the fork's table differs from the kvstore's")
            for seq_id, num_tokens in reporting.items():  # accepted, table changed or not
                if seq_id not in refused and live(seq_id) is not None:
                    scheduler.reported(seq_id, num_tokens)
            for grown in reply.appended:
                if live(grown.req_id) is not None:
                    self.copies += scheduler.grown(grown.req_id, grown.new_block_ids, grown.copies)
            for req_id, _mode in reply.preempted:
                scheduler.preempted(req_id)
            for placed in reply.admitted:  # the kvstore knows every token we sent
                if (seq := live(placed.req_id)) is None:
                    self.frees.append(placed.req_id)
                    continue
                scheduler.placed(
                    seq.seq_id, placed.block_ids, placed.num_computed, len(seq.token_ids)
                )
                owner = self.requests.owner(seq.seq_id)
                assert owner is not None
                owner.cached_tokens = placed.num_cached_tokens
                self.requests.adopting.discard(seq.seq_id)
            for placed in reply.resumed:  # the kvstore knows what it held when preempted
                if (seq := live(placed.req_id)) is None:
                    continue  # its request's end freed it
                scheduler.placed(
                    seq.seq_id, placed.block_ids, placed.num_computed, seq.num_reported
                )
            errors = [e for e in reply.errors if live(e.req_id) is not None]
            refusals += [r for e in errors if (r := self._refusal(e)) is not None]
            starved = [
                e.req_id
                for e in errors
                if e.op == "append"
                and e.code == "no_space"
                and seqs[e.req_id].status is SeqStatus.RUNNING
            ]
            if not starved:
                return refusals
            victim = scheduler.victim()
            assert victim is not None, "no running sequence to preempt"
            copied = self.quiesce()
            retry = [seqs[r] for r in starved if r != victim.seq_id]
            reporting = {seq.seq_id: len(seq.token_ids) for seq in retry}
            reply = self.call(
                p.Step(
                    self.worker_id,
                    copied=copied,
                    preempts=[victim.seq_id],
                    appends=[p.AppendItem(s.seq_id, s.unreported, s.num_done) for s in retry],
                )
            )
            log.info("preempted %s for lack of blocks: %s", victim.seq_id, reply.preempted)

    def _refusal(self, error: p.ItemError) -> Refusal | None:
        """What a refused item means. None: nothing to do now (no space yet: it waits; a free
        of what the kvstore no longer holds)."""
        if error.code == "no_space" or error.op in ("free", "final"):
            return None
        if error.op == "admit" and error.req_id in self.requests.adopting:
            if error.code == "unknown_request":  # its blocks are gone: admit it, recompute
                self.requests.adopting.discard(error.req_id)
                return None
            if error.code == "conflict":  # the kvstore's lease on the dead worker runs on
                return None
        if error.code in _DIVERGED:
            raise Diverged(f"the kvstore refused {error.op} of {error.req_id!r}: {error.message}")
        owner = self.requests.owner(error.req_id)
        if owner is None:
            log.error("the kvstore refused %s: %s", error.op, error.message)
            return None
        code: ErrorCode = "invalid_request" if error.code in _REQUESTS_FAULT else "worker_error"
        return Refusal(owner, f"{error.code}: {error.message}", code)
