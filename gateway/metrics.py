"""``/metrics``: Prometheus metrics named after vLLM's (``vllm:`` becomes ``pagedserve:``).

Two sources, one per-app ``CollectorRegistry`` (never the global one, so several apps can live in
one process). With ``PROMETHEUS_MULTIPROC_DIR`` set (``pagedserve up --gateways N``: several
gateway processes on one port), prometheus_client keeps the per-request metrics in files there,
one per process, and a scrape of any gateway sums them over every gateway process (a restarted
one's counts stay in):

* measured here, per request: ``time_to_first_token_seconds``, ``inter_token_latency_seconds``
  (the gap between two deltas of one sequence), ``e2e_request_latency_seconds`` histograms;
  ``prompt_tokens_total``, ``generation_tokens_total``, ``request_success_total{finished_reason}``;
* read at scrape time from the kvstore (``GetStats``) and Redis: ``prefix_cache_queries_total``
  and ``prefix_cache_hits_total`` (tokens), ``kv_cache_usage_perc`` (GPU blocks in use, 0-1),
  ``cpu_cache_usage_perc`` (swap tier), ``num_preemptions_total{kind=swap|recompute}``,
  ``prefix_cache_hits_by_tier_total{tier=gpu|cpu}`` (tokens; cpu: loaded back from the CPU
  tier), ``prefix_cache_tier_blocks_total{event=demoted|demoted_at_eviction|dropped|loaded|
  recomputed}``, ``cpu_prefix_cache_blocks`` (demoted prefix blocks held in the CPU tier),
  ``num_requests_running`` (requests holding GPU blocks), ``num_requests_swapped``,
  ``num_requests_waiting`` (in the Redis request stream but not running or swapped: queued, held
  by a worker before admission, or preempted for recompute), ``num_workers``, ``kvstore_up``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvstore import protocol as p

PREFIX = "pagedserve:"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when imported
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def base_request_id(seq_id: str) -> str:
    """The request a kvstore sequence belongs to (the engine names the forks of an n > 1
    request ``{req_id}#{k}``)."""
    return seq_id.split("#", 1)[0]


@dataclass
class Snapshot:
    """What a scrape read from the kvstore (None: it did not answer) and Redis."""

    stats: p.Stats | None
    queued: int  # entries in the Redis request stream (waiting or in flight)


class KVStoreCollector(Collector):
    """Yields the kvstore's counters and gauges from the snapshot the scrape just took."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot = Snapshot(None, 0)

    def collect(self) -> Iterator[Metric]:
        labels, values = ["model_name"], [self.model_name]
        stats, queued = self.snapshot.stats, self.snapshot.queued

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge("kvstore_up", "1 if the kvstore answered this scrape", stats is not None)
        if stats is None:
            yield gauge("num_requests_waiting", "requests in the Redis stream", queued)
            return
        for name, value, doc in (
            ("prefix_cache_queries", stats.prefix_queried_tokens, "prompt tokens looked up"),
            ("prefix_cache_hits", stats.prefix_hit_tokens, "prompt tokens found cached"),
        ):
            counter = CounterMetricFamily(PREFIX + name, f"prefix cache: {doc}", labels=labels)
            counter.add_metric(values, value)
            yield counter

        def by_label(name: str, doc: str, label: str, counts: dict[str, float]) -> Metric:
            family = CounterMetricFamily(PREFIX + name, doc, labels=[*labels, label])
            for key, value in sorted(counts.items()):
                family.add_metric([*values, key], value)
            return family

        kinds = ("swap", "recompute")
        preempted = {kind: float(stats.preemptions.get(kind, 0)) for kind in kinds}
        yield by_label("num_preemptions", "preemptions by kind", "kind", preempted)

        yield by_label(
            "prefix_cache_hits_by_tier",
            "prefix cache: prompt tokens found cached, by the tier that held them",
            "tier",
            {
                "gpu": stats.prefix_hit_tokens - stats.prefix_hit_tokens_cpu,
                "cpu": stats.prefix_hit_tokens_cpu,
            },
        )
        yield by_label(
            "prefix_cache_tier_blocks",
            "prefix blocks moved between tiers: demoted ahead of eviction or at it, dropped from "
            "both tiers, loaded back from the CPU, or recomputed instead of loaded",
            "event",
            dict(stats.tier_counts),
        )
        yield by_label(
            "kvstore_busy_seconds",
            "the kvstore daemon's time: handling each message kind, writing back between calls, "
            "and (within those) its copies by kind",
            "activity",
            stats.busy_s,
        )
        yield gauge(
            "cpu_prefix_cache_blocks", "demoted prefix blocks in the CPU tier", stats.cpu.cached
        )
        yield gauge("kv_cache_usage_perc", "GPU KV blocks in use (0-1)", _ratio(stats.gpu))
        yield gauge("cpu_cache_usage_perc", "CPU swap blocks in use (0-1)", _ratio(stats.cpu))
        running = {base_request_id(r.req_id) for r in stats.requests if r.status == "running"}
        swapped = {base_request_id(r.req_id) for r in stats.requests if r.status == "swapped"}
        swapped -= running
        yield gauge("num_requests_running", "requests holding GPU blocks", len(running))
        yield gauge("num_requests_swapped", "requests swapped out to the CPU tier", len(swapped))
        waiting = max(0, queued - len(running) - len(swapped))
        yield gauge("num_requests_waiting", "requests queued or preempted", waiting)
        yield gauge("num_workers", "compute workers registered", len(stats.workers))


def _ratio(tier: p.TierStats) -> float:
    return tier.used / tier.total if tier.total else 0.0


class Metrics:
    """The app's registry and the per-request instruments."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        label, registry = ["model_name"], self.registry

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                PREFIX + name, documentation, label, registry=registry, buckets=buckets
            ).labels(model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "seconds from the request's arrival to its first token",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "seconds between two deltas of one sequence", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "seconds from the request's arrival to its last token",
            E2E_BUCKETS,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "prompt tokens of finished requests", label, registry=registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "tokens generated", label, registry=registry
        ).labels(model_name)
        self.success = Counter(
            PREFIX + "request_success",
            "finished requests by the finish reason of their first sequence",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.kvstore = KVStoreCollector(model_name)
        shared = os.environ.get(MULTIPROC_ENV)
        self.exposed = self.registry  # what a scrape renders
        if shared:
            self.exposed = CollectorRegistry(auto_describe=False)
            MultiProcessCollector(self.exposed, shared)
        self.exposed.register(self.kvstore)

    def finished(self, reason: str, prompt_tokens: int, e2e_s: float) -> None:
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.e2e.observe(e2e_s)

    def render(self, snapshot: Snapshot) -> bytes:
        """The exposition text with the kvstore part read from ``snapshot``."""
        self.kvstore.snapshot = snapshot
        return generate_latest(self.exposed)
