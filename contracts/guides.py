"""Structured output's grammars: what a ``Guide`` means to the grammar engine (llguidance).

One definition for every process: the gateway checks a guide with ``guide_error`` before it queues
the request (a precise 400), the compute workers compile ``grammar_of`` into per-sequence matchers
(``compute.grammar``). Imports no torch.

JSON is generated compact (no whitespace between tokens: ``whitespace_flexible`` off), so a
model cannot spend its tokens on spaces; a JSON Schema is followed as llguidance supports it
(https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md); ``json_object`` is any
JSON object (OpenAI's JSON mode).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

from contracts.records import Guide

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["grammar_of", "guide_error"]

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
