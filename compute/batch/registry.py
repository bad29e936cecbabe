"""What a compute worker knows of the requests it serves, in one owner: ``Requests``.

A request (``Active``) has sampled branches (``n`` sequences, the ones beyond the first forked
after the prompt) or a beam search (its live beams); each sequence is a scheduler ``Sequence``
and a kvstore request. ``Requests`` is the one map of them: request ids to requests, sequence
ids to each sequence with the request (and branch) it belongs to. Sequences enter through it
(made by the scheduler, whose policy it hands them to: ``sequences``) and leave through
``finish``/``remove``. Owned by the engine's loop; a new one is made when the worker rebuilds
its state after losing the kvstore or Redis.

``n > 1``: a request's first sampling row draws n tokens (one seeded stream per branch); the
branches beyond the first are forked from it at the kvstore in the same step (the prompt's blocks
shared, the last one copied on write) and stream under their own index. A branch that ends on
its first token is never forked.
Beam search (``beam_width > 1``): the live beams are sequences that share blocks through fork
(``compute.batch.beams``); the request publishes its ``n`` best hypotheses when the search ends.
Taking over an ``n > 1`` request adopts each unfinished branch; a beam search restarts on the
prompt's blocks (nothing of it was streamed), which gives the same answer: its scoring is
deterministic.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Collection, Iterator
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

from compute.batch.admission import SEQUENCE_MARK
from compute.batch.beams import BeamGroup
from compute.batch.requests import Active, Branch
from compute.batch.scheduler import Scheduler, SeqStatus, Sequence, running
from compute.faults import RequestError
from compute.sampling.stops import StopChecker
from contracts.records import RequestRecord, Streamed

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from compute.sampling.grammar import Grammars


class _Held(NamedTuple):
    """A sequence, the request it belongs to, and its branch (None: a beam)."""

    seq: Sequence
    active: Active
    branch: Branch | None


class Requests:
    def __init__(
        self,
        scheduler: Scheduler,
        decode: Callable[[Seq[int]], str],
        eos_ids: Collection[int],
        worker_id: str,
        grammars: Callable[[], Grammars] | None = None,
    ) -> None:
        """``decode``: token ids -> output text (the stop checkers'); ``worker_id`` and a
        random tag name the beams this process forks, apart from those of a dead worker that
        served a request before, a previous life of this worker's id included;
        ``grammars``: the worker's grammar compiler (made on first use), for guided requests."""
        self.scheduler = scheduler
        self._decode = decode
        self._eos_ids = eos_ids
        self._beam_name = f"{worker_id}-{secrets.token_hex(4)}"
        self._grammars = grammars
        self.active: dict[str, Active] = {}  # by request id
        self._seqs: dict[str, _Held] = {}  # by sequence id: branches and live beams
        self._adopting: set[str] = set()  # sequences to adopt at the kvstore, not admit

    # ------------------------------------------------------------------ entering
    def start(self, entry_id: str, record: RequestRecord) -> Active:
        """A request from its first token: its first branch, or its beam search's root. Raises
        (a refused guide: GrammarError; a request id already served: RequestError) leaving
        nothing of the request behind."""
        with self._entering(record.req_id):
            return self._start(entry_id, record)

    def _start(self, entry_id: str, record: RequestRecord) -> Active:
        if record.params.guide is not None:
            self._matcher(record)  # compiled (and cached) now: a refusal changes nothing
        beams = record.params.beam_width > 1
        limit = None if beams else record.params.max_tokens
        seq = self.scheduler.new_sequence(
            record.req_id, record.prompt_token_ids, max_tokens=limit, priority=record.priority
        )
        active = Active(entry_id, record, {})
        if record.params.prompt_logprobs is not None:
            active.prompt_logprobs = [None] * len(record.prompt_token_ids)
        self.active[record.req_id] = active
        if beams:
            active.beams = BeamGroup(seq, record.params, self._eos_ids, self._beam_name)
            self._hold(_Held(seq, active, None))
        else:
            self.add_branch(active, seq, 0)
        return active

    def resume_streamed(self, entry_id: str, record: RequestRecord, streamed: Streamed) -> Active:
        """A request another worker (or this one, before an outage) served: each unfinished
        branch continues from the tokens it streamed, to be adopted at the kvstore. A beam
        search (nothing streamed until it ends) or a request that streamed nothing starts again,
        also adopting what the kvstore kept of its prompt. Raises as ``start`` does, leaving
        nothing of the request behind."""
        if record.params.beam_width > 1 or not streamed.sequences:
            active = self.start(entry_id, record)
            self._adopting.add(record.req_id)
            return active
        with self._entering(record.req_id):
            return self._resume(entry_id, record, streamed)

    def _resume(self, entry_id: str, record: RequestRecord, streamed: Streamed) -> Active:
        if record.params.guide is not None:
            self._matcher(record)
        active = Active(entry_id, record, {}, live=0)
        self.active[record.req_id] = active
        for index in range(record.params.n):
            streamed_seq = streamed.sequences[index]  # all n stream from the first token on
            if streamed_seq.finish_reason is not None:
                continue
            seq_id = record.req_id if index == 0 else f"{record.req_id}#{index}"
            generated = streamed_seq.token_ids
            seq = self.scheduler.new_sequence(
                seq_id,
                record.prompt_token_ids,
                generated,
                record.params.max_tokens,
                record.priority,
            )
            branch = self.add_branch(active, seq, index)
            self._adopting.add(seq_id)
            active.branch_started()
            for offset, token in enumerate(generated):  # the stop checker, the grammar and
                branch.accept(offset, token)  # the seeded stream continue from here
                branch.stop.append(token, last=branch.seq.last_allowed(offset))
        return active

    @contextlib.contextmanager
    def _entering(self, req_id: str) -> Iterator[None]:
        """Adds request ``req_id`` (new here) all or nothing: an exception in the block
        forgets whatever of it the block added."""
        if req_id in self.active:
            raise RequestError(f"request {req_id} is already being served")
        try:
            yield
        except BaseException:
            self._forget(req_id)
            raise

    def add_branch(self, active: Active, seq: Sequence, index: int) -> Branch:
        """A new branch of ``active`` on ``seq``, with its own stop checker and, if guided, its
        own grammar matcher (nothing accepted yet)."""
        record = active.record
        context = record.prompt_token_ids[-4:]
        matcher, grammar_eos = None, None
        if record.params.guide is not None:
            matcher = self._matcher(record)
            grammar_eos = self._compiler().eos_token_id
        stop = StopChecker(record.params, self._eos_ids, self._decode, context, grammar_eos)
        branch = Branch(index, seq, stop, matcher)
        self._hold(_Held(seq, active, branch))
        active.branches[index] = branch
        return branch

    def _hold(self, held: _Held) -> None:
        if held.seq.seq_id in self._seqs:
            raise ValueError(f"sequence {held.seq.seq_id!r} already exists")
        self._seqs[held.seq.seq_id] = held

    def fork_branch(self, active: Active, index: int, first_token: int) -> Branch:
        """Branch ``index`` of an ``n > 1`` request, forked from branch 0 right after its first
        token was sampled (the scheduler's fork: it shares branch 0's blocks). The caller
        counted it in ``active.live`` already."""
        parent = active.branches[0].seq
        child = self.scheduler.fork(parent, f"{parent.seq_id}#{index}", first_token)
        return self.add_branch(active, child, index)

    def add_beams(self, active: Active) -> None:
        """The live beams of ``active``'s search that are new here (forked by its last round)."""
        assert active.beams is not None
        for seq in active.beams.live:
            if seq.seq_id not in self._seqs:
                self._hold(_Held(seq, active, None))

    def _compiler(self) -> Grammars:
        assert self._grammars is not None, "a guided request on a worker with no grammars"
        return self._grammars()

    def _matcher(self, record: RequestRecord) -> LLMatcher:
        assert record.params.guide is not None
        return self._compiler().matcher(record.params.guide)

    # ------------------------------------------------------------------ lookups
    def sequences(self) -> list[Sequence]:
        """Every sequence served (branches and live beams), for the scheduler's policy."""
        return [held.seq for held in self._seqs.values()]

    def running(self) -> list[Sequence]:
        """The running sequences, oldest first."""
        return running(self.sequences())

    def sequence(self, seq_id: str) -> Sequence | None:
        held = self._seqs.get(seq_id)
        return held.seq if held is not None else None

    def snapshot(self) -> dict[str, Sequence]:
        """The sequences now, by id (a copy: whether one left since is ``sequence(id) is``)."""
        return {seq_id: held.seq for seq_id, held in self._seqs.items()}

    def branch(self, seq_id: str) -> tuple[Active, Branch] | None:
        held = self._seqs.get(seq_id)
        if held is None or held.branch is None:
            return None
        return held.active, held.branch

    def beam_search(self, seq_id: str) -> Active | None:
        """The request whose live beam ``seq_id`` is, if it is one."""
        held = self._seqs.get(seq_id)
        return held.active if held is not None and held.branch is None else None

    def owner(self, seq_id: str) -> Active | None:
        held = self._seqs.get(seq_id)
        return held.active if held is not None else None

    def adopts(self, seq_id: str) -> bool:
        """Whether sequence ``seq_id`` is to be adopted at the kvstore (a request taken over:
        its blocks may be kept there), not admitted."""
        return seq_id in self._adopting

    def gateways(self) -> list[str]:
        """The gateways waiting for these requests (their liveness keys are checked)."""
        return sorted({a.record.gateway for a in self.active.values() if a.record.gateway})

    # ------------------------------------------------------------------ the kvstore's word
    def admitted(self, seq_id: str, cached_tokens: int) -> None:
        """The kvstore placed sequence ``seq_id`` (admitted or adopted it), ``cached_tokens``
        of its prompt found in its cache."""
        owner = self.owner(seq_id)
        assert owner is not None
        owner.cached_tokens = cached_tokens
        self._adopting.discard(seq_id)

    def adoption_failed(self, seq_id: str) -> None:
        """The kvstore no longer holds sequence ``seq_id``'s blocks: it is admitted instead
        (and recomputed)."""
        self._adopting.discard(seq_id)

    # ------------------------------------------------------------------ leaving
    def finish(self, seq_id: str) -> None:
        """Sequence ``seq_id`` ended (its request may go on): forgotten here, finished for the
        scheduler. Freeing it at the kvstore is the caller's."""
        held = self._seqs.pop(seq_id, None)
        if held is not None:
            self.scheduler.finish(held.seq)
        self._adopting.discard(seq_id)

    def done(self, active: Active) -> None:
        """Request ``active`` finished: every sequence already ``finish``ed."""
        del self.active[active.record.req_id]

    def remove(self, active: Active) -> list[str]:
        """Forgets request ``active`` and every sequence of it. Returns the ids of those the
        kvstore holds (running or preempted): the caller frees them."""
        return self._forget(active.record.req_id)

    def _forget(self, req_id: str) -> list[str]:
        """Forgets request ``req_id`` and every sequence of it (its id, or its id and ``#``:
        what a failure half-way through adding or forking one left too). Returns the ids of
        those the kvstore holds."""
        self.active.pop(req_id, None)
        prefix = req_id + SEQUENCE_MARK
        ids = [k for k in self._seqs if k == req_id or k.startswith(prefix)]
        kept = []
        for seq_id in ids:
            seq = self._seqs.pop(seq_id).seq
            if seq.status in (SeqStatus.RUNNING, SeqStatus.PREEMPTED):
                kept.append(seq_id)
            self._adopting.discard(seq_id)
            self.scheduler.finish(seq)
        return kept
