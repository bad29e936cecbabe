"""Per-step token choice of a compute worker: sampling, stop conditions, beam search. Torch only.

* ``sample``: batched greedy / temperature / top-k / top-p over ``[B, vocab]`` logits, applied in
  Hugging Face's default order (temperature, top-k, top-p), drawn with per-request seeds.
* ``StopChecker``: one sequence's incremental detokenization and stop conditions (max_tokens,
  EOS, stop token ids, stop strings spanning token boundaries, incomplete UTF-8 held back).
* ``BeamSearch``: one request's beam bookkeeping (Hugging Face's length penalty and early stopping
  rules); each step says which parent every new beam comes from so the worker can fork/free
  blocks in the kvstore.

Seeds. The draw of a seeded sequence at output position ``t`` is made with a ``torch.Generator``
seeded from ``blake2b(seed, seq_index, t)`` (``seq_index`` = which of the request's ``n``
sequences), so it depends on nothing but those three numbers: not on the batch, the row, other
requests, or the draws before it. The ``n`` sequences of one request therefore get distinct streams
(different ``seq_index``) that reproduce on every run, and a worker that resumes a request from its
streamed tokens (DESIGN §3: workers are stateless) continues the same streams without replaying
earlier draws. CPU generators (mt19937) use the low 32 bits of the derived seed, CUDA's Philox
all 64; the same seed gives different tokens on CPU and CUDA.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # only its fields are read
    from gateway.records import SamplingParams

__all__ = [
    "BeamSearch",
    "BeamStep",
    "Hypothesis",
    "RowState",
    "SampleOutput",
    "StopChecker",
    "StopUpdate",
    "derive_seed",
    "filter_logits",
    "sample",
    "top_continuations",
]

FinishReason = Literal["stop", "length"]
EarlyStopping = bool | Literal["never"]
REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so at most 4 tokens are incomplete


# ----------------------------------------------------------------------------- sampling


@dataclass(frozen=True)
class RowState:
    """What ``sample`` needs of one row's sequence besides its logits."""

    params: SamplingParams
    seq_index: int = 0  # which of the request's n sequences (0 .. n-1)
    num_generated: int = 0  # output tokens so far: the position of the token being drawn


