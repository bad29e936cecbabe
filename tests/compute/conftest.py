"""The tiny model the engine tests serve, loaded once per module."""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.models import load_model
from tests.compute.driver import reference_model


@pytest.fixture(scope="module")
def tiny() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, PreTrainedModel]:
    model, tokenizer = load_model("tiny", "float32", "cpu")
    return model, tokenizer, reference_model(model)
