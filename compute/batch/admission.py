"""What a worker checks of a request before it starts it: the values the model's batched device
work reads, against the model this worker runs.

The gateway checks all of this too, but a request may reach Redis without a gateway, and a value
the model cannot take would not fail on its own: a prompt id past the embedding or a logit-bias
id past the logits is an out-of-bounds index in an operation batched over every request of the
step (on CUDA a device-side assert, which ends the process). So it is refused here, with
``RequestError``, before anything of the request exists on the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from compute.faults import RequestError
from contracts.records import RequestRecord

__all__ = ["ModelLimits", "check_request"]

SEQUENCE_MARK = "#"  # a request's sequences are ``{req_id}`` and ``{req_id}#...``


@dataclass(frozen=True)
class ModelLimits:
    """``embeddings``: a prompt's ids are below it; ``logits``: logit-bias and stop ids are
    below it; ``positions``: the model's context (None: unbounded)."""

    embeddings: int
    logits: int
    positions: int | None = None

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelLimits:
        text = model.config.get_text_config()
        return cls(
            _rows(model.get_input_embeddings()),
            _rows(model.get_output_embeddings()),
            getattr(text, "max_position_embeddings", None),
        )


def _rows(module: object) -> int:
    """The token ids an embedding or LM head covers: its ``num_embeddings`` or ``out_features``
    (the whole vocabulary's, a tensor-parallel rank holding only its share of the weight's
    rows), else its weight's rows."""
    for name in ("num_embeddings", "out_features"):
        if isinstance(rows := getattr(module, name, None), int):
            return rows
    weight = getattr(module, "weight", None)
    assert isinstance(weight, torch.Tensor), f"{module}: no weight"
    return int(weight.shape[0])


def check_request(record: RequestRecord, limits: ModelLimits) -> None:
    """Raises ``RequestError`` naming the first value of ``record`` the model cannot take."""
    if not record.req_id or SEQUENCE_MARK in record.req_id:
        raise RequestError(f"a request id must be non-empty, without {SEQUENCE_MARK!r}")
    prompt, params = record.prompt_token_ids, record.params
    if not prompt:
        raise RequestError("the prompt is empty")
    _check_ids(prompt, limits.embeddings, "prompt")
    _check_ids(list(params.logit_bias), limits.logits, "logit_bias")
    _check_ids(params.stop_token_ids, limits.logits, "stop_token_ids")
    if limits.positions is not None and len(prompt) + params.max_tokens > limits.positions:
        raise RequestError(
            f"{len(prompt)} prompt tokens and max_tokens {params.max_tokens} exceed the model's "
            f"context of {limits.positions} tokens"
        )


def _check_ids(ids: list[int], bound: int, name: str) -> None:
    bad = next((t for t in ids if not 0 <= t < bound), None)
    if bad is not None:
        raise RequestError(f"{name}: token id {bad} is not in the model's vocabulary of {bound}")
