"""The records that travel through Redis between the gateway and the compute workers. Torch-free
and Redis-free: msgspec Structs, MessagePack encoded, with a version. The keys are in
``contracts.queue_keys``, the functions that move the records in ``contracts.queue_worker`` and
``contracts.queue_gateway``."""

from __future__ import annotations

from typing import Literal

import msgspec

RECORD_VERSION = 6  # 2: RequestRecord without arrival_time and priority, OutputRecord without
# logprobs, with offset; RequestRecord.gateway. 3: SamplingParams' penalties, logit_bias,
# min_tokens and logprobs; OutputRecord.logprobs. 4: prompt logprobs (SamplingParams,
# OutputRecord), SamplingParams.guide. 5: OutputRecord.error_code. 6: RequestRecord.priority


GuideKind = Literal["json_schema", "json_object", "regex", "choice"]


class Guide(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """What a structured output must be (``contracts.guides`` gives its grammar): valid JSON
    of the JSON Schema whose JSON text is ``spec``, any JSON object, a whole match of the regular
    expression ``spec``, or one of the strings of the JSON array ``spec``."""

    kind: GuideKind
    spec: str = ""


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How to pick tokens for one request (OpenAI-style fields plus beam search).

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1.0`` disable those filters.
    ``seed`` makes sampling reproducible per request (None: nondeterministic). ``n`` sequences
    share the prompt's blocks (kvstore fork). ``beam_width > 1`` selects beam search (greedy
    scoring, ``length_penalty`` as in Hugging Face: score = logprob_sum / length**penalty).
    ``presence_penalty``, ``frequency_penalty`` (OpenAI's), ``repetition_penalty`` (Hugging
    Face's, over prompt and output), ``logit_bias`` (token id -> bias) and ``min_tokens`` are
    applied by ``compute.sampling.penalties`` (sampled rows only: beam search takes none of them).
    ``logprobs``: with each sampled token, its log-probability and the ``logprobs`` most likely
    tokens' (0-20), from the model's distribution before penalties and temperature (vLLM's
    default, ``raw_logprobs``); None: none. ``prompt_logprobs``: the same for every prompt
    token after the first (0-20 top tokens), computed in the prefill; such a request reuses no
    cached prefix (the hit part would have no logits: it is computed again). ``guide``: the
    output follows this grammar (``compute.sampling.grammar``), and ends at its EOS.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guide: Guide | None = None

    def validate(self) -> None:
        """Raises ValueError naming the first field out of range."""
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (self.n >= 1, "n must be at least 1"),
            (self.beam_width >= 1, "beam_width must be at least 1"),
            (self.beam_width == 1 or self.n <= self.beam_width, "n must be <= beam_width"),
            (self.beam_width == 1 or not self.stop, "stop strings do not apply to beam search"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (0 < self.repetition_penalty <= 100, "repetition_penalty must be in (0, 100]"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias in [-100, 100]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.beam_width == 1 or not self.uses_processors(), "beam search takes no penalties"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.beam_width == 1 or self.logprobs is None, "beam search gives no logprobs"),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "prompt_logprobs must be in [0, 20]",
            ),
            (self.beam_width == 1 or self.prompt_logprobs is None, "beam search: no logprobs"),
            (self.beam_width == 1 or self.guide is None, "beam search follows no grammar"),
            (self.guide is None or not self.min_tokens, "min_tokens would mask a grammar's end"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def uses_processors(self) -> bool:
        """Whether any field ``compute.sampling.penalties`` applies differs from its default."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


FinishReason = Literal["stop", "length", "abort", "error"]
# Why a request ended with an error, for the gateway's answer: the cause lies in the request
# (``invalid_request``: a value the model cannot take; ``unsupported_parameter``: something this
# model or server does not offer) and is answered as a 400, or it does not (``worker_error``: a
# worker failed on its behalf; ``unavailable``: nobody could serve it: its gateway gone, its
# workers dead) and is answered as a 5xx.
ErrorCode = Literal["invalid_request", "unsupported_parameter", "worker_error", "unavailable"]
REQUEST_ERRORS: frozenset[ErrorCode] = frozenset({"invalid_request", "unsupported_parameter"})


class RecordError(ValueError):
    """A stream entry this build cannot read: garbage, another version, or an unknown shape."""


class RequestRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="req"):
    """One request, as the gateway submits it. ``salt``: mixed into the prefix-cache hash, so
    only requests with the same salt share blocks. ``gateway``: the id of the gateway waiting for
    the output, whose liveness key (``queue_keys.gateway_key``) it renews; once that key is gone,
    workers abort the request (nobody would read it). Empty: no gateway (a program using the
    Redis contract directly). ``resume``: moved here from the stream of a pool that had no
    worker (``queue_gateway.move``): the worker that reads it goes on from what its output stream
    holds, as after taking over a dead worker's request; a request is moved once at most.
    ``priority``: a worker takes requests in the order of the stream, and among those it holds
    (at most ``--max-num-seqs``) a lower value is admitted, stepped and kept first (vLLM's
    semantics; ``compute.batch.scheduler`` states the bound on starvation)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str
    salt: bytes | None = None
    gateway: str = ""
    resume: bool = False
    priority: int = 0


class TokenLogprob(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """One sampled token's log-probability and the most likely tokens' (id, logprob), best
    first."""

    logprob: float
    top: list[tuple[int, float]] = []


class OutputRecord(
    msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag="out", gc=False
):
    """One delta of one sequence (``index`` < n, or a beam) of a request.

    ``finish_reason`` ends *this sequence*;
    ``final`` ends the *request* (every sequence finished; for n == 1 it is the record that
    carries the finish_reason): readers stop there and no record follows it. An abort or error of
    the whole request is one record with ``final`` (any index). ``error`` (what happened) and
    ``error_code`` (whose fault: ``ErrorCode``) are set with finish_reason "error".
    ``prompt_tokens`` and ``cached_tokens`` (prefix-cache hit) are the same on every record of a
    request. ``text``: the output text these tokens add, as the worker's stop checker
    released it (a stop string and an incomplete UTF-8 character are never in it; the held-back
    characters come with a later record): clients stream ``text``, not a decode of the tokens.
    ``logprobs``: one per token of ``token_ids`` when the request asked for them.
    ``prompt_logprobs``: one per prompt token (None for the first, which nothing predicts), on
    the request's first record that carries tokens, when the request asked for them.
    ``offset``: how many tokens of this sequence came before this record's. A worker that
    rebuilds a request after a Redis restart lost the stream's last entries publishes those
    tokens again, with the same offsets and text: a reader skips what it already has.
    """

    req_id: str
    index: int = 0
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    final: bool = False
    text: str = ""
    offset: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error_code: ErrorCode | None = None


class StreamedSequence(msgspec.Struct):
    """Everything one sequence has streamed so far."""

    token_ids: list[int]
    finish_reason: FinishReason | None = None


class Streamed(msgspec.Struct):
    """What ``read_streamed`` returns: per sequence index, and whether the request is done."""

    sequences: dict[int, StreamedSequence]
    final: bool = False


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RequestRecord)
_output_decoder = msgspec.msgpack.Decoder(OutputRecord)
_VERSION = str(RECORD_VERSION).encode()


def encode(record: RequestRecord | OutputRecord) -> bytes:
    return _encoder.encode(record)


def decode_request(data: bytes) -> RequestRecord:
    """Raises RecordError for anything but a valid RequestRecord (params validated too)."""
    try:
        record = _request_decoder.decode(data)
        record.params.validate()
    except ValueError as err:  # msgspec.DecodeError is a ValueError
        raise RecordError(f"not a RequestRecord v{RECORD_VERSION}: {err}") from err
    return record


def decode_output(data: bytes) -> OutputRecord:
    try:
        return _output_decoder.decode(data)
    except msgspec.DecodeError as err:
        raise RecordError(f"not an OutputRecord v{RECORD_VERSION}: {err}") from err
