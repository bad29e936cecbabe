"""The worker's side of the kvstore: one ``Step`` round trip per engine step keeps the kvstore's
block tables and the scheduler's in step.

``KVSync`` owns the kvstore bookkeeping between two steps, privately: the frees to send, the
copy-on-write copies the kvstore asked for (the runner performs them before its next forward,
``take_copies``), the copies seen complete, and the Step whose reply is not taken in yet.
``submit`` builds the Step from what the step's processing handed it (what ended, forked, which
copies it saw complete) and sends it without waiting; ``collect`` (one engine step later) takes
the reply in: it applies it to the scheduler (placements, new blocks, preemptions; while a
running sequence got no block for its new tokens, it preempts the latest arrival and retries, one
more round trip each) and returns the requests the kvstore refused for good (``Refusal``), for
the engine to end with an error.

An error that says the kvstore's state is not what this worker thinks (an unknown request, one
owned by another worker, a table that differs) raises ``Diverged``: the engine then rebuilds its
requests from Redis and adopts their blocks again, as after an outage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from compute.batch.registry import Requests
from compute.batch.requests import Active
from compute.batch.scheduler import SeqStatus, Sequence
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
class Collected:
    """What taking in a Step's reply gave: the requests refused for good, and the seconds spent
    waiting for the reply."""

    refusals: list[Refusal]
    wait_s: float = 0.0


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


def final_item(seq: Sequence) -> p.AppendItem:
    """An ended sequence's last progress, for the next Step (``Step.finals``): the blocks it
    computed join the prefix index even if it is freed in the same step."""
    return p.AppendItem(seq.seq_id, [], min(seq.num_done, seq.num_reported))


class KVSync:
    def __init__(self, kv: KVClient, worker_id: str, requests: Requests) -> None:
        self._kv = kv
        self._worker_id = worker_id
        self._requests = requests
        self._frees: list[str] = []  # sequences to free, to send
        self._copies: list[tuple[int, int]] = []  # (src, dst) the runner owes
        self._sent: Sent | None = None  # the last Step, its reply not taken in yet

    # ------------------------------------------------------------------ what others hand in
    def free(self, seq_ids: list[str]) -> None:
        """Frees these sequences with the next Step (no launched step writes them any more)."""
        self._frees += seq_ids

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies (src, dst) the kvstore asked for, which the caller now
        makes (the runner, before its next forward or a preemption); forgets them."""
        copies, self._copies = self._copies, []
        return copies

    @property
    def owed_copies(self) -> bool:
        """Whether the runner owes copies the kvstore asked for."""
        return bool(self._copies)

    @property
    def unanswered_reports(self) -> Mapping[str, int]:
        """Sequences the last Step reported, whose reply is not applied yet -> the token count
        it told the kvstore (a frozen view: tests compare it with the kvstore's)."""
        return MappingProxyType(self._sent.reporting if self._sent is not None else {})

    # ------------------------------------------------------------------ the lag
    def submit(
        self,
        computed: set[str],
        forks: Mapping[str, list[str]],
        finals: list[p.AppendItem],
        copied: list[int],
        timeline: p.StepTimeline | None,
    ) -> None:
        """Sends the step's ``forks`` (parent -> children), ``finals`` (ended sequences' last
        progress), the frees queued, the copies ``copied`` (seen complete), reports the progress
        of every running sequence ``computed`` this step or holding unreported tokens (decodes
        as one columnar TokenBatch), resumes and admits what the scheduler places; carries
        ``timeline`` (the engine's totals) if given. Returns without waiting for the reply
        (``collect``). Until then the engine may launch a step (which feeds tokens into the
        lookahead slots of the tables it has), process one (tokens sampled meanwhile stay
        unreported) and end requests; it sends no other Step."""
        assert self._sent is None, "a Step's reply is not taken in yet"
        requests = self._requests
        frees, self._frees = self._frees, []
        decodes, appends, reporting = [], [], {}
        for seq in requests.running():
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
        to_place = requests.scheduler.to_place(requests.sequences())
        body = p.Step(
            self._worker_id,
            frees=frees,
            finals=finals,
            forks=[p.ForkItem(parent, children) for parent, children in forks.items()],
            appends=appends,
            tokens=tokens,
            resumes=[s.seq_id for s in to_place if s.status is SeqStatus.PREEMPTED],
            admits=[self._admit_item(s) for s in to_place if s.status is SeqStatus.WAITING],
            timeline=timeline,
            copied=copied,
        )
        self._sent = Sent(body, self._kv.send(body), reporting, requests.snapshot())

    def collect(self, settle: Callable[[], list[int]]) -> Collected:
        """Waits for the reply to the Step sent last, if any, and takes it in (see ``_apply``).
        ``settle`` makes the copies owed now and waits until no launched step can still write
        the pool; it returns the copies' destinations. It is called before a preemption, whose
        swap-out reads the victim's blocks and whose freed blocks may go to another request
        (which an owed copy made later would overwrite)."""
        if self._sent is None:
            return Collected([])
        sent, self._sent = self._sent, None
        clock = time.perf_counter()
        reply = self._kv.receive(sent.body, sent.call_id)
        assert isinstance(reply, p.StepReply)
        wait_s = time.perf_counter() - clock
        return Collected(self._apply(reply, sent.reporting, sent.seqs, settle), wait_s)

    def forget(self) -> None:
        """Gives up on the reply to the Step sent last (the engine rebuilds its state)."""
        if self._sent is not None:
            self._kv.forget(self._sent.call_id)
            self._sent = None

    # ------------------------------------------------------------------ applying a reply
    def _admit_item(self, seq: Sequence) -> p.AdmitItem:
        owner = self._requests.owner(seq.seq_id)
        assert owner is not None, f"{seq.seq_id}: a sequence of no request"
        adopt = self._requests.adopts(seq.seq_id)
        reuse = owner.prompt_logprobs is None  # else a cached part would have no logits
        return p.AdmitItem(
            seq.seq_id, seq.token_ids, owner.record.salt, adopt=adopt, reuse_prefix=reuse
        )

    def _apply(
        self,
        reply: p.StepReply,
        reporting: dict[str, int],
        sent: dict[str, Sequence],
        settle: Callable[[], list[int]],
    ) -> list[Refusal]:
        """Takes in a step reply; while a running sequence got no block for its new tokens,
        preempts the latest arrival and retries (one more round trip each). Items about
        sequences that left since the Step was sent (not ``sent``'s any more) are dropped; one
        the kvstore admitted meanwhile is freed with the next Step (nothing ran on it)."""
        requests, refusals = self._requests, []
        scheduler = requests.scheduler

        def live(seq_id: str) -> Sequence | None:
            seq = requests.sequence(seq_id)
            return seq if seq is not None and sent.get(seq_id, seq) is seq else None

        while True:
            refused = {e.req_id for e in reply.errors if e.op == "append"}
            for placed in reply.forked:  # before the same reply's copy-on-write changes
                if (forked := live(placed.req_id)) is None:
                    continue
                if forked.block_ids[: len(placed.block_ids)] != placed.block_ids:
                    raise Diverged(f"{placed.req_id}: the fork's table differs from the kvstore's")
            for seq_id, num_tokens in reporting.items():  # accepted, table changed or not
                if seq_id not in refused and (seq := live(seq_id)) is not None:
                    scheduler.reported(seq, num_tokens)
            for grown in reply.appended:
                if (seq := live(grown.req_id)) is not None:
                    self._copies += scheduler.grown(seq, grown.new_block_ids, grown.copies)
            for req_id, _mode in reply.preempted:
                victim = requests.sequence(req_id)
                assert victim is not None, f"{req_id}: the kvstore preempted no sequence of ours"
                scheduler.preempted(victim)
            for placed in reply.admitted:  # the kvstore knows every token we sent
                if (seq := live(placed.req_id)) is None:
                    self._frees.append(placed.req_id)
                    continue
                scheduler.placed(seq, placed.block_ids, placed.num_computed, len(seq.token_ids))
                requests.admitted(seq.seq_id, placed.num_cached_tokens)
            for placed in reply.resumed:  # the kvstore knows what it held when preempted
                if (seq := live(placed.req_id)) is None:
                    continue  # its request's end freed it
                scheduler.placed(seq, placed.block_ids, placed.num_computed, seq.num_reported)
            errors = [e for e in reply.errors if live(e.req_id) is not None]
            refusals += [r for e in errors if (r := self._refusal(e)) is not None]
            starved = [
                seq
                for e in errors
                if e.op == "append"
                and e.code == "no_space"
                and (seq := live(e.req_id)) is not None
                and seq.status is SeqStatus.RUNNING
            ]
            if not starved:
                return refusals
            victim = scheduler.victim(requests.sequences())
            assert victim is not None, "no running sequence to preempt"
            copied = settle()
            retry = [seq for seq in starved if seq is not victim]
            reporting = {seq.seq_id: len(seq.token_ids) for seq in retry}
            reply = self._kv.call(
                p.Step(
                    self._worker_id,
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
        if error.op == "admit" and self._requests.adopts(error.req_id):
            if error.code == "unknown_request":  # its blocks are gone: admit it, recompute
                self._requests.adoption_failed(error.req_id)
                return None
            if error.code == "conflict":  # the kvstore's lease on the dead worker runs on
                return None
        if error.code in _DIVERGED:
            raise Diverged(f"the kvstore refused {error.op} of {error.req_id!r}: {error.message}")
        owner = self._requests.owner(error.req_id)
        if owner is None:
            log.error("the kvstore refused %s: %s", error.op, error.message)
            return None
        code: ErrorCode = "invalid_request" if error.code in _REQUESTS_FAULT else "worker_error"
        return Refusal(owner, f"{error.code}: {error.message}", code)
