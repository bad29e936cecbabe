"""What a compute worker knows of each request it serves, and the output records it publishes.

Owned by the worker's ``compute.batch.registry.Requests``; rebuilt from Redis when another worker
takes a request over.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from compute.batch.beams import BeamGroup
from compute.batch.scheduler import SeqStatus, Sequence
from compute.sampling.stops import StopChecker
from contracts.records import FinishReason, OutputRecord, RequestRecord, TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass
class Branch:
    """One of a request's n sampled sequences (index 0 is the request's own kvstore request)."""

    index: int
    seq: Sequence
    stop: StopChecker
    matcher: LLMatcher | None = None  # its grammar's state, when the request is guided
    consumed: int = 0  # output tokens the matcher accepted (one ahead while a step is in flight)

    def accept(self, offset: int, token: int) -> bool:
        """The matcher accepts output token ``offset`` unless it has already; False if the
        grammar refuses it."""
        if self.matcher is None or self.consumed > offset:
            return True
        assert self.consumed == offset, f"{self.seq.seq_id}: token {offset} after {self.consumed}"
        self.consumed += 1
        return bool(self.matcher.consume_token(token))


@dataclass
class Active:
    """A request this worker serves: its sampled branches (the n > 1 beyond the first are forked
    after the prompt), or its beam search."""

    entry_id: str
    record: RequestRecord
    branches: dict[int, Branch]  # by index (< n)
    live: int = 1  # branches not finished
    cached_tokens: int = 0
    beams: BeamGroup | None = None
    # the prompt's logprobs by position (the first None), while they are collected: from the
    # start of a request that asks for them until its first record carries them; None else
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @cached_property
    def processed(self) -> bool:
        """Its rows go through ``compute.sampling.penalties`` (decided once: the params are
        frozen)."""
        return self.record.params.uses_processors()

    def branch_started(self) -> None:
        """A branch joined (one forked at its first token, one resumed): one more is live."""
        self.live += 1

    def branch_ended(self) -> None:
        """A branch finished: one fewer is live (none: the request is done)."""
        self.live -= 1

    def search_ended(self) -> None:
        """Its beam search ended: nothing of it is live."""
        self.live = 0

    def sequences(self) -> list[Sequence]:
        """Every sequence of the request that is not finished."""
        beams = self.beams.live if self.beams else []
        return [b.seq for b in self.branches.values()] + beams

    def held(self) -> list[Sequence]:
        """The sequences that are kvstore requests (running or preempted)."""
        held = (SeqStatus.RUNNING, SeqStatus.PREEMPTED)
        return [s for s in self.sequences() if s.status in held]


def output_record(
    active: Active,
    index: int,
    tokens: list[int],
    reason: FinishReason | None,
    final: bool,
    text: str = "",
    offset: int = 0,
    error: str | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> OutputRecord:
    """One delta of sequence ``index`` (``offset``: its tokens before these); ``final`` ends
    the request. The request's first record with tokens takes its prompt logprobs (mutates
    ``active.prompt_logprobs``: None after)."""
    prompt_logprobs = None
    if tokens and active.prompt_logprobs is not None:
        prompt_logprobs, active.prompt_logprobs = active.prompt_logprobs, None
    return OutputRecord(
        active.record.req_id,
        index,
        tokens,
        reason,
        error=error,
        prompt_tokens=len(active.record.prompt_token_ids),
        cached_tokens=active.cached_tokens,
        final=final,
        text=text,
        offset=offset,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
