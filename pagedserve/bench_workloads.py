"""The requests ``pagedserve bench`` sends: seeded, so two servers get exactly the same ones.

A prompt's length is counted in tokens when a tokenizer is given (``--tokenizer``: random token
ids decoded to text, as ``vllm bench serve``'s random dataset does), else in words of a fixed
vocabulary (about one token each for common tokenizers). Prompts are always text, so every
OpenAI-compatible server takes them, on ``/v1/completions`` and on ``/v1/chat/completions``.

- ``random``: each request a fresh prompt of ``input_len`` and ``max_tokens`` of ``output_len``
  (both ``lo:hi`` ranges, uniform, or ``lognormal:MU:SIGMA:LO:HI``: ``Lengths``);
- ``shared-prefix``: each request one of ``num_prefixes`` prefixes (system prompts, tenants)
  followed by a fresh part of ``input_len`` (the prefix cache's case). Each prefix is
  ``prefix_len`` long, or draws its own length from a ``lo:hi`` range; the requests take the
  prefixes in turn (``uniform``) or draw them with Zipf popularity (``zipf:S``: the prefix of
  rank r, 1-based, weighted 1/r^S), seeded;
- ``multi-turn``: ``conversations`` conversations of ``turns`` turns. A conversation opens
  with a prompt of its own (``first_prompt_len``: a random system and user message, so no two
  histories share more than the BOS); each later turn's prompt is the previous turn's whole
  prompt, the answer the client received for it and a new user message of ``turn_prompt_len``.
  The turns of one conversation run one after the other (the next is sent once the previous
  answer is complete, after a think time), conversations concurrently.

Any of them with a fraction of the requests asking for structured output (``with_schemas``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pagedserve.json_schemas import random_schema

Workload = Literal["random", "shared-prefix", "multi-turn"]
WORKLOADS: tuple[Workload, ...] = ("random", "shared-prefix", "multi-turn")
# common English words, about one token each for common tokenizers (a list literal would take
# a line a word)
_WORDS = (  # noqa: SIM905
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money story "
    "fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office "
    "door health person art war history party result change morning reason research girl "
    "guy moment air teacher force education foot boy age policy music market sense nation "
    "plan college interest death experience effect class control care field development "
    "role effort rate heart drug show leader light voice wife police mind price report "
    "decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event "
    "official matter center couple site project activity star table need court oil "
    "situation cost industry figure street image phone data picture"
).split()


@dataclass(frozen=True)
class Lengths:
    """How long each request's prompt or output is: uniform over ``[lo, hi]``, or with
    ``sigma`` > 0 lognormal (``exp`` of a normal of ``mu`` and ``sigma``, rounded) clipped to
    ``[lo, hi]``: a long-tailed mix like chat datasets' (ShareGPT's prompts average about 220
    tokens and its answers about 190: ``lognormal:4.9:1.0:4:4096`` and
    ``lognormal:4.85:0.9:4:2048`` have those means)."""

    lo: int
    hi: int
    mu: float = 0.0
    sigma: float = 0.0

    def draw(self, rng: random.Random) -> int:
        if self.sigma == 0:
            return rng.randint(self.lo, self.hi)
        return min(max(round(rng.lognormvariate(self.mu, self.sigma)), self.lo), self.hi)


def parse_lengths(spec: str) -> Lengths:
    """``"64:1024"``, ``"128"`` (``parse_range``) or ``"lognormal:MU:SIGMA:LO:HI"`` (SIGMA > 0).
    Raises ValueError."""
    if not spec.startswith("lognormal:"):
        return Lengths(*parse_range(spec))
    fields = spec.split(":")[1:]
    try:
        mu, sigma, lo, hi = float(fields[0]), float(fields[1]), int(fields[2]), int(fields[3])
    except (ValueError, IndexError):
        mu = sigma = math.nan
        lo = hi = 0
    if len(fields) != 4 or not (0 < sigma < math.inf and math.isfinite(mu) and 1 <= lo <= hi):
        raise ValueError(f"lengths {spec!r}: expected lognormal:MU:SIGMA:LO:HI, SIGMA > 0")
    return Lengths(lo, hi, mu, sigma)


def parse_range(spec: str) -> tuple[int, int]:
    """``"64:1024"`` or ``"128"``: an inclusive range of at least 1. Raises ValueError."""
    lo, _, hi = spec.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise ValueError(f"range {spec!r}: expected lo:hi with 1 <= lo <= hi")
    return low, high


def parse_popularity(spec: str) -> float | None:
    """``"uniform"``: None (the prefixes in turn); ``"zipf:S"``: S, a finite number > 0.
    Raises ValueError."""
    if spec == "uniform":
        return None
    name, _, exponent = spec.partition(":")
    try:
        s = float(exponent)
    except ValueError:
        s = math.nan
    if name != "zipf" or not 0 < s < math.inf:
        raise ValueError(f"prefix popularity {spec!r}: expected 'uniform' or 'zipf:S' with S > 0")
    return s


def prefix_picks(count: int, prefixes: int, zipf: float | None, seed: int) -> list[int]:
    """Which prefix each of ``count`` requests uses: in turn for ``zipf`` None, else drawn
    (seeded, a generator of its own, so the texts do not depend on it) with the prefix of rank
    r (index r - 1) weighted 1/r^zipf."""
    if zipf is None:
        return [i % prefixes for i in range(count)]
    weights = [1 / rank**zipf for rank in range(1, prefixes + 1)]
    return random.Random(seed + 2).choices(range(prefixes), weights=weights, k=count)


@dataclass(frozen=True)
class Turn:
    """One request: the user's new text, its output budget, and the conversation it belongs to
    (its earlier turns come first in the prompt; ``conversation`` is -1 for single requests)."""

    text: str
    max_tokens: int
    conversation: int = -1
    turn: int = 0
    schema: dict[str, Any] | None = None  # the output must be JSON of this schema


class TextMaker:
    """Random text of a given length: tokens of ``decode`` (a tokenizer), else words."""

    def __init__(self, rng: random.Random, decode: Callable[[list[int]], str] | None, vocab: int):
        self.rng, self.decode, self.vocab = rng, decode, vocab

    def __call__(self, length: int) -> str:
        if self.decode is None:
            return " ".join(self.rng.choice(_WORDS) for _ in range(length))
        return self.decode([self.rng.randrange(self.vocab) for _ in range(length)])


def build(
    workload: Workload,
    num_requests: int,
    input_len: Lengths,
    output_len: Lengths,
    seed: int,
    text: Callable[[random.Random], TextMaker],
    prefix_len: int | tuple[int, int] = 512,
    num_prefixes: int = 4,
    turns: int = 4,
    conversations: int = 0,
    first_prompt_len: Lengths | None = None,
    turn_prompt_len: Lengths | None = None,
    prefix_zipf: float | None = None,
) -> list[list[Turn]]:
    """The requests, grouped: one group per conversation (multi-turn), else one per request.
    Shared-prefix: ``num_prefixes`` prefixes of ``prefix_len`` (a ``(lo, hi)`` range: each its
    own length), picked as ``prefix_picks`` does with ``prefix_zipf``. Multi-turn:
    ``conversations`` of them (0: ``num_requests // turns``, at least one), the first turn's
    text of ``first_prompt_len`` and the later ones' of ``turn_prompt_len`` (each ``input_len``
    if None). Same arguments, same requests."""
    rng = random.Random(seed)
    make = text(rng)

    def one(
        conversation: int = -1, turn: int = 0, prefix: str = "", length: Lengths = input_len
    ) -> Turn:
        body = make(length.draw(rng))
        return Turn(prefix + body, output_len.draw(rng), conversation, turn)

    if workload == "random":
        return [[one()] for _ in range(num_requests)]
    if workload == "shared-prefix":
        if num_prefixes < 1:
            raise ValueError(f"shared-prefix: {num_prefixes} prefixes, expected at least 1")
        low, high = (prefix_len, prefix_len) if isinstance(prefix_len, int) else prefix_len
        # a fixed length draws nothing, so the requests stay those of a plain int prefix_len
        prefixes = [
            make(low if low == high else rng.randint(low, high)) + " " for _ in range(num_prefixes)
        ]
        picks = prefix_picks(num_requests, num_prefixes, prefix_zipf, seed)
        return [[one(prefix=prefixes[p])] for p in picks]
    if turns < 1 or conversations < 0:
        raise ValueError(f"multi-turn: {turns} turns, {conversations} conversations")
    count = conversations or max(num_requests // turns, 1)
    first, later = first_prompt_len or input_len, turn_prompt_len or input_len
    return [
        [one(c, t, length=first if t == 0 else later) for t in range(turns)] for c in range(count)
    ]


def with_schemas(groups: list[list[Turn]], fraction: float, seed: int) -> list[list[Turn]]:
    """``groups`` with a ``fraction`` of the requests (seeded) asking for JSON of a random
    bounded JSON Schema (``pagedserve.json_schemas``). Raises ValueError outside [0, 1]."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"guided fraction {fraction}: expected a number in [0, 1]")
    rng = random.Random(seed + 1)

    def pick(turn: Turn) -> Turn:
        if rng.random() >= fraction:
            return turn
        return dataclasses.replace(turn, schema=random_schema(rng))

    return [[pick(turn) for turn in group] for group in groups]
