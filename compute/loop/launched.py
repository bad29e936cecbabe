"""A launched model step and what processing it gives (``compute.loop.model_step`` launches and
processes them): ``Row``, ``Launched``, ``Processed``; and the pure work of a launch on its
chunks: the runner's inputs (``scheduled``, ``feed``) and the guided rows' grammar masks
(``masked``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from llguidance import LLMatcher

from compute.batch.logprobs import Logprobs, PromptLogprobs, sampled_logprobs
from compute.batch.registry import Requests
from compute.batch.requests import Active
from compute.batch.scheduler import Chunk
from compute.faults import Faults
from compute.model.runner import Feed, ForwardPath, ScheduledChunk
from compute.sampling.grammar import Masks
from compute.sampling.penalties import ProcessedRow, process_logits
from compute.sampling.sampling import RowState, sample
from compute.transfer import to_device
from contracts.records import OutputRecord
from kvstore import protocol as p

__all__ = [
    "Drawing",
    "Launched",
    "Processed",
    "Row",
    "collector",
    "draw",
    "feed",
    "masked",
    "scheduled",
]

log = logging.getLogger("pagedserve.compute")


class Row(NamedTuple):  # made per token per step: 4x cheaper than a frozen dataclass
    """One drawn token of a launched step: chunk ``chunk``'s, for branch ``branch``."""

    chunk: int
    active: Active
    branch: int  # the branch's index in its request (not ``index``: a tuple's method)
    forks: bool  # a new branch, forked from branch 0 at its first token


@dataclass
class Launched:
    """A step on the device: what it computes and where its drawn ids arrive."""

    chunks: list[Chunk]
    rows: list[Row]
    row_of: dict[str, int]  # sequence id -> the row of its own next token
    sampled: torch.Tensor | None  # [R] int64 on the device
    host: torch.Tensor | None  # [R] int64, pinned: ``sampled`` copied back
    logits: torch.Tensor  # [chunks, vocab]: read only by a ``sync`` step's processing
    beams: list[int]  # chunks of beam searches (their logits are read when processed)
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None  # around the device work
    logprobs: Logprobs | None = None  # of the rows whose request asked for them
    prompt: PromptLogprobs | None = None  # of the prompt tokens of chunks that collect them
    frees_after: list[str] = field(default_factory=list)  # to free once this is processed
    copied: list[int] = field(default_factory=list)  # copy-on-write destinations it wrote first
    path: ForwardPath = "eager"  # how its forward ran
    num_tokens: int = 0  # computed (prompt and decode)

    @property
    def sync(self) -> bool:
        """Processed right after its launch, before any kvstore call: its processing reads
        ``logits`` (beam search) or forks branches off sequences that must still be running."""
        return bool(self.beams) or any(row.forks for row in self.rows)

    def free_after(self, seq_ids: list[str]) -> None:
        """Frees these ended sequences once this step is processed (it may write them)."""
        self.frees_after += seq_ids

    def wait(self) -> list[int]:
        """Blocks until the device finished the step; its drawn ids."""
        if self.events is not None:
            self.events[1].synchronize()
        return [] if self.host is None else self.host.tolist()

    def device_ms(self) -> float:
        """Device time from the step's first kernel to its last (after ``wait``)."""
        return self.events[0].elapsed_time(self.events[1]) if self.events else 0.0


@dataclass(frozen=True)
class Processed:
    """What processing a step (or the steps of one engine step) produced: the records to
    publish and, for the next kvstore Step, what ended, forked and which copies are complete."""

    records: list[OutputRecord] = field(default_factory=list)
    done: list[Active] = field(default_factory=list)  # requests that finished (all branches)
    computed: set[str] = field(default_factory=set)  # sequences whose KV the step wrote
    forks: dict[str, list[str]] = field(default_factory=dict)  # parent -> children forked
    finals: list[p.AppendItem] = field(default_factory=list)  # ended sequences' last progress
    copied: list[int] = field(default_factory=list)  # copy-on-write destinations now complete

    @staticmethod
    def merged(outputs: list[Processed]) -> Processed:
        """The outputs of consecutive steps as one, in order."""
        if len(outputs) == 1:
            return outputs[0]
        forks: dict[str, list[str]] = {}
        for out in outputs:
            for parent, children in out.forks.items():
                forks.setdefault(parent, []).extend(children)
        return Processed(
            [record for out in outputs for record in out.records],
            [active for out in outputs for active in out.done],
            {seq_id for out in outputs for seq_id in out.computed},
            forks,
            [item for out in outputs for item in out.finals],
            [block for out in outputs for block in out.copied],
        )


