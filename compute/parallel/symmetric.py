"""One-shot all-reduce over NVLink through PyTorch's symmetric memory, for the small activations
a decode step exchanges (64 all-reduces a step at 8B). Inside a CUDA graph on two H200s
(``bench/all_reduce.py``) NCCL took 16-19 µs for up to 0.5 MiB and this kernel 7-11 µs.

Every rank holds one buffer that every other rank can read over NVLink. ``SymmetricAllReduce``
copies this rank's input into its buffer, waits at a barrier of signal pads, and sums every
rank's buffer into a new tensor: one kernel (``symm_mem.one_shot_all_reduce_copy``), captured
by CUDA graphs like any other. Inputs over ``max_bytes`` (long prompt chunks) go to NCCL, which
is faster for them (``bench/all_reduce.py`` measures both), as do those of other dtypes.

NVLink multicast (``multimem``) is not used: it stays off on the lent machines."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MAX_BYTES", "SymmetricAllReduce", "symmetric_all_reduce"]

log = logging.getLogger("pagedserve.compute")

MAX_BYTES = 4 << 20  # 512 tokens at d=4096 in bf16: one-shot 35 µs, NCCL 41; at 8 MiB 63 vs 53
DTYPES = (torch.bfloat16, torch.float32)  # those PyTorch's one-shot kernel sums


class SymmetricAllReduce:
    """The one-shot all-reduce of one process group, on this rank's GPU ``device``, for
    contiguous tensors of ``DTYPES`` up to ``max_bytes``. Building it is collective: every rank
    of ``group`` builds one at the same point."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name: str = group.group_name
        with warnings.catch_warnings():  # needed before torch 2.12, a no-op after
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group)
        self.max_bytes = max_bytes
        self.copy_in = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")  # torch 2.8+

    def fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype in DTYPES and x.is_contiguous() and nbytes <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (which must ``fit``), as a new tensor."""
        out = torch.empty_like(x)
        buffer = self.buffer.view(x.dtype)[: x.numel()]
        if self.copy_in:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(
                buffer, x.view(-1), "sum", self.group_name, out.view(-1)
            )
        else:  # a copy kernel more
            buffer.copy_(x.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(buffer, "sum", self.group_name, out.view(-1))
        return out


def symmetric_all_reduce(group: Any, device: str) -> SymmetricAllReduce | None:
    """The group's ``SymmetricAllReduce``, or None where symmetric memory is not to be had (not
    CUDA, one rank, a torch without it, GPUs without peer access) on any rank: NCCL then does
    every all-reduce. Collective: every rank of ``group`` calls it."""
    size = dist.get_world_size(group)
    if not device.startswith("cuda") or size < 2:
        return None
    reducer: SymmetricAllReduce | None = None
    try:
        reducer = SymmetricAllReduce(group, torch.device(device))
        probe = torch.arange(4096, dtype=torch.bfloat16, device=device)
        if not torch.equal(reducer(probe), probe * size):
            raise RuntimeError("a probe all-reduce gave a wrong sum")
    except (RuntimeError, AttributeError, ImportError) as e:
        log.warning("rank %d: no one-shot all-reduce: %s", dist.get_rank(group), e)
        reducer = None
    everywhere = torch.tensor([reducer is not None], dtype=torch.int32, device=device)
    dist.all_reduce(everywhere, dist.ReduceOp.MIN, group=group)  # NCCL's: all ranks agree
    if not everywhere.item():
        log.warning("NCCL does every all-reduce (no one-shot all-reduce on some rank)")
        return None
    log.info("one-shot all-reduce over symmetric memory up to %d MiB", MAX_BYTES >> 20)
    return reducer
