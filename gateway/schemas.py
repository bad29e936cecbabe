"""Request bodies of the OpenAI-compatible endpoints, decoded and type-checked by msgspec.

Fields follow OpenAI's API; extensions (as in vLLM) are marked. Unknown fields are ignored (as
vLLM does), so clients that send newer OpenAI fields keep working; a known field of the wrong
type is a 400 naming it. ``decode_body`` turns every way a body can be unreadable (not UTF-8, not
JSON, a lone UTF-16 surrogate escape, nested too deeply, not an object, a wrong type) into an
``APIError``.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar, cast

import msgspec

from gateway.errors import APIError, bad_request


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    n: int | None = None
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    use_beam_search: bool | None = None
    beam_width: int | None = None  # default: best_of, else n
    length_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    # structured output (``gateway.guided``): OpenAI's response_format, vLLM's guided_*
    response_format: Any | None = None
    guided_json: Any | None = None
    guided_regex: Any | None = None
    guided_choice: Any | None = None
    priority: int | None = None  # lower first (vLLM's); compute.batch.scheduler's bound


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None


T = TypeVar("T", CompletionRequest, ChatRequest)
# Built on the importing thread: msgspec prepares a Struct type at its first use, and two request
# threads doing that at once crashed the gateway (SIGSEGV in msgspec 0.22); decoding is thread-safe.
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(kind) for kind in (CompletionRequest, ChatRequest)
}
_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def decode_body(body: bytes, kind: type[T]) -> T:
    """The request of ``kind`` in ``body``; raises APIError (400) for anything unreadable."""
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return cast(T, _DECODERS[kind].decode(body))
    except RecursionError:  # msgspec's depth limit: a body nested thousands deep
        raise bad_request("invalid JSON: nested too deeply", code="invalid_json") from None
    except UnicodeDecodeError as err:
        raise bad_request(f"the request body is not UTF-8: {err}", code="invalid_json") from err
    except msgspec.ValidationError as err:
        raise _invalid(str(err)) from err
    except msgspec.DecodeError as err:
        raise bad_request(f"invalid JSON: {_explain(body, err)}", code="invalid_json") from err


def _invalid(message: str) -> APIError:
    """A 400 naming the parameter msgspec's message points at (``messages[0].role``)."""
    at = _PATH.search(message)
    path = at.group(1) if at else ""
    missing = _MISSING.search(message)
    if missing:
        param = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return bad_request(f"invalid request: {message}", param, "missing_required_parameter")
    return bad_request(f"invalid request: {message}", path or None, "invalid_type")


def _explain(body: bytes, err: Exception) -> str:
    """msgspec's message, or a clearer one where Python's lenient parser says why: a lone UTF-16
    surrogate escape (valid JSON syntax, but no Unicode string can hold it)."""
    try:
        json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return str(err)
    return "a string holds a lone UTF-16 surrogate escape (e.g. \\ud800): not valid Unicode"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
