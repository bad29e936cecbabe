"""Host-to-device copies that do not wait for the device. Torch only."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(
    values: list[int] | list[float] | list[bool] | list[list[int]],
    device: torch.device,
    dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """A tensor of ``values`` on ``device``, copied without waiting for the device: through
    pinned memory on CUDA. A copy from pageable memory (``torch.tensor(values, device=...)``,
    ``.to(device, non_blocking=True)`` of a plain CPU tensor, indexing a device tensor with a
    list) waits for every kernel queued before it, which undoes the overlap of host and device
    work (measured on the H200: 5.9 ms of host time per decode step spent in such waits)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
