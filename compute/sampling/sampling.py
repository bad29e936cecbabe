"""Per-step token choice of a compute worker for sampled (non-beam) rows. Torch only.

* ``sample``: batched greedy / temperature / top-k / top-p over ``[B, vocab]`` logits, applied in
  Hugging Face's default order (temperature, top-k, top-p), drawn with per-request seeds.
* ``filter_logits``: the top-k / top-p filtering ``sample`` applies.
* ``RowState``: what ``sample`` needs of a row's sequence; ``derive_seed``: its draw's seed.

Stop conditions are ``compute.sampling.stops``'s, beam-search scoring
``compute.sampling.beam_search``'s.

Seeds. The draw of a seeded sequence at output position ``t`` is made with a ``torch.Generator``
seeded from ``blake2b(seed, seq_index, t)`` (``seq_index`` = which of the request's ``n``
sequences), so it depends on nothing but those three numbers: not on the batch, the row, other
requests, or the draws before it. The ``n`` sequences of one request therefore get distinct streams
(different ``seq_index``) that reproduce on every run, and a worker that resumes a request from its
streamed tokens (workers are stateless: docs/architecture.md) continues the same streams without
replaying earlier draws. CPU generators (mt19937) use the low 32 bits of the derived seed, CUDA's
Philox all 64; the same seed gives different tokens on CPU and CUDA.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from compute.transfer import to_device

if TYPE_CHECKING:  # only its fields are read
    from contracts.records import SamplingParams

__all__ = ["RowState", "SampleOutput", "derive_seed", "filter_logits", "sample"]


class RowState(NamedTuple):  # made per token per step: 4x cheaper than a frozen dataclass
    """What ``sample`` needs of one row's sequence besides its logits."""

    params: SamplingParams
    seq_index: int = 0  # which of the request's n sequences (0 .. n-1)
    num_generated: int = 0  # output tokens so far: the position of the token being drawn


@dataclass(frozen=True)
class SampleOutput:
    """What ``sample`` chose: one token per row."""

    token_ids: torch.Tensor  # [B] int64


def derive_seed(seed: int, seq_index: int, position: int) -> int:
    """A 64-bit generator seed that is a pure function of (seed, seq_index, position)."""
    digest = hashlib.blake2b(f"{seed}:{seq_index}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, needed: bool | None = None
) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering: removed tokens' logits become -inf.

    logits: [B, vocab] (already temperature-scaled); top_k: [B] int64, 0 = off; top_p: [B] fp32,
    1 = off. Top-k keeps every token whose logit is >= the k-th largest; top-p then keeps, of the
    renormalized survivors, the smallest most-probable prefix whose probability reaches ``top_p``
    (at least one token). Ties at either boundary are all kept, so the result does not depend on
    sort order (Hugging Face's top-k does the same; its top-p may split a tie). ``needed``:
    whether any row filters, when the caller knows it (else it is read from the device: a sync).
    """
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)  # [B]
    use_p = top_p < 1.0  # [B]
    if needed is None:
        needed = bool((use_k | use_p).any())
    if not needed:
        return logits
    ordered = logits.sort(dim=-1, descending=True).values  # [B, vocab]
    k = torch.where(use_k, top_k, vocab).clamp(1, vocab)  # [B]
    kth = ordered.gather(1, (k - 1)[:, None])  # [B, 1]
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))  # [B, vocab]
    probs = ordered.softmax(dim=-1)  # [B, vocab]
    mass_before = probs.cumsum(dim=-1) - probs  # [B, vocab], exactly 0 at rank 0
    keep = ((mass_before < top_p[:, None]) | ~use_p[:, None]) & (ordered > float("-inf"))
    keep[:, 0] = True
    last = keep.sum(dim=-1, keepdim=True) - 1  # [B, 1] rank of the last kept token
    threshold = ordered.gather(1, last)  # [B, 1]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _exponentials(
    shape: torch.Size, rows: Sequence[RowState], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [B, vocab]; seeded rows from their own (seed, seq_index, position) stream."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_()  # [B, vocab]
    generator = torch.Generator(device=device)
    for i, row in enumerate(rows):
        seed = row.params.seed
        if seed is not None and row.params.temperature > 0:
            generator.manual_seed(derive_seed(seed, row.seq_index, row.num_generated))
            noise[i].exponential_(generator=generator)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)  # never 0: p/0 would be nan or inf


def sample(logits: torch.Tensor, rows: Sequence[RowState]) -> SampleOutput:
    """Chooses one token per row. logits: [B, vocab] fp32, one row per ``rows`` entry.

    ``temperature == 0``: argmax of the raw logits (Hugging Face greedy; first index on ties; top-k
    and top-p are ignored). Otherwise temperature, top-k, top-p, then an exponential race
    ``argmax(p / E)``, ``E ~ Exp(1)`` per token, which draws exactly from ``p``. Beam-search rows
    do not come here (see ``compute.sampling.beam_search.BeamSearch``).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    logits = logits.float()
    device = logits.device
    token_ids = logits.argmax(dim=-1)  # [B]
    if any(r.params.temperature > 0 for r in rows):  # decided on the host: no device sync
        vocab = logits.shape[-1]
        params = [r.params for r in rows]
        greedy = to_device([p.temperature == 0 for p in params], device, torch.bool)  # [B]
        temps = to_device([p.temperature or 1.0 for p in params], device, torch.float32)  # [B]
        top_k = to_device([p.top_k for p in params], device)  # [B]
        top_p = to_device([p.top_p for p in params], device, torch.float32)  # [B]
        needed = any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params)
        filtered = filter_logits(logits / temps[:, None], top_k, top_p, needed)  # [B, vocab]
        probs = filtered.softmax(dim=-1)  # [B, vocab]
        race = probs / _exponentials(probs.shape, rows, device)  # [B, vocab]
        token_ids = torch.where(greedy, token_ids, race.argmax(dim=-1))  # [B]
    return SampleOutput(token_ids=token_ids)
