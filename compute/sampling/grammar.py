"""Structured output on a worker: a grammar matcher per guided sequence, and the token masks of
a step's guided rows.

llguidance computes each guided row's allowed tokens on the host, as a bitmask of
``ceil(vocab / 32)`` int32 words (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed); the
bitmask is copied to the device and unpacked there by torch, and every disallowed token's logit
becomes -inf, after the penalties and before temperature and sampling. A grammar allows its EOS
only once it is complete, and a guided sequence always stops at EOS (``ignore_eos`` or not), so
its output is complete unless ``max_tokens`` cuts it first ("length", as OpenAI's).

The overlapped engine feeds a sequence's drawn token to the next step before the host has seen
it, and a guided row's next mask needs that token. The mask is needed only to draw, after the
forward pass: the engine enqueues step N+1's forward, then waits for step N's ids (the device
runs N+1's forward meanwhile), lets the matchers accept them and computes N+1's masks
(``compute.loop.launched.masked``). A matcher that ended (or refused a token) allows only EOS: a row
drawn after its sequence stopped, which the lag makes possible, draws EOS and is dropped.
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance
import torch
from transformers import PreTrainedTokenizerBase

from compute.faults import RequestError
from compute.transfer import to_device
from contracts.guides import GuidesUnsupported, grammar_of, grammar_tokenizer
from contracts.records import Guide

__all__ = ["GrammarError", "Grammars", "GrammarsOnce", "GuidesUnsupported", "Masks", "mask_rows"]

_WORD = 32  # tokens per bitmask word


class GrammarError(RequestError):
    """A guide the grammar engine refuses (the gateway checks guides first: rare here)."""


class Grammars:
    """One worker's grammar compiler: its tokenizer's vocabulary as llguidance sees it, and the
    last ``cache_size`` compiled guides (compiling a JSON Schema takes about a millisecond; a
    copy of a compiled one, a few microseconds). Raises ``GuidesUnsupported`` for a tokenizer
    the grammar engine cannot read."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, cache_size: int = 256
    ) -> None:
        self._tokenizer = grammar_tokenizer(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._compiled: OrderedDict[Guide, llguidance.LLMatcher] = OrderedDict()

    @property
    def eos_token_id(self) -> int:
        """The token a grammar allows once it is complete."""
        return int(self._tokenizer.eos_token)

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher of ``guide`` (nothing accepted yet). Raises GrammarError."""
        compiled = self._compiled.get(guide)
        if compiled is None:
            try:
                compiled = llguidance.LLMatcher(self._tokenizer, grammar_of(guide), log_level=0)
            except ValueError as err:
                raise GrammarError(f"the {guide.kind} guide is refused: {err}") from err
            if compiled.is_error():
                raise GrammarError(f"the {guide.kind} guide is refused: {compiled.get_error()}")
            self._compiled[guide] = compiled
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(guide)
        return compiled.deep_copy()


class GrammarsOnce:
    """A worker's grammar compiler (its tokenizer's vocabulary, ``vocab_size`` wide: the
    logits'), made at the first call, once; each call returns it. Raises ``RequestError``
    (unsupported_parameter) for a model whose tokenizer the grammar engine cannot read."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._made: Grammars | GuidesUnsupported | None = None

    def __call__(self) -> Grammars:
        if self._made is None:
            try:
                self._made = Grammars(self._tokenizer, self._vocab_size)
            except GuidesUnsupported as err:
                self._made = err
        if isinstance(self._made, GuidesUnsupported):
            raise RequestError(str(self._made), "unsupported_parameter")
        return self._made


class Masks:
    """The token masks of a step's guided rows, filled on the host one row at a time
    (``fill``), then applied to the logits on the device (``apply``). A row left unfilled (its
    request failed) allows every token."""

    def __init__(self, rows: list[int], vocab: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, device
        words = -(-vocab // _WORD)
        pinned = device.type == "cuda"
        self.bitmask = torch.full((len(rows), words), -1, dtype=torch.int32, pin_memory=pinned)

    def fill(self, i: int, matcher: llguidance.LLMatcher) -> None:
        """Row ``i`` (of ``rows``) allows what ``matcher`` allows next. Reads the matcher, never
        advances it (what llguidance.torch's fill does, without the torch.compile that module
        imports: seconds at startup)."""
        row = self.bitmask[i]
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [R, vocab] fp32 with each of ``rows`` masked to what it allows (a new
        tensor; the other rows are copied unchanged)."""
        device = self.device
        allowed = unpack_bitmask(self.bitmask.to(device, non_blocking=True), self.vocab)
        index = to_device(self.rows, device)
        masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        return logits.index_copy(0, index, masked)


def mask_rows(
    logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]
) -> torch.Tensor:
    """``logits`` [R, vocab] fp32 with each of ``rows`` masked to what its matcher allows next
    (a new tensor; the other rows are copied unchanged). Reads the matchers, never advances
    them."""
    masks = Masks(rows, logits.shape[1], logits.device)
    for i, matcher in enumerate(matchers):
        masks.fill(i, matcher)
    return masks.apply(logits)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[G, words] int32 -> [G, vocab] bool: bit ``t % 32`` of word ``t // 32`` is token ``t``."""
    shifts = torch.arange(_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [G, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()
