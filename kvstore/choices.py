"""The kvstore's priced choices, in one owner: ``CostChoices``.

A preemption swaps or drops its victim, a prefix that goes on in the CPU tier is loaded back or
recomputed: ``Pricing`` prices each, the ``DecisionLog`` keeps it (the admin page's decisions)
and takes its measured time once the daemon ran the plan or the worker recomputed. Owned by the
``KVCacheManager``, which hands it the request and the counts each choice needs. Pure Python.
"""

from __future__ import annotations

from kvstore.cost_model import Choice, DecisionLog
from kvstore.prefix_index import LookupResult
from kvstore.pricing import Pricing
from kvstore.requests import Request, TransferPlan


class CostChoices:
    def __init__(self) -> None:
        self.pricing = Pricing()
        self.log = DecisionLog()
        self._load_busy: dict[int, bool] = {}  # queued prefix loads: decision id -> busy

    def prefix(
        self, request: Request, hit: LookupResult, missing: list[int], running: int, bs: int
    ) -> Choice:
        """Load the ``missing`` blocks of ``hit`` (CPU-tier only) back, or recompute them?
        ``running``: the other requests its worker runs."""
        return self.pricing.prefix_load(
            request.worker,
            len(missing),
            (len(hit.gpu) - hit.gpu_run) * bs,
            hit.gpu_run * bs,
            max(len(request.token_ids) - len(hit.gpu) * bs, 0),
            running,
        )

    def log_prefix(
        self,
        request: Request,
        hit: LookupResult,
        missing: list[int],
        choice: Choice,
        now: float,
        busy: bool,
        bs: int,
    ) -> int:
        """Logs a prefix ``choice`` once the request is placed; a load remembers ``busy`` (its
        worker ran others) for its timing. The decision's id."""
        tokens = (len(hit.gpu) - hit.gpu_run) * bs
        decision = self.log.record(request.req_id, now, len(missing), tokens, choice, "prefix")
        if choice.mode == "load":
            self._load_busy[decision.id] = busy
        return decision.id

    def preempt(
        self, request: Request, blocks: int, cpu_available: int, now: float
    ) -> tuple[Choice, int]:
        """Swap out ``blocks`` of the victim ``request`` (``cpu_available`` CPU-tier blocks
        free or held by demoted prefixes) or drop them? The choice, logged, and its id."""
        choice = self.pricing.preempt(request.worker, blocks, request.num_computed, cpu_available)
        decision = self.log.record(request.req_id, now, blocks, request.num_computed, choice)
        return choice, decision.id

    def transferred(self, plan: TransferPlan, out_s: float, in_s: float) -> None:
        """The measured times of an executed plan (swap-out and swap-in parts), shared among
        its decisions by blocks moved. A plan's decisions own its swap-ins when it has any (a
        resume, a prefix load: the swap-outs beside them are demotions), else its swap-outs.
        Prefix loads' swap-in time also refits the price of loads (``Pricing.observe_load``)."""
        loads = [self._load_busy.pop(d) for d in plan.decisions if d in self._load_busy]
        if loads and plan.swap_in:
            self.pricing.observe_load(len(plan.swap_in), any(loads), in_s)
        seconds = in_s if plan.swap_in else out_s
        moved = sum(plan.decisions.values())
        for decision_id, blocks in plan.decisions.items():
            self.log.add_actual(decision_id, seconds * blocks / moved if moved else 0.0)
