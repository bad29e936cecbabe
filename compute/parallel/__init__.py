"""Tensor parallelism: a model's weights split over the ranks of a group (issue 36; the layers
and the sharded loading so far, not yet the worker group)."""
