"""A deterministic byte-level BPE tokenizer of any vocabulary size, for structured-output runs.

Ids 0-255 are the 256 bytes (GPT-2's byte -> character map, as in ``contracts.tokenizer``), then
multi-byte tokens like a Llama-3-size vocabulary holds (JSON punctuation runs, whitespace runs,
digit groups, letter combinations and English-like fragments, with and without a leading
space) up to ``vocab_size - 3``, then BOS ``<s>``, EOS ``</s>`` and PAD ``<pad>`` as the last
three ids. There are no merges: encoding stays byte by byte; what matters is the vocabulary a
grammar engine sees. Saves and loads back with ``save_pretrained`` /
``AutoTokenizer.from_pretrained``; ``decode([id])`` gives the token's string.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator

from transformers import PreTrainedTokenizerFast

from contracts.tokenizer import _bytes_to_unicode

__all__ = ["byte_level_tokenizer"]

SPECIALS = ("<s>", "</s>", "<pad>")  # BOS, EOS, PAD: the last three ids

_PUNCT = [
    '",', '":', '{"', "},", '":"', '","', '"}', '"]', '["', "[{", "}]", "]}", "},{", '},{"', '":[',
    '":{', '":{"', '":["', '":[{"', '"},', '"},{"', '"],', '"]}', "}}", "]]", "[]", "{}", '""',
    '":"",', "null", "true", "false", ":null", ":true", ":false", ",null", ",true", ",false",
    "\\n", '\\"', "\\\\", "\\u", ". ", ", ", "...", "--", "__", "()", "();", "=>", "->", "::",
]  # fmt: skip
_WHITESPACE = [
    *(" " * n for n in range(2, 33)),
    *("\n" + " " * n for n in range(0, 33)),
    *("\t" * n for n in range(1, 9)),
    *("\n" * n for n in range(2, 5)),
    *("\n" + "\t" * n for n in range(1, 9)),
]
_CONSONANTS = "bcdfghjklmnprstvwyz"
_VOWELS = "aeiou"
_ONSETS = [*_CONSONANTS, "ch", "sh", "th", "st", "tr", "pr", "br", "cl", "gr", "pl", "wh", "qu"]
_CODAS = ["", *"nrstldmgkp", "ng", "nd", "nt", "st", "ck", "ll", "ss", "rs", "ts"]


def _fragments() -> Iterator[str]:
    """Candidate multi-byte tokens, most common kinds first (duplicates are skipped later)."""
    yield from _PUNCT
    yield from _WHITESPACE
    for n in (1, 2, 3):  # digit groups, as Llama 3 splits numbers into up to 3 digits
        for digits in itertools.product(string.digits, repeat=n):
            yield "".join(digits)
            yield " " + "".join(digits)
    for n in (1, 2, 3):  # letter combinations: lower, capitalized, each with a leading space
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            word = "".join(letters)
            for form in (word, word.capitalize(), word.upper()):
                yield form
                yield " " + form
    syllables = [o + v + c for o, v, c in itertools.product(_ONSETS, _VOWELS, _CODAS)]
    pairs = (a + b for a, b in itertools.product(syllables, syllables))
    for word in itertools.chain(syllables, pairs):  # English-like words
        for form in (word, word.capitalize()):
            yield form
            yield " " + form


def _vocab(vocab_size: int) -> dict[str, int]:
    """Token string (in GPT-2's byte characters) -> id, with the specials at the end."""
    if vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"vocab_size {vocab_size} < {256 + len(SPECIALS)}")
    byte_char = _bytes_to_unicode()
    vocab = {byte_char[b]: b for b in range(256)}
    n_regular = vocab_size - len(SPECIALS)
    fragments = _fragments()
    while len(vocab) < n_regular:
        fragment = next(fragments, None)
        if fragment is None:
            raise ValueError(f"vocab_size {vocab_size} exceeds the fragments available")
        vocab.setdefault("".join(byte_char[b] for b in fragment.encode()), len(vocab))
    for special in SPECIALS:
        vocab[special] = len(vocab)
    return vocab


def byte_level_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_vocab(vocab_size), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos, pad = SPECIALS
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad
    )
