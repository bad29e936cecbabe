"""Logits processors of sampled rows: min_tokens, logit_bias and the three penalties. Torch only.

Definitions (the clients' and vLLM's), applied in vLLM's order, before temperature and the
greedy argmax:

1. ``min_tokens``: while fewer output tokens than that exist, the sequence's stop token ids
   (``stop_token_ids``, and the EOS ids unless ``ignore_eos``) get -inf. Stop strings still
   apply, as in vLLM ("before EOS or stop_token_ids can be generated").
2. ``logit_bias``: ``logits[token] += bias`` (OpenAI).
3. ``repetition_penalty`` (Hugging Face's ``RepetitionPenaltyLogitsProcessor``, which vLLM
   extends to the prompt): every token of the prompt or the output so far gets
   ``logit * p`` if its logit is negative, else ``logit / p``.
4. ``frequency_penalty`` and ``presence_penalty`` (OpenAI): ``logits[j] -= c[j] * frequency +
   (c[j] > 0) * presence``, ``c[j]`` counting token ``j`` in the output so far.

Only the rows that use one of them (``SamplingParams.uses_processors``) are processed; the
others are left as they are. The work is batched on the device: token counts and masks are
built by one scatter over the listed rows' tokens, never by a loop over the vocabulary. The
host lists each processed row's known tokens every step (its prompt and output), so a
processed row costs host time in proportion to its length. A row's newest output token may
still be on the device (the overlapped engine feeds it to the next step before the host sees
it): ``fed`` names it, and it is counted from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compute.transfer import to_device

if TYPE_CHECKING:  # only its fields are read
    from contracts.records import SamplingParams

__all__ = ["ProcessedRow", "process_logits"]


@dataclass(frozen=True)
class ProcessedRow:
    """One row of the step's logits to process, and the tokens its processors read."""

    row: int  # its row in the logits
    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]  # the output tokens the host knows
    fed: int = -1  # >= 0: one more output token, ``source[fed]`` on the device
    banned: Sequence[int] = ()  # token ids masked with -inf (stop ids under min_tokens)


def process_logits(
    logits: torch.Tensor, rows: Sequence[ProcessedRow], source: torch.Tensor | None = None
) -> torch.Tensor:
    """logits [R, vocab] fp32 with the processors of ``rows`` applied (a new tensor; rows not
    listed are copied unchanged). ``source``: [S] int64 on the device, the tokens ``fed``
    indexes (None if no row is fed)."""
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    count = len(rows)
    index = to_device([r.row for r in rows], device)  # [P]
    part = logits.index_select(0, index)  # [P, vocab]
    flat = part.view(-1)
    banned = [i * vocab + t for i, r in enumerate(rows) for t in r.banned if t < vocab]
    if banned:
        flat.index_fill_(0, to_device(banned, device), float("-inf"))
    biased = [
        (i * vocab + int(t), b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items()
    ]
    if biased:
        where = to_device([w for w, _ in biased], device)
        flat.index_add_(0, where, to_device([b for _, b in biased], device, torch.float32))
    counts = _scatter_ones(count, vocab, [r.output for r in rows], rows, source, device)
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = _scatter_ones(count, vocab, [r.prompt for r in rows], [], None, device) + counts
        penalty = to_device([r.params.repetition_penalty for r in rows], device, torch.float32)
        penalty = penalty[:, None]  # [P, 1]
        scaled = torch.where(part < 0, part * penalty, part / penalty)
        part = torch.where(seen > 0, scaled, part)
    frequency = to_device([r.params.frequency_penalty for r in rows], device, torch.float32)
    presence = to_device([r.params.presence_penalty for r in rows], device, torch.float32)
    part = part - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
    return logits.index_copy(0, index, part)


def _scatter_ones(
    count: int,
    vocab: int,
    tokens: Sequence[Sequence[int]],
    fed_rows: Sequence[ProcessedRow],
    source: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """[count, vocab] fp32: how often each row's ``tokens`` (and its fed token, for the rows
    of ``fed_rows`` that have one) hold each token id."""
    counts = torch.zeros(count * vocab, dtype=torch.float32, device=device)
    where = [i * vocab + t for i, row in enumerate(tokens) for t in row]
    if where:
        ones = torch.ones(len(where), dtype=torch.float32, device=device)
        counts.index_add_(0, to_device(where, device), ones)
    fed = [(i, r.fed) for i, r in enumerate(fed_rows) if r.fed >= 0]
    if fed:
        assert source is not None, "a fed row needs the source of its token"
        rows = to_device([i for i, _ in fed], device)
        tokens_fed = source[to_device([f for _, f in fed], device)]
        ones = torch.ones(len(fed), dtype=torch.float32, device=device)
        counts.index_add_(0, rows * vocab + tokens_fed, ones)
    return counts.view(count, vocab)
