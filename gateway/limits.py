"""The limits a request must fit before it is queued: the model's context and the kvstore's pool.

``KVCapacity`` is what the kvstore can give one request (read from it by the gateway's
housekeeping); ``Limits`` checks a request's ``max_tokens`` against both, naming the limit that
refuses it (``context_length_exceeded``), and caps the defaults to fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.errors import bad_request
from kvstore.protocol import LOOKAHEAD_SLOTS

if TYPE_CHECKING:
    from gateway.model_info import ModelInfo
    from gateway.schemas import ChatRequest, CompletionRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class KVCapacity:
    """What one request may hold in the kvstore's pool: ``blocks`` of ``block_size`` tokens."""

    blocks: int
    block_size: int

    def max_tokens_for(self, prompt_len: int, beam_width: int) -> int:
        """The most output tokens that fit (0: not even the prompt does). The ``n`` branches of
        a sampled request need not be resident at once (one preempted waits for the others); the
        live beams of a beam search must be (a round needs every beam's logits): they share the
        prompt's blocks and each needs its own for the output. A running table also holds
        ``LOOKAHEAD_SLOTS`` slots past its tokens."""
        if beam_width == 1:
            return max(self.blocks * self.block_size - prompt_len - LOOKAHEAD_SLOTS, 0)
        per_beam = (self.blocks - prompt_len // self.block_size) // beam_width - 1
        return max(per_beam * self.block_size - LOOKAHEAD_SLOTS, 0)


def beam_width_of(req: CompletionRequest | ChatRequest) -> int:
    """The beam width ``_prepared`` will settle on (1 without beam search), for the checks
    that come before it."""
    if not (req.use_beam_search or (req.beam_width or 1) > 1):
        return 1
    return max(req.beam_width or req.best_of or req.n or 1, 1)


@dataclass(frozen=True)
class Limits:
    """The context length and, once known, the kvstore's capacity."""

    model: ModelInfo
    capacity: KVCapacity | None
    beam_width: int

    def max_tokens(
        self,
        requested: int | None,
        param: str,
        prompt_len: int,
        prompt_param: str,
        chat: bool = False,
    ) -> int:
        """The request's max_tokens, checked against the context and the KV capacity
        (explicit values past them are an error; the defaults are capped to fit)."""
        context = self.model.context_len
        if prompt_len >= context:
            raise bad_request(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{prompt_len} tokens, leaving no room for output",
                prompt_param,
                "context_length_exceeded",
            )
        room = context - prompt_len
        kv_room = room
        if self.capacity is not None:
            kv_room = self.capacity.max_tokens_for(prompt_len, self.beam_width)
            if kv_room < 1:
                raise bad_request(
                    f"{self._capacity_text()}; the prompt has {prompt_len} tokens, leaving no "
                    "room for output",
                    prompt_param,
                    "context_length_exceeded",
                )
        if requested is None:
            default = room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
            return min(default, kv_room)
        if requested < 1:
            raise bad_request(f"{param} must be at least 1, got {requested}", param)
        if requested > room:
            raise bad_request(
                f"this model's maximum context length is {context} tokens; you requested "
                f"{prompt_len + requested} ({prompt_len} in the prompt, {requested} in {param})",
                param,
                "context_length_exceeded",
            )
        if requested > kv_room:
            assert self.capacity is not None
            pool = self.capacity.blocks * self.capacity.block_size
            how = (
                f": {pool} less the prompt and the {LOOKAHEAD_SLOTS} lookahead slots"
                if self.beam_width == 1
                else ""
            )
            raise bad_request(
                f"{self._capacity_text()}; you requested {requested} {param} after "
                f"{prompt_len} prompt tokens (at most {kv_room} fit{how})",
                param,
                "context_length_exceeded",
            )
        return requested

    def _capacity_text(self) -> str:
        assert self.capacity is not None
        c = self.capacity
        beams = f" ({self.beam_width} beams held at once)" if self.beam_width > 1 else ""
        return (
            f"the KV cache holds at most {c.blocks} blocks of {c.block_size} tokens "
            f"({c.blocks * c.block_size} tokens) for one request{beams}, of which each sequence "
            f"keeps {LOOKAHEAD_SLOTS} lookahead slots free past its last token (for the tokens "
            "the worker samples ahead)"
        )
