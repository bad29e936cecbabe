"""Stop conditions of a compute worker's sampled sequences, with incremental detokenization.

* ``StopChecker``: one sequence's incremental detokenization and stop conditions (the length
  limit, EOS, stop token ids, stop strings spanning token boundaries, incomplete UTF-8 held
  back).
* ``StopUpdate``: what one token appended to a ``StopChecker`` produced (new text, finish).

Beam search has its own stopping rules (``compute.sampling.beam_search``). Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:  # only its fields are read
    from contracts.records import SamplingParams

__all__ = ["StopChecker", "StopUpdate"]

FinishReason = Literal["stop", "length"]
REPLACEMENT = "\ufffd"
MAX_PENDING_TOKENS = 4  # a UTF-8 character has at most 4 bytes, so at most 4 tokens are incomplete


class StopUpdate(NamedTuple):  # made per token per step: 4x cheaper than a frozen dataclass
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
    stopped), ties going to the one that starts first. Otherwise the token the caller marks
    ``last`` (the last the length limit allows: the sequence's ``max_tokens``-th, which the
    scheduler's ``Sequence`` counts) finishes with "length". The checker counts no tokens.

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
        grammar_eos: int | None = None,
    ) -> None:
        """``grammar_eos``: a guided sequence's grammar ends with this token (its tokenizer's
        EOS): it stops the sequence, ``ignore_eos`` or not."""
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids |= set(eos_token_ids)
        if grammar_eos is not None:
            self._stop_ids.add(grammar_eos)
        self._stops = [s for s in params.stop if s]
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1
        self._decode = decode
        self._ids: list[int] = list(context_token_ids)  # the decode window
        self._read = len(self._ids)  # window tokens before this are already in emitted text
        self._prefix_text = decode(self._ids) if self._ids else ""
        self._tail = ""  # last _tail_len checked characters
        self._held = 0  # characters at the end of _tail not yet emitted (a stop string's start)
        self._chunks: list[str] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The token ids that finish the sequence (``min_tokens`` masks them until then)."""
        return frozenset(self._stop_ids)

    @property
    def text(self) -> str:
        """The output text emitted so far (the final output once finished)."""
        return "".join(self._chunks)

    def append(self, token_id: int, last: bool = False) -> StopUpdate:
        """Adds the next output token (``last``: the last one the length limit allows; it
        finishes the sequence, with "length" unless a stop does); returns the new text and
        whether the sequence finished. Raises once the sequence has finished."""
        if self.finish_reason is not None:
            raise RuntimeError("sequence already finished")
        if token_id in self._stop_ids:
            text, stop = self._flush()
            return self._finish(text, "stop", token_id if stop is None else stop)
        self._ids.append(token_id)
        text, stop = self._check(self._decode_new(final=last))
        if stop is not None:
            return self._finish(text, "stop", stop)
        if last:
            return self._finish(text + self._release_held(), "length", None)
        return StopUpdate(text)

    def _decode_new(self, final: bool) -> str:
        """New complete text of the window's unread tokens ("" while a character is open)."""
        text = self._decode(self._ids)
        pending = len(self._ids) - self._read
        if text.endswith(REPLACEMENT) and not final and pending < MAX_PENDING_TOKENS:
            return ""
        prefix = self._prefix_text
        cut = len(prefix) if text.startswith(prefix) else _common_prefix_len(prefix, text)
        new = text[cut:]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def _check(self, new: str) -> tuple[str, str | None]:
        """Matches stop strings over ``new`` checked text: (text safe to emit, matched stop)."""
        if not new:
            return "", None
        if not self._stops:  # nothing to match, nothing held back
            self._chunks.append(new)
            return new, None
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
