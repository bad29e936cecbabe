"""The tiny model the engine tests serve, loaded once per module."""

from __future__ import annotations

import pytest

from compute.models import load_model
from tests.compute.driver import reference_model


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object, object]:
    model, tokenizer = load_model("tiny", "float32", "cpu")
    return model, tokenizer, reference_model(model)
