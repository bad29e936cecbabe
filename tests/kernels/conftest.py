"""Kernel test fixtures. (TRITON_INTERPRET=1 on machines without CUDA is set by the root
``tests/conftest.py``, before any test module can import a Triton kernel.)"""

from __future__ import annotations

import pytest
import torch


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
