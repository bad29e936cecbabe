"""``bench/schedule_bound.py``: the device-time bound of a workload, step by step."""

from __future__ import annotations

from bench.schedule_bound import bound


def test_steps_are_composed_as_the_scheduler_does_and_priced_exactly() -> None:
    """Two requests (prompt 3, output 2; prompt 2, output 1), 4 tokens per step. Step 1: the
    first prompt whole (its first token drawn), one token of the second. Step 2: the first
    decodes over a context of 4, the second's last prompt token draws its only token. Products
    cost 2 FLOPs per token at 1 FLOP/s, at least a read of their 2 weight bytes."""
    parts = bound([(3, 2), (2, 1)], 2, 4, (2.0, 1.0), 1.0, (1.0, 1.0, 1.0))
    assert parts == {"products": 8 + 4, "lm_head": 1 + 2, "decode_attention": 4, "steps": 2}
    small = bound([(1, 1)], 1, 4, (2.0, 1.0), 1.0, (1.0, 0.5, 1.0))  # the weight read wins
    assert small == {"products": 4, "lm_head": 1, "decode_attention": 0, "steps": 1}