@dataclass(frozen=True)
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32: log_softmax(raw logits) at the chosen token (OpenAI's)


def derive_seed(seed: int, seq_index: int, position: int) -> int:
    """A 64-bit generator seed that is a pure function of (seed, seq_index, position)."""
    digest = hashlib.blake2b(f"{seed}:{seq_index}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering: removed tokens' logits become -inf.

    logits: [B, vocab] (already temperature-scaled); top_k: [B] int64, 0 = off; top_p: [B] fp32,
    1 = off. Top-k keeps every token whose logit is >= the k-th largest; top-p then keeps, of the
    renormalized survivors, the smallest most-probable prefix whose probability reaches ``top_p``
    (at least one token). Ties at either boundary are all kept, so the result does not depend on
    sort order (Hugging Face's top-k does the same; its top-p may split a tie).
    """
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)  # [B]
    use_p = top_p < 1.0  # [B]
    if not bool((use_k | use_p).any()):
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
    shape: tuple[int, int], rows: Sequence[RowState], device: torch.device
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
    do not come here (see ``BeamSearch``).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    logits = logits.float()
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)  # [B]
    greedy = (temps == 0).to(device)  # [B]
    token_ids = logits.argmax(dim=-1)  # [B]
    if not bool(greedy.all()):
        temps = torch.where(temps == 0, 1.0, temps).to(device)  # [B]
        top_k = torch.tensor([r.params.top_k for r in rows], dtype=torch.int64, device=device)
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32, device=device)
        filtered = filter_logits(logits / temps[:, None], top_k, top_p)  # [B, vocab]
        probs = filtered.softmax(dim=-1)  # [B, vocab]
        race = probs / _exponentials(tuple(probs.shape), rows, device)  # [B, vocab]
        token_ids = torch.where(greedy, token_ids, race.argmax(dim=-1))  # [B]
    logprobs = logits.log_softmax(dim=-1).gather(1, token_ids[:, None]).squeeze(1)  # [B]
    return SampleOutput(token_ids=token_ids, logprobs=logprobs)


# ----------------------------------------------------------------------------- stop conditions


@dataclass(frozen=True)
class StopUpdate:
    """What one ``StopChecker.append`` produced."""

    text: str  # new output text, safe to stream (never part of a stop string or a partial char)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


def _common_prefix_len(a: str, b: str) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


class StopChecker:
    """One sequence's stop conditions over its output tokens, fed one token at a time.

    Token stops (checked first): a token in ``stop_token_ids``, or in ``eos_token_ids`` unless
    ``ignore_eos``, finishes with "stop"; that token's text is not part of the output. Otherwise
    the token is detokenized incrementally and the text checked for stop strings; a match finishes
    with "stop" and the output ends right before it. If several stop strings complete within one
    token, the occurrence that ends first wins (where a character-at-a-time generator would have
    stopped), ties going to the one that starts first. Otherwise the ``max_tokens``-th token
    finishes with "length".

    Detokenization decodes only a small window (the tokens since the last emitted text plus the
    chunk before them, as context for tokenizers whose decode depends on the previous token), and
    stop strings are matched on the last ``max(len(stop)) - 1`` checked characters plus the new
    text, so the per-token cost does not grow with the output. A decode ending in U+FFFD is an
    incomplete UTF-8 character: its tokens are held back until the character completes (or
    ``MAX_PENDING_TOKENS`` tokens pass: the bytes are then invalid, not incomplete, and emitted as
    decoded), and are flushed as decoded when the sequence finishes. ``context_token_ids`` (the
    prompt's last few tokens) seed the window so the first output token decodes in context.
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        decode: Callable[[Sequence[int]], str],
        context_token_ids: Sequence[int] = (),
    ) -> None:
        self._max_tokens = params.max_tokens
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= set(eos_token_ids)
        self._stops = [s for s in params.stop if s]
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        self._decode = decode
        self._ids: list[int] = list(context_token_ids)  # the decode window
        self._read = len(self._ids)  # window tokens before this are already in emitted text
        self._prefix_text = decode(self._ids) if self._ids else ""
        self._tail = ""  # last _tail_len checked characters
        self._held = 0  # characters at the end of _tail not yet emitted (a stop string's start)
        self._chunks: list[str] = []
        self.num_generated = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        """The output text emitted so far (the final output once finished)."""
        return "".join(self._chunks)

    def append(self, token_id: int) -> StopUpdate:
        """Adds the next output token; returns the new text and whether the sequence finished."""
        if self.finish_reason is not None:
            raise RuntimeError("sequence already finished")
        self.num_generated += 1
        if token_id in self._stop_ids:
            text, stop = self._flush()
            return self._finish(text, "stop", token_id if stop is None else stop)
        self._ids.append(token_id)
        at_limit = self.num_generated >= self._max_tokens
        text, stop = self._check(self._decode_new(final=at_limit))
        if stop is not None:
            return self._finish(text, "stop", stop)
        if at_limit:
            return self._finish(text + self._release_held(), "length", None)
        return StopUpdate(text)

    def _decode_new(self, final: bool) -> str:
        """New complete text of the window's unread tokens ("" while a character is open)."""
        text = self._decode(self._ids)
        pending = len(self._ids) - self._read
        if text.endswith(REPLACEMENT) and not final and pending < MAX_PENDING_TOKENS:
            return ""
        new = text[_common_prefix_len(self._prefix_text, text) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def _check(self, new: str) -> tuple[str, str | None]:
        """Matches stop strings over ``new`` checked text: (text safe to emit, matched stop)."""
        if not new:
            return "", None
        window = self._tail + new
        emitted_upto = len(self._tail) - self._held  # window[:emitted_upto] was emitted
        match = self._first_stop(window)
        if match is not None:
            out, stop = window[emitted_upto : match[0]], match[1]
        else:
            stop = None
            self._held = self._held_suffix(window)
            self._tail = window[max(0, len(window) - self._tail_len) :]
            out = window[emitted_upto : len(window) - self._held]
        self._chunks.append(out)
        return out, stop

    def _first_stop(self, window: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence in ``window`` that ends first."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _held_suffix(self, window: str) -> int:
        """Length of the longest suffix of ``window`` that is a proper prefix of a stop string."""
        held = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(window)), held, -1):
                if window.endswith(stop[:k]):
                    held = k
                    break
        return held

    def _flush(self) -> tuple[str, str | None]:
        """At the end: the open tail decoded as is, then held text (no longer a possible stop)."""
        text, stop = "", None
        if self._read < len(self._ids):
            text, stop = self._check(self._decode_new(final=True))
        return (text + self._release_held(), None) if stop is None else (text, stop)

    def _release_held(self) -> str:
        out = self._tail[len(self._tail) - self._held :]
        self._held = 0
        self._chunks.append(out)
        return out

    def _finish(self, text: str, reason: FinishReason, stop: int | str | None) -> StopUpdate:
        self.finish_reason = reason
        self.stop_reason = stop
        return StopUpdate(text, reason, stop)


# ----------------------------------------------------------------------------- beam search


def top_continuations(
    sums: torch.Tensor, logprobs: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k best (beam, token) continuations by ``sums[beam] + logprobs[beam, token]``.

    sums: [beams] fp32; logprobs: [beams, vocab] (log-softmax). Returns (scores [k'] descending,
    parents [k'] int64, tokens [k'] int64), k' = min(k, beams * vocab).
    """
    vocab = logprobs.shape[-1]
    total = (logprobs + sums[:, None]).reshape(-1)  # [beams * vocab]
    scores, flat = total.topk(min(k, total.numel()))  # [k'], [k']
    return scores, flat // vocab, flat % vocab


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]  # output tokens, the final stop token included
    sum_logprob: float
    score: float  # sum_logprob / len(token_ids) ** length_penalty


@dataclass(frozen=True)
class BeamStep:
    """One step's outcome: live beam i continues previous live beam ``parents[i]`` with
    ``token_ids[i]`` (fork that parent's blocks; free previous beams no one continues). Once
    ``done``, every beam's blocks can be freed: the answer is in ``BeamSearch.best``."""

    parents: list[int]
    token_ids: list[int]
    finished: list[Hypothesis] = field(default_factory=list)  # newly kept hypotheses
    done: bool = False


_Node = tuple[int, "_Node | None"]  # (token, parent node): a beam's tokens as a shared chain


def _tokens(node: _Node | None) -> tuple[int, ...]:
    out: list[int] = []
    while node is not None:
        out.append(node[0])
        node = node[1]
    return tuple(reversed(out))


class BeamSearch:
    """One request's beam search state, Hugging Face's semantics (``generate(num_beams=W)``).

    Each step takes the top ``K = max(2, 1 + #stop ids) * W`` continuations of the live beams;
    those among the first W that end (stop token, or ``max_tokens`` reached) become finished
    hypotheses scored ``sum_logprob / length ** length_penalty`` (the W best are kept); the first W
    that do not end become the next live beams (in score order). Starts with one live beam (the
    prompt). The search is done when every candidate ended, or W hypotheses are finished and:

    * ``early_stopping=True``: immediately;
    * ``"never"`` (default): the best live beam cannot beat the worst finished one, an exact bound
      because sums only decrease: ``best_sum / L**lp <= worst`` with ``L = max_tokens`` when
      ``lp > 0``, else the current length;
    * ``False`` (Hugging Face's default): the same test with the current length for every ``lp``,
      a heuristic when ``lp > 0`` (a longer hypothesis may still have won).
    """

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        stop_token_ids: Collection[int] = (),
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = "never",
    ) -> None:
        self.width = beam_width
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_generated = 0
        self.sums = torch.zeros(1)  # [live] fp32 logprob sums of the live beams
        self._nodes: list[_Node | None] = [None]
        self.finished: list[Hypothesis] = []  # best first, at most W
        self.done = False

    @property
    def num_live(self) -> int:
        return len(self._nodes)

    def live_tokens(self, beam: int) -> tuple[int, ...]:
        return _tokens(self._nodes[beam])

    def step(self, logprobs: torch.Tensor) -> BeamStep:
        """logprobs: [num_live, vocab] log-softmax of each live beam's next-token logits."""
        if self.done:
            raise RuntimeError("beam search is done")
        if logprobs.shape[0] != self.num_live:
            raise ValueError(f"{logprobs.shape[0]} rows for {self.num_live} live beams")
        k = max(2, 1 + len(self.stop_ids)) * self.width
        scores, parents, tokens = top_continuations(self.sums.to(logprobs), logprobs.float(), k)
        scores, parent_list, token_list = scores.cpu(), parents.tolist(), tokens.tolist()
        length = self.num_generated + 1
        ended = [length >= self.max_tokens or t in self.stop_ids for t in token_list]
        new = self._add_finished(scores, parent_list, token_list, ended, length)
        keep = [i for i, e in enumerate(ended) if not e][: self.width]
        self._nodes = [(token_list[i], self._nodes[parent_list[i]]) for i in keep]
        self.sums = scores[keep]
        self.num_generated = length
        self.done = not keep or self._cannot_improve()
        return BeamStep(
            [parent_list[i] for i in keep], [token_list[i] for i in keep], new, self.done
        )

    def _add_finished(
        self,
        scores: torch.Tensor,
        parents: list[int],
        tokens: list[int],
        ended: list[bool],
        length: int,
    ) -> list[Hypothesis]:
        penalized = (scores / (length**self.length_penalty)).tolist()  # fp32, as HF computes it
        added = [
            Hypothesis(_tokens((tok, self._nodes[parents[i]])), float(scores[i]), penalized[i])
            for i, tok in enumerate(tokens[: self.width])
            if ended[i]
        ]
        merged = sorted(self.finished + added, key=lambda h: h.score, reverse=True)
        self.finished = merged[: self.width]
        return [h for h in added if any(h is f for f in self.finished)]

    def _cannot_improve(self) -> bool:
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        lp = self.length_penalty
        horizon = self.max_tokens if self.early_stopping == "never" and lp > 0 else None
        best_possible = self.sums[:1] / ((horizon or self.num_generated) ** lp)  # [1] fp32
        return float(best_possible) <= self.finished[-1].score

    def best(self, n: int = 1) -> list[Hypothesis]:
        """The n best finished hypotheses, best first."""
        return self.finished[:n]
