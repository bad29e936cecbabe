"""Beam search in the engine: one request's live beams as kvstore sequences that share blocks.

As in the PagedAttention paper, a beam that several new beams continue is forked at the kvstore
(its blocks shared, the last partial one copied on write when each child appends its token); a
beam no one continues is freed; a beam one new beam continues keeps its sequence and just appends
the token. So beams share the prompt and their common output prefix, block for block.

A search round needs the next-token logits of every live beam. A beam whose forward ran waits
(nothing pending, its logits kept here) until its siblings' ran too: they may be behind after a
preemption. The round then runs ``BeamSearch.step`` over all of them at once.

Owned by the engine's loop; it mutates the scheduler only through ``append_sampled`` and
``fork``. The scoring and stopping rules are ``compute.sampling.beam_search.BeamSearch``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from compute.batch.scheduler import Scheduler, SeqStatus, Sequence
from compute.sampling.beam_search import BeamSearch

if TYPE_CHECKING:
    from contracts.records import FinishReason, SamplingParams


@dataclass(frozen=True)
class BeamRound:
    """What one round asks of the kvstore: free ``frees``, fork ``forks`` (parent -> children)."""

    frees: list[str] = field(default_factory=list)
    forks: dict[str, list[str]] = field(default_factory=dict)


class BeamGroup:
    def __init__(
        self, root: Sequence, params: SamplingParams, eos_token_ids: Collection[int], name: str
    ) -> None:
        """``root``: the request's prompt sequence, the only live beam at first. A beam ends at
        a stop token id (EOS included unless ``ignore_eos``) or ``max_tokens``; stop strings are
        not applied. New beams' sequences are named ``{root}#{name}.{k}``: ``name`` (the
        worker's id and a tag of its process) keeps them apart from those of a dead worker that
        served it before."""
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self.search = BeamSearch(
            params.beam_width, params.max_tokens, self.stop_ids, params.length_penalty
        )
        self.live: list[Sequence] = [root]  # live beam i's sequence
        self.logits: dict[str, torch.Tensor] = {}  # seq_id -> [vocab], this round's
        self._prefix = f"{root.seq_id}#{name}."
        self._forked = 0

    @property
    def done(self) -> bool:
        return self.search.done

    def computed(self, seq: Sequence, logits: torch.Tensor) -> None:
        """``seq``'s forward reached its last token: ``logits`` [vocab] score its next token."""
        self.logits[seq.seq_id] = logits

    def ready(self) -> bool:
        """Every live beam is running with its KV complete and its logits in hand."""
        return all(
            s.status is SeqStatus.RUNNING
            and s.num_computed == len(s.token_ids)
            and s.seq_id in self.logits
            for s in self.live
        )

    def advance(self, scheduler: Scheduler) -> BeamRound:
        """One search round over the live beams' logits. Through the scheduler: appends the
        chosen tokens, forks new sequences (``live`` holds them; the caller registers them).
        Once ``done``, every live sequence is in ``frees`` and ``best`` holds the answer."""
        rows = torch.stack([self.logits[s.seq_id] for s in self.live]).float()  # [live, vocab]
        step = self.search.step(rows.log_softmax(dim=-1))
        self.logits = {}
        if step.done:
            return BeamRound(frees=[s.seq_id for s in self.live])
        kept: list[Sequence | None] = [None] * len(step.parents)  # new beam i's sequence
        frees: list[str] = []
        forks: dict[str, list[str]] = {}
        for old, seq in enumerate(self.live):
            children = [i for i, parent in enumerate(step.parents) if parent == old]
            if not children:
                frees.append(seq.seq_id)
                continue
            scheduler.append_sampled(seq, step.token_ids[children[0]])
            kept[children[0]] = seq
            for i in children[1:]:  # share the parent's reported tokens, then their own token
                child = scheduler.fork(seq, self._name(), step.token_ids[i])
                forks.setdefault(seq.seq_id, []).append(child.seq_id)
                kept[i] = child
        self.live = [s for s in kept if s is not None]
        assert len(self.live) == len(kept)
        return BeamRound(frees, forks)

    def best(
        self, n: int, decode: Callable[[list[int]], str]
    ) -> list[tuple[list[int], FinishReason, str]]:
        """The n best hypotheses, best first: (tokens, finish reason, text without the stop
        token)."""
        out: list[tuple[list[int], FinishReason, str]] = []
        for h in self.search.best(n):
            tokens = list(h.token_ids)
            stopped = bool(tokens) and tokens[-1] in self.stop_ids
            reason: FinishReason = "stop" if stopped else "length"
            out.append((tokens, reason, decode(tokens[:-1] if stopped else tokens)))
        return out

    def _name(self) -> str:
        self._forked += 1
        return f"{self._prefix}{self._forked}"
