"""Tensor-parallel layers (Megatron-style, as in vLLM's and nano-vllm's parallel layers): each rank
of a ``TPGroup`` holds one slice of a weight and the group exchanges activations where a slice's
output is partial.

- ``ColumnParallelLinear``: this rank's rows of the weight (output features: its heads of q/k/v,
  its share of gate/up). The output stays sharded: no communication.
- ``RowParallelLinear``: this rank's columns (input features: the o and down projections read
  the sharded output of the layer before); the partial products are summed by one all-reduce,
  the bias added once after it.
- ``VocabParallelEmbedding``: this rank's rows of the vocabulary; a token outside them embeds to
  zeros, one all-reduce gives every rank every token's embedding.
- ``ParallelLMHead``: this rank's rows of the vocabulary's logits, gathered to the full
  vocabulary on every rank (the sampler sees what one GPU's head would give).

Each layer knows which slice of the full checkpoint tensor it holds (``slice_of``), so the loader
reads only that part from the safetensors files. The vocabulary is split in equal shares of
``ceil(vocab / size)`` rows; the last rank's share is padded with zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional

from compute.parallel.plan_ring import PlanRing
from compute.parallel.symmetric import SymmetricAllReduce
from contracts.model_config import heads_per_rank

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "TPGroup",
    "TensorSlice",
    "VocabParallelEmbedding",
]


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, exchanging
    activations over ``group`` (a ``torch.distributed`` process group of the devices' backend;
    None: the default one); rank 0 sends the others its messages through ``plans``
    (``compute.parallel.plan_ring``; None: a group that sends none, as in layer tests).
    ``one_shot``: the group's NVLink all-reduce for small tensors
    (``compute.parallel.symmetric``), None: NCCL (or gloo) does them all."""

    rank: int
    size: int
    group: Any = None
    plans: PlanRing | None = None
    one_shot: SymmetricAllReduce | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks: ``x`` summed in place, or a new tensor."""
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class TensorSlice:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a checkpoint tensor; ``pad``:
    zero rows after them (the last vocabulary share)."""

    dim: int
    start: int
    stop: int
    pad: int = 0


def head_rows(num_heads: int, head_dim: int, group: TPGroup) -> TensorSlice:
    """The rows of a q, k or v projection that serve this rank's heads (``heads_per_rank``:
    an equal share, or one head that consecutive ranks share when there are fewer heads than
    ranks)."""
    per = heads_per_rank(num_heads, group.size)
    first = group.rank * per if num_heads >= group.size else group.rank * num_heads // group.size
    return TensorSlice(0, first * head_dim, (first + per) * head_dim)


def even_slice(n: int, dim: int, group: TPGroup) -> TensorSlice:
    if n % group.size:
        raise ValueError(f"{n} features do not split over {group.size} ranks")
    per = n // group.size
    return TensorSlice(dim, group.rank * per, (group.rank + 1) * per)


def _empty(shape: tuple[int, ...], **factory: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, **factory), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``x @ W[rows].T + b[rows]``: the output features ``rows`` of a full ``Linear``."""

    def __init__(
        self, in_features: int, rows: TensorSlice, bias: bool, group: TPGroup, **factory: Any
    ) -> None:
        super().__init__()
        self.rows, self.group = rows, group
        self.in_features, self.out_features = in_features, rows.stop - rows.start  # as a Linear's
        self.weight = _empty((self.out_features, in_features), **factory)
        self.bias = _empty((self.out_features,), **factory) if bias else None

    def slice_of(self, name: str) -> TensorSlice:
        return self.rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``sum over ranks (x_rank @ W[:, cols_rank].T) + b``: ``x`` holds this rank's input
    features (the column-parallel layer's output before it)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group: TPGroup, **factory: Any
    ) -> None:
        super().__init__()
        self.cols, self.group = even_slice(in_features, 1, group), group
        self.in_features, self.out_features = self.cols.stop - self.cols.start, out_features
        self.weight = _empty((out_features, self.in_features), **factory)
        self.bias = _empty((out_features,), **factory) if bias else None

    def slice_of(self, name: str) -> TensorSlice | None:
        return self.cols if name == "weight" else None  # the bias is whole on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(functional.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def vocab_rows(vocab: int, group: TPGroup) -> TensorSlice:
    per = -(-vocab // group.size)
    start = min(group.rank * per, vocab)
    stop = min(start + per, vocab)
    return TensorSlice(0, start, stop, pad=per - (stop - start))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; a token of another rank's rows embeds to zeros
    here, and the all-reduce sums every rank's part."""

    def __init__(self, vocab: int, dim: int, group: TPGroup, **factory: Any) -> None:
        super().__init__()
        self.rows, self.group = vocab_rows(vocab, group), group
        self.num_embeddings = vocab  # the whole vocabulary's, as an Embedding's
        self.weight = _empty((self.rows.stop - self.rows.start + self.rows.pad, dim), **factory)

    def slice_of(self, name: str) -> TensorSlice:
        return self.rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.rows.start, self.rows.stop
        mine = (ids >= start) & (ids < stop)
        out = functional.embedding(torch.where(mine, ids - start, 0), self.weight)
        return self.group.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered into the whole vocabulary's. ``weight``
    may be the embedding's (tied embeddings: the same rows)."""

    def __init__(
        self, vocab: int, dim: int, group: TPGroup, tied: nn.Parameter | None = None, **factory: Any
    ) -> None:
        super().__init__()
        self.rows, self.group = vocab_rows(vocab, group), group
        self.out_features = vocab  # the whole vocabulary's logits, as a Linear head's
        shape = (self.rows.stop - self.rows.start + self.rows.pad, dim)
        self.weight = tied if tied is not None else _empty(shape, **factory)

    def slice_of(self, name: str) -> TensorSlice:
        return self.rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.group.gather_last(functional.linear(hidden, self.weight))
        return logits[..., : self.out_features]
