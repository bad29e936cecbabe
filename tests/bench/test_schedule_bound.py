"""``bench/schedule_bound.py``: the device-time bound of a workload, step by step."""

from __future__ import annotations

from bench.schedule_bound import bound, weighted_median

UNPADDED = {"padding": 0.0, "padded_tokens": 0}
NO_GRAPHS = {"decode_s": 0, "decode_steps": 0, "mixed_s": 0, "mixed_steps": 0}


def test_steps_are_composed_as_the_scheduler_does_and_priced_exactly() -> None:
    """Two requests (prompt 3, output 2; prompt 2, output 1), 4 tokens per step. Step 1: the
    first prompt whole (its first token drawn), one token of the second. Step 2: the first
    decodes over a context of 4, the second's last prompt token draws its only token. Products
    cost 2 FLOPs per token at 1 FLOP/s, at least a read of their 2 weight bytes. The only
    decoded token is step 2's, so ITL p50 is that step's 4 + 2 + 4 s."""
    parts = bound([(3, 2), (2, 1)], 2, 4, (2.0, 1.0), 1.0, (1.0, 1.0, 1.0))
    want = {"products": 8 + 4, "lm_head": 1 + 2, "decode_attention": 4, "steps": 2}
    eager = {"eager_s": (8 + 1) + (4 + 2 + 4), "eager_steps": 2}  # no graphs: both eager
    assert parts == want | UNPADDED | NO_GRAPHS | eager | {"itl_p50": 10}
    small = bound([(1, 1)], 1, 4, (2.0, 1.0), 1.0, (1.0, 0.5, 1.0))  # the weight read wins
    want = {"products": 4, "lm_head": 1, "decode_attention": 0, "steps": 1, "itl_p50": 0}
    assert small == want | UNPADDED | NO_GRAPHS | {"eager_s": 5, "eager_steps": 1}


def test_a_prefill_interval_holds_prompts_back_while_requests_decode() -> None:
    """(prompt 1, output 2) and (prompt 2, output 1), 2 tokens per step. Every step: the first
    prompt and one token of the second, then the first's decode beside the second's last prompt
    token. Interval 2: that token waits for a step without decodes, a third step."""
    jobs, rates = [(1, 2), (2, 1)], (1.0, 1.0, 1.0)
    assert bound(jobs, 2, 2, (2.0, 1.0), 1.0, rates)["steps"] == 2
    held = bound(jobs, 2, 2, (2.0, 1.0), 1.0, rates, prefill_interval=2)
    assert held["steps"] == 3 and held["products"] == 4 + 2 + 2


def test_weighted_median_takes_the_lower_middle() -> None:
    assert weighted_median([(3.0, 1), (1.0, 2), (2.0, 0)]) == 1.0
    assert weighted_median([(5.0, 1), (1.0, 1)]) == 1.0
    assert weighted_median([(5.0, 1), (1.0, 1), (2.0, 1)]) == 2.0
    assert weighted_median([(5.0, 0)]) == weighted_median([]) == 0.0


def test_graph_buckets_price_the_padded_rows() -> None:
    """The same two requests with graphs: step 1 (4 tokens) fills mixed bucket 4; step 2 (a
    decode and a prompt token: mixed) pads 2 tokens to bucket 4, 2 more rows of products at 2
    FLOPs each. Then a decode-only step of 3 requests pads to decode bucket 4 (one row), and
    one of more tokens than any bucket runs unpadded."""
    graphs = ([1, 2, 4], [4, 8])
    parts = bound([(3, 2), (2, 1)], 2, 4, (2.0, 1.0), 1.0, (1.0, 1.0, 1.0), graphs)
    assert parts["products"] == 8 + 4 and parts["padding"] == 4 and parts["padded_tokens"] == 2
    # both steps replay mixed graphs: 8 + 1 and (4 + 4 padding) + 2 + 4 seconds
    assert (parts["mixed_steps"], parts["mixed_s"], parts["eager_steps"]) == (2, 9 + 14, 0)
    # three one-token prompts, then their decodes: step 1 mixed (3 -> 4), step 2 decodes (3 -> 4)
    decodes = bound([(1, 2)] * 3, 3, 8, (2.0, 1.0), 1.0, (1.0, 1.0, 1.0), graphs)
    assert decodes["steps"] == 2 and decodes["padded_tokens"] == 2 and decodes["padding"] == 4
    assert (decodes["mixed_steps"], decodes["decode_steps"]) == (1, 1)
    # nine one-token prompts in one step: past the largest mixed bucket, eager and unpadded
    eager = bound([(1, 1)] * 9, 9, 16, (2.0, 1.0), 1.0, (1.0, 1.0, 1.0), graphs)
    assert eager["steps"] == 1 and eager["padded_tokens"] == 0 and eager["padding"] == 0
    assert (eager["eager_steps"], eager["mixed_steps"], eager["eager_s"]) == (1, 0, 18 + 9)
