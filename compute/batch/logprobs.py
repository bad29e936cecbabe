"""Log-probabilities a step computes: of its sampled tokens and of the prompt tokens its
chunks cover, as the host reads them back (``Logprobs``, ``PromptLogprobs``).

Both come from the model's raw distribution (before penalties and temperature). They are
enqueued on the device with the step and copied to pinned host memory without waiting; the host
reads them when it processes the step. A request that collects prompt logprobs gets the logits
of every row of its prompt chunks (``ScheduledChunk.every_row``): memory per step is bounded by
the step's token budget times the vocabulary, never by the prompt's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from compute.batch.requests import Active
from compute.batch.scheduler import Chunk
from compute.faults import Faults
from compute.transfer import to_device
from contracts.records import SamplingParams, TokenLogprob

__all__ = ["Logprobs", "PromptLogprobs", "sampled_logprobs", "split_prompt_rows"]


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of a launched step's sampled tokens, for ``rows`` (indices into its
    rows), copied to the host (read after ``Launched.wait``)."""

    rows: list[int]
    counts: list[int]  # how many top tokens each row's request asked for
    chosen: torch.Tensor  # [W] float32: each row's sampled token
    top_ids: torch.Tensor  # [W, k] int64: the k most likely tokens, best first
    top_values: torch.Tensor  # [W, k] float32

    @cached_property
    def _host(self) -> tuple[dict[int, int], list[float], list[list[int]], list[list[float]]]:
        return (
            {row: i for i, row in enumerate(self.rows)},
            self.chosen.tolist(),
            self.top_ids.tolist(),
            self.top_values.tolist(),
        )

    def of(self, row: int) -> TokenLogprob | None:
        """Row ``row``'s token's ``TokenLogprob``, with its request's ``logprobs`` top tokens
        (None: its request asked for none). Read after ``Launched.wait``."""
        index, chosen, ids, values = self._host
        i = index.get(row)
        if i is None:
            return None
        k = self.counts[i]
        return TokenLogprob(chosen[i], list(zip(ids[i][:k], values[i][:k], strict=True)))


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens computed by a launched step: target ``i`` is the
    token at position ``positions[i]`` of ``owners[i]``'s prompt (``logprobs`` row ``i``)."""

    owners: list[Active]
    positions: list[int]
    logprobs: Logprobs

    def store_each(self, faults: Faults) -> None:
        """Stores each row (``store``) inside its request's fault boundary."""
        for i, owner in enumerate(self.owners):
            try:
                self.store(i)
            except Exception as err:
                faults.record(owner.record.req_id, "storing its prompt logprobs", err)

    def store(self, i: int) -> None:
        """Target ``i`` into its owner's ``prompt_logprobs`` (after ``Launched.wait``; an owner
        whose first record went out meanwhile collects no more)."""
        collected = self.owners[i].prompt_logprobs
        if collected is not None:
            collected[self.positions[i]] = self.logprobs.of(i)


def split_prompt_rows(
    chunks: list[Chunk], collects: list[Active | None], logits: torch.Tensor
) -> tuple[torch.Tensor, PromptLogprobs]:
    """Splits ``logits`` (the runner's kept rows: every row of a collecting chunk, the last
    of the others) into one row per chunk and the prompt logprobs the others predict."""
    last, rows, tokens, owners, positions, counts = [], [], [], [], [], []
    row = 0
    for chunk, owner in zip(chunks, collects, strict=True):
        kept = chunk.num_tokens if owner is not None else 1
        last.append(row + kept - 1)
        if owner is not None:
            seq, k = chunk.seq, owner.record.params.prompt_logprobs or 0
            end = min(chunk.start + chunk.num_tokens, seq.num_prompt - 1)
            for position in range(chunk.start + 1, end + 1):  # predicted by the row before
                rows.append(row + position - 1 - chunk.start)
                tokens.append(seq.token_ids[position])
                owners.append(owner)
                positions.append(position)
                counts.append(k)
        row += kept
    device = logits.device
    prompt_logits = logits.index_select(0, to_device(rows, device))
    entries = _logprobs_of(prompt_logits, to_device(tokens, device), list(range(len(rows))), counts)
    prompt = PromptLogprobs(owners, positions, entries)
    return logits.index_select(0, to_device(last, device)), prompt


def sampled_logprobs(
    logits: torch.Tensor, sampled: torch.Tensor, params: list[SamplingParams]
) -> Logprobs | None:
    """The log-probabilities of the sampled tokens of the rows whose request asked for them,
    from ``logits`` (before penalties and temperature), and of each row's top ``k`` (the most
    any of them asked for: each row's record keeps its own), copied to the host without
    waiting. None if no row asked."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    counts = [params[i].logprobs or 0 for i in rows]
    index = to_device(rows, logits.device)
    return _logprobs_of(logits.index_select(0, index), sampled.index_select(0, index), rows, counts)


def _logprobs_of(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], counts: list[int]
) -> Logprobs:
    """``Logprobs`` of ``rows``, whose logits [W, vocab] and chosen ``tokens`` [W] (on the
    device) are given in that order; each keeps its ``counts`` top tokens."""
    logprob = torch.log_softmax(logits.float(), dim=-1)  # [W, vocab]
    chosen = logprob.gather(1, tokens[:, None])[:, 0]  # [W]
    values, ids = logprob.topk(max(counts), dim=-1)  # [W, k]
    return Logprobs(rows, counts, *(_to_host(t) for t in (chosen, ids, values)))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in pinned host memory, enqueued (read it after the step's event)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
