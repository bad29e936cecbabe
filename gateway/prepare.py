"""From a decoded OpenAI request to what the workers run: prompt token ids and SamplingParams.

Every check that depends on the model (context length, vocabulary, chat template) or on the
server's limits happens here, before anything reaches Redis; each failure is a 400 naming the
parameter. Defaults follow vLLM: ``max_tokens`` 16 for completions, the rest of the context for
chat; ``temperature`` 1.

Capacity: a request must also fit the kvstore's pool (``KVCapacity``, read from the kvstore):
one whose prompt and ``max_tokens`` need more KV blocks than one request may hold gets a 400
(``context_length_exceeded``, naming the KV capacity), as one past the context does; a default
``max_tokens`` is capped to fit. A prompt with more characters than the context could hold
tokens (at the longest token of the vocabulary) is refused before it is tokenized.

Chat prompts use the tokenizer's chat template when it has one (rendered with
``add_generation_prompt=True``, tokenized without adding special tokens, as vLLM does). Without
one (``tiny``), the plain template is: each message as ``"{role}: {content}\\n"``, then
``"assistant:"``, tokenized with the tokenizer's special tokens (BOS).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from contracts.records import SamplingParams
from gateway.errors import bad_request
from gateway.guided import guide_of
from gateway.limits import KVCapacity, Limits, beam_width_of
from gateway.model_info import ModelInfo
from gateway.schemas import ChatRequest, CompletionRequest

MAX_PROMPTS = 256  # prompts in one completions request
MAX_STOP = 16  # stop strings per request
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request (OpenAI allows 300)
ROLES = ("system", "developer", "user", "assistant", "tool")
_INT32 = 2**31


@dataclass(frozen=True)
class Prepared:
    """A request ready to submit: one RequestRecord per prompt, all with ``params``."""

    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    salt: bytes | None
    echo_texts: list[str] | None = None  # completions with echo: the prompts' text
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's extension)
    # completions with echo and max_tokens 0: the prompt only (its logprobs: scoring); the
    # workers draw one token (params.max_tokens is 1), which the response leaves out
    score_only: bool = False
    priority: int = 0  # lower first (``contracts.records.RequestRecord``)


def prepare_completion(
    req: CompletionRequest, model: ModelInfo, max_n: int, capacity: KVCapacity | None = None
) -> Prepared:
    if req.suffix is not None:
        raise bad_request("suffix is not supported", "suffix", "unsupported_parameter")
    logprobs = None if req.logprobs is None else _in_range(req.logprobs, 0, "logprobs", 0, 20)
    prompts, texts = _completion_prompts(req.prompt, model)
    echo_texts = None
    if req.echo:
        pairs = zip(texts, prompts, strict=True)
        echo_texts = [t if t is not None else _decode(model, p) for t, p in pairs]
    score_only = bool(req.echo) and req.max_tokens == 0
    requested = 1 if score_only else req.max_tokens
    longest = max(len(p) for p in prompts)
    limits = Limits(model, capacity, beam_width_of(req))
    max_tokens = limits.max_tokens(requested, "max_tokens", longest, "prompt")
    prompt_logprobs = logprobs if req.echo else None  # echoed: its logprobs come too
    prepared = _prepared(
        req, prompts, max_tokens, model, max_n, echo_texts, logprobs, prompt_logprobs
    )
    return dataclasses.replace(prepared, score_only=score_only)


def prepare_chat(
    req: ChatRequest, model: ModelInfo, max_n: int, capacity: KVCapacity | None = None
) -> Prepared:
    for name, value in (("tools", req.tools), ("functions", req.functions)):
        if value:
            raise bad_request(f"{name} are not supported", name, "unsupported_parameter")
    top = _in_range(req.top_logprobs, 0, "top_logprobs", 0, 20)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = top if req.logprobs else None
    prompt = _chat_prompt(req, model)
    requested, param = req.max_tokens, "max_tokens"
    if req.max_completion_tokens is not None:
        requested, param = req.max_completion_tokens, "max_completion_tokens"
    limits = Limits(model, capacity, beam_width_of(req))
    max_tokens = limits.max_tokens(requested, param, len(prompt), "messages", chat=True)
    return _prepared(req, [prompt], max_tokens, model, max_n, None, logprobs)


# ---------------------------------------------------------------- prompts
def _completion_prompts(
    prompt: str | list[Any], model: ModelInfo
) -> tuple[list[list[int]], list[str | None]]:
    """(token ids, text or None) per prompt: a string, strings, token ids, or token-id lists."""
    shape = (
        "prompt must be a string, an array of strings, an array of token ids or an array of "
        "token-id arrays"
    )
    if isinstance(prompt, str):
        return [_encode(model, prompt, True, "prompt")], [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(_is_int(x) for x in prompt):
        return [_check_ids(prompt, model, "prompt")], [None]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    if all(isinstance(x, str) for x in prompt):
        return [_encode(model, x, True, f"prompt[{i}]") for i, x in enumerate(prompt)], [*prompt]
    if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in prompt):
        ids = [_check_ids(x, model, f"prompt[{i}]") for i, x in enumerate(prompt)]
        return ids, [None] * len(ids)
    raise bad_request(shape, "prompt", "invalid_type")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_ids(ids: list[int], model: ModelInfo, param: str) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of the vocabulary [0, {model.vocab_size})", param)
    return list(ids)


def _encode(model: ModelInfo, text: str, special: bool, param: str) -> list[int]:
    if len(text) > model.context_len * model.max_token_chars:  # before any tokenizing
        raise bad_request(
            f"this model's maximum context length is {model.context_len} tokens; {param} has "
            f"{len(text)} characters, more than that many tokens can hold",
            param,
            "context_length_exceeded",
        )
    backend = getattr(model.tokenizer, "backend_tokenizer", None)  # fast tokenizers: the Rust
    if backend is not None:  # one directly, a tenth of the time of the wrapper's __call__
        ids = backend.encode(text, add_special_tokens=special).ids
    else:
        ids = model.tokenizer(text, add_special_tokens=special)["input_ids"]
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    return list(ids)


def _decode(model: ModelInfo, ids: list[int]) -> str:
    return str(model.tokenizer.decode(ids, skip_special_tokens=True))


def _chat_prompt(req: ChatRequest, model: ModelInfo) -> list[int]:
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    conversation: list[dict[str, str]] = []
    for i, message in enumerate(req.messages):
        if message.role not in ROLES:
            raise bad_request(
                f"unknown role {message.role!r}; one of {', '.join(ROLES)}", f"messages[{i}].role"
            )
        conversation.append({"role": message.role, "content": _content(message.content, i)})
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in conversation) + "assistant:"
        return _encode(model, text, True, "messages")
    try:
        rendered = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # jinja2 raises TemplateError for what the template refuses
        raise bad_request(f"the chat template refused the messages: {err}", "messages") from err
    return _encode(model, str(rendered), False, "messages")


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"content part of type {part.type!r} is not supported (text only)",
                f"messages[{i}].content[{j}]",
                "unsupported_parameter",
            )
        texts.append(part.text)
    return "".join(texts)


# ---------------------------------------------------------------- sampling parameters
def _prepared(
    req: CompletionRequest | ChatRequest,
    prompts: list[list[int]],
    max_tokens: int,
    model: ModelInfo,
    max_n: int,
    echo_texts: list[str] | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> Prepared:
    n = _in_range(req.n, 1, "n", 1, max_n)
    temperature = _finite(req.temperature, 1.0, "temperature", low=0.0)
    top_p = _finite(req.top_p, 1.0, "top_p", low=0.0)
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _in_range(req.top_k, 0, "top_k", -1, _INT32 - 1)
    beam = bool(req.use_beam_search) or (req.beam_width or 1) > 1
    best_of = _in_range(req.best_of, n, "best_of", 1, max_n)
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be >= n ({n})", "best_of")
    if best_of > n and not beam:
        raise bad_request(
            "best_of > n needs beam search (use_beam_search: true)", "best_of", "unsupported"
        )
    beam_width = _in_range(req.beam_width, best_of, "beam_width", 1, max_n) if beam else 1
    if beam and n > beam_width:
        raise bad_request(f"n ({n}) must be <= beam_width ({beam_width})", "n")
    if beam and beam_width == 1:
        temperature = 0.0  # a beam of one is greedy search
    seed = req.seed
    if seed is not None and not -(2**63) <= seed < 2**64:
        raise bad_request("seed must fit in 64 bits", "seed")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop strings", "stop")
    if beam and stops:
        raise bad_request("stop strings do not apply to beam search", "stop", "unsupported")
    stop_ids = _check_ids(list(req.stop_token_ids or []), model, "stop_token_ids")
    priority = _in_range(req.priority, 0, "priority", -(2**31), 2**31 - 1)
    penalties = _penalties(req, model, max_tokens)
    changed = [name for name, value in penalties.items() if value != _NO_PENALTIES[name]]
    if beam and changed:
        raise bad_request(f"{changed[0]} does not apply to beam search", changed[0], "unsupported")
    if beam and logprobs is not None:
        raise bad_request("beam search gives no logprobs", "logprobs", "unsupported")
    guide = guide_of(req, model.unsupported.get("structured_output", ""))
    if guide is not None and beam:
        raise bad_request("beam search follows no grammar", "use_beam_search", "unsupported")
    if guide is not None and penalties["min_tokens"]:
        raise bad_request("min_tokens would mask the end of a structured output", "min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=seed,
        n=n,
        stop_token_ids=stop_ids,
        stop=stops,
        ignore_eos=bool(req.ignore_eos),
        beam_width=beam_width,
        length_penalty=_finite(req.length_penalty, 1.0, "length_penalty"),
        **penalties,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        guide=guide,
    )
    try:
        params.validate()
    except ValueError as err:  # the contract's own check, in case it is stricter than ours
        raise bad_request(str(err)) from err
    salt = req.cache_salt.encode() if req.cache_salt else None
    options = req.stream_options
    return Prepared(
        prompts=prompts,
        params=params,
        stream=bool(req.stream),
        include_usage=bool(req.stream and options and options.include_usage),
        salt=salt,
        echo_texts=echo_texts,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        priority=priority,
    )


_NO_PENALTIES: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "min_tokens": 0,
}


def _penalties(
    req: CompletionRequest | ChatRequest, model: ModelInfo, max_tokens: int
) -> dict[str, Any]:
    """The penalty, bias and min_tokens fields of ``SamplingParams``, checked (OpenAI's ranges;
    vLLM's for its extensions)."""
    values = dict(_NO_PENALTIES)
    for name in ("presence_penalty", "frequency_penalty"):
        value = _finite(getattr(req, name), 0.0, name)
        if not -2 <= value <= 2:
            raise bad_request(f"{name} must be in [-2, 2], got {value}", name)
        values[name] = value
    repetition = _finite(req.repetition_penalty, 1.0, "repetition_penalty")
    if not 0 < repetition <= 100:
        raise bad_request(
            f"repetition_penalty must be in (0, 100], got {repetition}", "repetition_penalty"
        )
    values["repetition_penalty"] = repetition
    bias: dict[int, float] = {}
    if len(req.logit_bias or {}) > MAX_LOGIT_BIAS:
        raise bad_request(f"at most {MAX_LOGIT_BIAS} logit_bias entries", "logit_bias")
    for key, value in (req.logit_bias or {}).items():
        digits = key.strip()
        if not (digits.isascii() and digits.isdigit() and len(digits) < 12):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token = _check_ids([int(digits)], model, "logit_bias")[0]
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise bad_request(
                f"logit_bias values must be in [-100, 100], got {value}", "logit_bias"
            )
        bias[token] = float(value)
    values["logit_bias"] = bias
    values["min_tokens"] = _in_range(req.min_tokens, 0, "min_tokens", 0, max_tokens)
    return values


def _in_range(value: int | None, default: int, param: str, low: int, high: int) -> int:
    if value is None:
        return default
    if not low <= value <= high:
        raise bad_request(f"{param} must be in [{low}, {high}], got {value}", param)
    return value


def _finite(value: float | None, default: float, param: str, low: float | None = None) -> float:
    if value is None:
        return default
    if not math.isfinite(value) or (low is not None and value < low):
        bound = f" and >= {low}" if low is not None else ""
        raise bad_request(f"{param} must be finite{bound}, got {value}", param)
    return float(value)
