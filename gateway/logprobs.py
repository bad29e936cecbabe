"""The OpenAI shapes of tokens' log-probabilities, from the workers' ``TokenLogprob``s.

Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one
entry per token, ``top_logprobs`` a dict of token text -> logprob per token; with ``echo`` the
prompt's tokens come first, the first of them with ``null``s (nothing predicts it). Chat:
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": None}``. A token's text is its own decode (``decode([id])``): a token that is part of
a UTF-8 character decodes to U+FFFD, and its ``bytes`` say so, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from contracts.records import TokenLogprob

__all__ = ["Decode", "Logprob", "PromptLogprob", "chat_logprobs", "completion_logprobs"]

Logprob = tuple[int, TokenLogprob]  # a sampled token id and its logprobs
PromptLogprob = tuple[int, TokenLogprob | None]  # a prompt token: None for the first
Decode = Callable[[Sequence[int]], str]


def completion_logprobs(
    entries: Sequence[PromptLogprob], decode: Decode, offset: int
) -> tuple[dict[str, Any], int]:
    """The ``logprobs`` object of a completion choice (or of one streamed chunk) whose first
    token starts at character ``offset`` of the choice's text; and the offset after them."""
    tokens, offsets = [], []
    for token, _ in entries:
        text = decode([token])
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [None if e is None else {decode([t]): v for t, v in e.top} for _, e in entries]
    body = {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for _, e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return body, offset


def chat_logprobs(entries: Sequence[Logprob], decode: Decode) -> dict[str, Any]:
    """The ``logprobs`` object of a chat choice (or of one streamed chunk)."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {**item(token, entry.logprob), "top_logprobs": [item(t, v) for t, v in entry.top]}
        for token, entry in entries
    ]
    return {"content": content, "refusal": None}
