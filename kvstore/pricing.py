"""The cost model's inputs and the prices they give: one ``Pricing`` per manager, its only owner.

Inputs: the daemon's swap calibration (``calibration``), each worker's startup profiles (the
eager ``(tokens, seconds)`` prefill profile for preemptions; the ``(tokens, context, seconds)``
recompute profile timed through the worker's own forward, CUDA graphs included, for prefix
loads), and online, the daemon's measured times of the prefix loads it ran.

- A preemption is priced by ``choose`` (swap out + in against the eager prefill profile).
- A prefix hit that reaches CPU-only blocks is priced by ``choose_prefix_load`` and, where the
  worker sent a recompute profile, again by measured prices: the recompute fitted to that
  profile (``CostRefit.recompute_s``: a step of its own, the tokens, their attention over the
  context, so the suffix the request prefills anyway makes the recompute marginal), the load to
  the calibration until the daemon has timed loads of ``min_points`` sizes, then to those times.
  Where the worker replays CUDA graphs of fixed token counts (``graph_buckets``), the tokens
  priced are those its step grows by once padded to a graph: 16 more tokens may cost none (the
  step's graph had room) or 128 (the next graph).

Priors, while a worker has sent no profile (it measured nothing: ``--profile-budget-s 0``): the
recompute side has no price, so the side the kvstore measured itself wins wherever it can run (a
preemption swaps when the CPU tier has room, a prefix hit loads); without a swap calibration, or
with the CPU tier full, it recomputes, the only choice left. A partial profile (a budget cut it
short) prices past its largest point by extrapolation. ``origins`` says, per worker, which
profile is in force (``protocol.ProfileOrigin``: measured, from the worker's cache, or prior).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from kvstore.cost_model import Choice, CostRefit, SwapCalibration, choose, choose_prefix_load
from kvstore.protocol import ProfileOrigin

RecomputePoint = tuple[int, int, float]  # (tokens, context tokens before them, seconds)


def padded(tokens: int, buckets: Sequence[int]) -> int:
    """The tokens a step of ``tokens`` computes: the smallest of the sorted CUDA-graph
    ``buckets`` that holds them, or ``tokens`` past the largest (eager) or without graphs."""
    i = bisect.bisect_left(buckets, tokens)
    return buckets[i] if tokens > 0 and i < len(buckets) else tokens


def step_growth(tokens: int, base: int, buckets: Sequence[int]) -> int:
    """How many more tokens a step of ``base`` tokens computes with ``tokens`` more."""
    return padded(base + tokens, buckets) - padded(base, buckets)


class Pricing:
    def __init__(self) -> None:
        self.calibration: SwapCalibration | None = None
        self.prefill_profiles: dict[str, list[tuple[int, float]]] = {}
        self.recompute_profiles: dict[str, list[RecomputePoint]] = {}
        self.graph_buckets: dict[str, list[int]] = {}
        self.origins: dict[str, ProfileOrigin] = {}  # of the profiles in force, per worker
        self._recomputes: dict[str, CostRefit] = {}  # worker -> recompute prices
        self.loads = CostRefit()  # the daemon's own load times, every worker's

    def register(
        self,
        worker: str,
        prefill_profile: Sequence[tuple[int, float]],
        recompute_profile: Sequence[RecomputePoint] = (),
        graph_buckets: Sequence[int] = (),
        origin: ProfileOrigin | None = None,
    ) -> None:
        """A worker's startup profiles (an empty one keeps what the worker sent before, and
        its ``origin``), the token counts of its CUDA graphs of prefill steps (none: it runs
        them eagerly) and where the profiles came from."""
        kept = worker in self.prefill_profiles or worker in self.recompute_profiles
        if origin is not None and (prefill_profile or recompute_profile or not kept):
            self.origins[worker] = origin
        if prefill_profile:
            self.prefill_profiles[worker] = list(prefill_profile)
        if recompute_profile:
            buckets = sorted(graph_buckets)
            self.recompute_profiles[worker] = list(recompute_profile)
            self.graph_buckets[worker] = buckets
            refit = CostRefit()
            for tokens, context, seconds in recompute_profile:
                linear = padded(tokens, buckets)
                for busy in (False, True):  # timed alone: the best guess beside decodes too
                    refit.observe_recompute(tokens, context, busy, seconds, 0, linear)
            self._recomputes[worker] = refit

    def prefix_load(
        self,
        worker: str,
        load_blocks: int,
        recompute_tokens: int,
        context_tokens: int,
        suffix_tokens: int,
        running: int,
    ) -> Choice:
        """Load ``load_blocks`` CPU-tier blocks back, or recompute the ``recompute_tokens`` they
        and the GPU blocks after them cover, after ``context_tokens`` cached on the GPU and
        before the request's own ``suffix_tokens``? ``running``: the other requests the worker
        runs (a token each in its steps, about). The recompute is priced at the margin of the
        step the request runs anyway: its tokens (padded as the step is) and their attention,
        plus a step of its own when the request had at most its last token to compute.
        Without a recompute profile the prefill profile prices the recompute alone (no suffix:
        an eager profile is host-bound and flat on a fast GPU, so its margins are ~0)."""
        prior = choose_prefix_load(
            load_blocks,
            recompute_tokens,
            0,
            self.calibration,
            self.prefill_profiles.get(worker, []),
        )
        if worker not in self._recomputes or prior.predicted_swap_s is None:
            return prior
        load_s = self.loads.move_s(load_blocks, running > 0, prior.predicted_swap_s)
        recompute_s = self._recompute_s(
            worker, recompute_tokens, context_tokens, suffix_tokens, running, prior
        )
        assert recompute_s is not None  # the worker's refit prices it
        if load_s <= recompute_s:
            return Choice("load", "loading is cheaper (measured prices)", load_s, recompute_s)
        return Choice("recompute", "recompute is cheaper (measured prices)", load_s, recompute_s)

    def peer_copy(
        self,
        worker: str,
        copy_s: float,
        recompute_tokens: int,
        context_tokens: int,
        suffix_tokens: int,
        running: int,
    ) -> Choice:
        """Copy blocks another pool caches into this one (``copy_s``: the measured price of the
        batch), or let ``worker`` recompute their ``recompute_tokens``? The recompute is priced
        as for a prefix load (``prefix_load``); without any profile from the worker, the copy
        wins (it was measured, the recompute was not)."""
        prior = choose_prefix_load(
            1, recompute_tokens, 0, None, self.prefill_profiles.get(worker, [])
        )
        recompute_s = self._recompute_s(
            worker, recompute_tokens, context_tokens, suffix_tokens, running, prior
        )
        if recompute_s is None:
            return Choice("copy", "no profile from the worker", copy_s, None)
        if copy_s <= recompute_s:
            return Choice("copy", "copying is cheaper", copy_s, recompute_s)
        return Choice("recompute", "recompute is cheaper", copy_s, recompute_s)

    def _recompute_s(
        self,
        worker: str,
        tokens: int,
        context_tokens: int,
        suffix_tokens: int,
        running: int,
        prior: Choice,
    ) -> float | None:
        """Recomputing ``tokens`` after ``context_tokens`` beside ``suffix_tokens`` more, on
        ``worker`` running ``running`` others: the refit of its recompute profile where it sent
        one, else the prior's marginal prefill time (None without a profile)."""
        refit = self._recomputes.get(worker)
        if refit is None:
            return prior.predicted_recompute_s
        base = running + suffix_tokens
        linear = step_growth(tokens, base, self.graph_buckets.get(worker, []))
        fallback = prior.predicted_recompute_s or 0.0
        busy = running > 0
        return refit.recompute_s(tokens, context_tokens, busy, fallback, suffix_tokens, linear)

    def preempt(self, worker: str, blocks: int, tokens: int, cpu_blocks_free: int) -> Choice:
        """Swap out + in or recompute a victim holding ``blocks`` with ``tokens`` computed."""
        return choose(
            blocks, tokens, self.calibration, self.prefill_profiles.get(worker, []), cpu_blocks_free
        )

    def observe_load(self, blocks: int, busy: bool, seconds: float) -> None:
        """The daemon's measured time of one plan's prefix loads (``blocks`` in all)."""
        if blocks > 0:
            self.loads.observe_move(blocks, busy, seconds)
