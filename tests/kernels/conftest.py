"""Kernel tests: on a machine without CUDA, run Triton kernels in the interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, i.e. before
``kernels`` is imported, which is why it happens here at import time.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """The device the CPU-marked (non-gpu) tests run on: CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def cuda() -> torch.device:
    """For ``@pytest.mark.gpu`` tests: skip cleanly when no GPU is present."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")
