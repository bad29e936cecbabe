"""The KV-capacity refusals name every slot a request needs, so their numbers add up."""

from __future__ import annotations

import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.limits import KVCapacity, Limits
from gateway.model_info import ModelInfo
from kvstore.protocol import LOOKAHEAD_SLOTS


@pytest.fixture(scope="module")
def tiny() -> ModelInfo:
    return ModelInfo.load(GatewayConfig(model="tiny"))


def test_a_refusal_names_the_lookahead_slots(tiny: ModelInfo) -> None:
    """127 blocks of 16 are 2,032 tokens: 2,000 + 32 do not fit because of the lookahead slots,
    which the message says, with the sum that gives 30."""
    assert LOOKAHEAD_SLOTS == 2
    limits = Limits(tiny, KVCapacity(blocks=127, block_size=16), beam_width=1)
    assert limits.max_tokens(30, "max_tokens", 2000, "prompt") == 30
    with pytest.raises(APIError) as refused:
        limits.max_tokens(32, "max_tokens", 2000, "prompt")
    message = refused.value.message
    assert "(2032 tokens) for one request" in message, message
    assert "keeps 2 lookahead slots free past its last token" in message, message
    assert message.endswith("(at most 30 fit: 2032 less the prompt and the 2 lookahead slots)"), (
        message
    )
    with pytest.raises(APIError) as refused:  # the prompt alone leaves no room
        limits.max_tokens(1, "max_tokens", 2031, "prompt")
    assert "keeps 2 lookahead slots free" in refused.value.message
    assert refused.value.param == "prompt"


def test_a_beam_search_refusal_names_them_too(tiny: ModelInfo) -> None:
    limits = Limits(tiny, KVCapacity(blocks=127, block_size=16), beam_width=4)
    with pytest.raises(APIError) as refused:
        limits.max_tokens(1000, "max_tokens", 100, "prompt")
    message = refused.value.message
    assert "(4 beams held at once), of which each sequence keeps 2 lookahead" in message, message
