"""Random bounded JSON Schemas and valid instances of them, for structured-output benchmarks.

``random_schema`` draws nested objects (every property required, no additional properties),
arrays (``maxItems`` <= 3), string enums, strings (``maxLength`` <= 8), bounded integers, bounded
numbers and booleans, at most 3 levels deep and 4 properties per object. Every schema is bounded
so that any compact instance (no whitespace, ``","`` and ``":"`` separators) a grammar engine
could let through has fewer than ``MAX_INSTANCE_BYTES`` bytes, counting the worst case of each
value: a string character as a 6-byte ``\\uXXXX`` escape, a number with 6 fraction digits
(xgrammar's limit for a bounded number). Numbers carry ``"multipleOf": 0.5``: without it
llguidance allows endless fraction digits, and with a finer step (0.25) it wrongly demands
exactly as many fraction digits as the step has (rejects 8.5). Each container splits its byte
budget among its children. ``schema_instance`` draws a valid instance (strings without escapes:
xgrammar rejects any escape in a string with ``maxLength``), to drive a matcher along it.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

__all__ = ["MAX_INSTANCE_BYTES", "max_instance_bytes", "random_schema", "schema_instance"]

MAX_INSTANCE_BYTES = 400  # every instance of a random schema is strictly shorter
MAX_DEPTH = 3  # containers at depths 0-2, leaves down to depth 3
MAX_PROPERTIES = 4
ESCAPE_BYTES = 6  # the longest encoding of one string character: \uXXXX
WORDS = (
    "id", "name", "tags", "score", "active", "kind", "items", "meta", "price", "count",
    "label", "value", "city", "email", "level", "notes", "owner", "state", "size", "color",
)  # fmt: skip
_TEXT = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 _-"  # no escapes


def _key_bytes(key: str) -> int:
    return len(json.dumps(key)) + 2  # "key": plus the comma before the next property


def max_instance_bytes(schema: dict[str, Any]) -> int:
    """The longest compact instance of ``schema`` (a schema from ``random_schema``), in bytes."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return 1 + sum(_key_bytes(k) + max_instance_bytes(v) for k, v in props.items())
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * max_instance_bytes(schema["items"]) + max(n - 1, 0)
    if kind == "string":
        return 2 + ESCAPE_BYTES * int(schema["maxLength"])
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "number":
        whole = math.ceil(max(abs(schema["minimum"]), abs(schema["maximum"])))
        return 1 + len(str(whole)) + 1 + 6  # sign, integer digits, point, 6 fraction digits
    return 5  # boolean: "false"


def _leaf(rng: random.Random, budget: int) -> dict[str, Any]:
    """A scalar schema whose longest instance fits in ``budget`` (>= 1) bytes."""
    kinds = ["integer"] + [
        k for k, need in (("boolean", 5), ("string", 8), ("number", 10)) if budget >= need
    ]
    enum = [w for w in rng.sample(WORDS, rng.randint(2, 4)) if len(w) + 2 <= budget]
    kinds += ["enum"] * (len(enum) >= 2)
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"type": "string", "enum": enum}
    if kind == "string":
        return {"type": "string", "maxLength": min(rng.randint(1, 8), (budget - 2) // ESCAPE_BYTES)}
    if kind == "integer":
        digits = min(rng.randint(1, 4), budget - 1) or 1
        low = -rng.randint(0, 10 ** (digits - 1)) if budget > digits else 0
        return {
            "type": "integer",
            "minimum": low,
            "maximum": rng.randint(max(low, 0), 10**digits - 1),
        }
    if kind == "number":
        top = rng.choice([1, 10, 100, 1000][: max(1, min(4, budget - 9))])
        return {"type": "number", "minimum": -top / 2, "maximum": float(top), "multipleOf": 0.5}
    return {"type": "boolean"}


def _schema(rng: random.Random, depth: int, budget: int) -> dict[str, Any]:
    """A schema at ``depth`` whose longest instance fits in ``budget`` bytes."""
    container = depth == 0 or (depth < MAX_DEPTH and budget >= 16 and rng.random() < 0.35)
    if not container:
        return _leaf(rng, budget)
    if depth > 0 and rng.random() < 0.4:  # an array of 1-3 items
        most = rng.randint(1, 3)
        item = _schema(rng, depth + 1, (budget - 2 - (most - 1)) // most)
        return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": most}
    keys = rng.sample(WORDS, rng.randint(1, MAX_PROPERTIES))
    while len(keys) > 1 and 1 + len(keys) * (max(map(_key_bytes, keys)) + 1) > budget:
        keys.pop()  # each property's share must leave its value at least 1 byte
    share = (budget - 1) // len(keys)
    props = {k: _schema(rng, depth + 1, share - _key_bytes(k)) for k in keys}
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def random_schema(
    rng: random.Random, depth: int = 0, budget: int = MAX_INSTANCE_BYTES - 1
) -> dict[str, Any]:
    """A random bounded JSON Schema (an object at depth 0; see the module docstring) whose
    longest compact instance has at most ``budget`` bytes."""
    schema = _schema(rng, depth, budget)
    assert max_instance_bytes(schema) <= budget, schema
    return schema


def schema_instance(rng: random.Random, schema: dict[str, Any]) -> Any:
    """A random valid instance of ``schema`` (a schema from ``random_schema``)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        return {k: schema_instance(rng, v) for k, v in schema["properties"].items()}
    if kind == "array":
        n = rng.randint(schema["minItems"], schema["maxItems"])
        return [schema_instance(rng, schema["items"]) for _ in range(n)]
    if kind == "string":
        return "".join(rng.choices(_TEXT, k=rng.randint(0, schema["maxLength"])))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        step = schema["multipleOf"]  # json.dumps writes a multiple of 0.5 with 1 fraction digit
        low, high = math.ceil(schema["minimum"] / step), math.floor(schema["maximum"] / step)
        return rng.randint(low, high) * step
    return rng.random() < 0.5