def scheduled(chunk: Chunk, every_row: bool) -> ScheduledChunk:
    """What the runner computes of ``chunk`` (``every_row``: logits of each of its tokens)."""
    seq = chunk.seq
    tokens = [0] if chunk.fed else seq.token_ids[chunk.start : chunk.start + chunk.num_tokens]
    return ScheduledChunk(tokens, chunk.start, seq.block_ids, every_row, seq.seq_id)


def feed(chunks: list[Chunk], source: Launched | None) -> Feed | None:
    """Where the fed chunks' tokens are: ``source``'s draw (the step in flight)."""
    fed = [i for i, c in enumerate(chunks) if c.fed]
    if not fed:
        return None
    assert source is not None and source.sampled is not None, "a fed chunk of no step"
    rows = [source.row_of[chunks[i].seq.seq_id] for i in fed]
    return Feed(source.sampled, rows, fed)


def masked(
    logits: torch.Tensor,
    rows: list[Row],
    at: list[int],
    chunks: list[Chunk],
    source: Launched | None,
    faults: Faults,
) -> torch.Tensor:
    """``logits`` with the guided ``rows`` (at rows ``at``) masked to what their grammars
    allow next; each row's matcher work runs in its request's fault boundary. ``source``: the
    step in flight, which fed chunks' tokens come from."""
    _catch_up(rows, chunks, source, faults)
    masks = Masks(at, logits.shape[1], logits.device)
    for k, row in enumerate(rows):
        req_id = row.active.record.req_id
        if not faults.failed(req_id):
            with faults.guard(req_id, "masking its grammar"):
                masks.fill(k, _matcher(row))
    return masks.apply(logits)


def _catch_up(
    rows: list[Row], chunks: list[Chunk], source: Launched | None, faults: Faults
) -> None:
    """Guided rows of fed chunks draw after a token of the step in flight that their
    matcher has not seen: waits for that step's ids (the device runs this step's forward
    meanwhile) and lets each matcher accept its token, ahead of that step's processing."""
    late = [row for row in rows if chunks[row.chunk].fed]
    if not late or source is None:
        return
    tokens = source.wait()
    for row in late:
        branch = row.active.branches[row.branch]
        token = tokens[source.row_of[branch.seq.seq_id]]
        req_id = row.active.record.req_id
        if faults.failed(req_id):
            continue
        with faults.guard(req_id, "masking its grammar"):
            if not branch.accept(branch.seq.num_generated, token):  # in flight: not counted yet
                log.error("%s: token %d outside its grammar", branch.seq.seq_id, token)


def _matcher(row: Row) -> LLMatcher:
    """The grammar state a guided row draws from: its branch's (branch 0's for a branch
    forked at this token: they share every token before it)."""
    branches = row.active.branches
    matcher = branches[0 if row.forks else row.branch].matcher
    assert matcher is not None, "a guided row of no grammar"
    return matcher


def collector(chunk: Chunk, requests: Requests) -> Active | None:
    """The request collecting prompt logprobs that ``chunk`` computes some of, if any."""
    seq = chunk.seq
    if chunk.fed or chunk.start >= seq.num_prompt - 1:  # no prompt token to predict
        return None
    found = requests.branch(seq.seq_id)
    return found[0] if found is not None and found[0].prompt_logprobs is not None else None


class Drawing(NamedTuple):
    """The rows a launch draws tokens for, with what drawing them needs."""

    rows: list[Row]
    states: list[RowState]  # each row's sampling state
    processed: list[ProcessedRow]  # the rows ``compute.sampling.penalties`` processes
    guided: list[int]  # rows whose grammar masks them


def draw(
    logits: torch.Tensor,
    chunks: list[Chunk],
    drawing: Drawing,
    source: Launched | None,
    faults: Faults,
    cuda: bool,
) -> tuple[torch.Tensor, torch.Tensor, Logprobs | None]:
    """Enqueues the draw of ``drawing``'s rows from ``logits`` (one row per chunk of
    ``chunks``): their penalties and processors, grammar masks, sampling and logprobs, and on
    CUDA (``cuda``) the ids' copy to pinned host memory. ``source``: the step in flight (fed chunks'
    tokens). The drawn ids [R] on the device, on the host (once the device is done), and the
    logprobs."""
    rows, states, processed, guided = drawing
    index = [r.chunk for r in rows]
    drawn = logits  # one row per chunk, in order: no gather
    if index != list(range(len(chunks))):
        drawn = logits[to_device(index, logits.device)]  # [R, vocab]
    raw = drawn
    if processed:
        fed = source.sampled if source is not None else None
        drawn = process_logits(drawn.float(), processed, fed)
    if guided:
        drawn = masked(drawn, [rows[r] for r in guided], guided, chunks, source, faults)
    sampled = sample(drawn, states).token_ids  # [R]
    logprobs = sampled_logprobs(raw, sampled, [row.active.record.params for row in rows])
    host = sampled
    if cuda:
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
    return sampled, host, logprobs
