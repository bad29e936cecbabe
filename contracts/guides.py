"""Structured output's grammars: what a ``Guide`` means to the grammar engine (llguidance).

One definition for every process: the gateway checks a guide with ``guide_error`` before it queues
the request (a precise 400), the compute workers compile ``grammar_of`` into per-sequence matchers
(``compute.sampling.grammar``). Imports no torch.

JSON is generated compact (no whitespace between tokens: ``whitespace_flexible`` off), so a
model cannot spend its tokens on spaces; a JSON Schema is followed as llguidance supports it
(https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md); ``json_object`` is any
JSON object (OpenAI's JSON mode).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance

from contracts.records import Guide

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["GuidesUnsupported", "grammar_of", "grammar_tokenizer", "guide_error"]

_JSON: JsonCompileOptions = {"whitespace_flexible": False}


def grammar_of(guide: Guide) -> str:
    """The llguidance grammar of ``guide``. Raises ValueError for a spec that is not even
    well-formed (a schema that is no JSON, choices that are not a list of strings)."""
    if guide.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON)
    if guide.kind == "json_schema":
        schema = json.loads(guide.spec)
        if not isinstance(schema, dict):
            raise ValueError("a JSON Schema must be an object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON)
    if guide.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guide.spec)
    choices = json.loads(guide.spec)
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise ValueError("choices must be a non-empty list of strings")
    literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {literals}")


def guide_error(guide: Guide) -> str:
    """Why the grammar engine refuses ``guide`` ("" if it takes it)."""
    try:
        return str(llguidance.LLMatcher.validate_grammar(grammar_of(guide)))
    except (ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
        return str(err)


class GuidesUnsupported(ValueError):
    """The grammar engine cannot read this model's tokenizer: no structured output for it."""


def grammar_tokenizer(tokenizer: Any, vocab_size: int | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer (``vocab_size``: as wide as the model's
    logits), built once per process (about a second for a large vocabulary). Raises
    ``GuidesUnsupported`` saying why when the grammar engine cannot read it (a slow tokenizer;
    a decoder it does not know, e.g. a word-level tokenizer with a ``Fuse`` decoder)."""
    import llguidance.hf  # imports transformers: only where a tokenizer is at hand

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    except (ValueError, TypeError, RuntimeError) as err:
        raise GuidesUnsupported(
            f"structured output is not available for this model: the grammar engine cannot "
            f"read its tokenizer ({err})"
        ) from err
