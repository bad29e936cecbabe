"""Structured output's request parameters, checked and turned into the workers' ``Guide``.

Accepted, one per request (vLLM's names for the extensions), on both endpoints:

- ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``;
- ``guided_json``: a JSON Schema (an object, or its JSON text);
- ``guided_regex``: a regular expression the whole output matches;
- ``guided_choice``: the output is exactly one of these strings.

Each is checked by the grammar engine before it is queued (``contracts.guides.guide_error``): a
schema it cannot follow is a 400 naming the parameter, never a failure in the worker.
"""

from __future__ import annotations

import json
from typing import Any

from contracts.guides import guide_error
from contracts.records import Guide
from gateway.errors import bad_request
from gateway.schemas import ChatRequest, CompletionRequest

__all__ = ["MAX_CHOICES", "guide_of"]

MAX_CHOICES = 256  # strings in guided_choice


def guide_of(req: CompletionRequest | ChatRequest, unsupported: str = "") -> Guide | None:
    """The request's structured-output constraint, checked; None without one. ``unsupported``:
    why the model has no structured output (a 400 for a request that asks for it)."""
    given = [
        (name, value)
        for name, value in (
            ("response_format", req.response_format),
            ("guided_json", req.guided_json),
            ("guided_regex", req.guided_regex),
            ("guided_choice", req.guided_choice),
        )
        if value is not None
    ]
    if not given:
        return None
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise bad_request(f"give one structured-output parameter, not {names}", given[1][0])
    name, value = given[0]
    guide = _parse(name, value)
    if guide is None:
        return None
    if unsupported:
        raise bad_request(f"{name}: {unsupported}", name, "unsupported_parameter")
    error = guide_error(guide)
    if error:
        raise bad_request(f"{name}: the grammar engine refuses it: {error}", name)
    return guide


def _parse(name: str, value: Any) -> Guide | None:
    if name == "response_format":
        return _response_format(value)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise bad_request(f"guided_json is no JSON: {err}", name) from err
        return _schema(value, name)
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise bad_request("guided_regex must be a non-empty string", name)
        return Guide("regex", value)
    if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
        raise bad_request("guided_choice must be a non-empty array of strings", name)
    if len(value) > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} strings in guided_choice", name)
    return Guide("choice", json.dumps(value, ensure_ascii=False))


def _response_format(value: Any) -> Guide | None:
    param = "response_format"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_object")
    if kind != "json_schema":
        raise bad_request(
            "response_format.type must be one of text, json_object, json_schema", param
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise bad_request("response_format.json_schema needs a schema", param)
    return _schema(spec["schema"], param)


def _schema(schema: Any, param: str) -> Guide:
    if not isinstance(schema, dict):
        raise bad_request("a JSON Schema must be an object", param)
    # one text per schema, however the client ordered its keys: the workers' compile cache key
    return Guide("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))
