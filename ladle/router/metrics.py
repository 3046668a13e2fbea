"""The router's Prometheus metrics, in a registry of its own (one per app, so apps in one process
never clash)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("ladle_router_requests", "Requests forwarded, by worker and route.",
                                ["worker", "route"], registry=r)
        self.decisions = Counter("ladle_router_routing_decisions", "Routing decisions, by policy and reason.",
                                 ["policy", "reason"], registry=r)
        self.prefix_match_ratio = Histogram(
            "ladle_router_prefix_match_ratio", "Matched fraction of the routing key on the chosen worker "
            "(cache_aware: characters; kv_events: prompt tokens in cached blocks).", buckets=_RATIO_BUCKETS,
            registry=r)
        self.worker_healthy = Gauge("ladle_router_worker_healthy", "1 when the worker's last health check passed.",
                                    ["worker"], registry=r)
        self.in_flight = Gauge("ladle_router_in_flight", "Requests the router has open on the worker.",
                               ["worker"], registry=r)
        self.retries = Counter("ladle_router_retries", "Requests sent again to another worker after a failure.",
                               registry=r)
        self.broken_streams = Counter("ladle_router_streams_failed", "Streams that broke off after their first "
                                      "byte (never retried): they ended in an error event, by reason.", ["reason"],
                                      registry=r)
        self.worker_failures = Counter("ladle_router_worker_failures",
                                       "Requests that failed to connect or got a 5xx, by worker.", ["worker"],
                                       registry=r)
        self.pd_prefill_seconds = Histogram("ladle_router_pd_prefill_seconds",
                                            "Time of the disaggregated prefill hop.", buckets=_PREFILL_BUCKETS,
                                            registry=r)
        self.pd_fallbacks = Counter("ladle_router_pd_fallbacks", "Decode hops sent without KV transfer params "
                                    "(the prefill hop failed or exported nothing): the decode worker recomputes.",
                                    registry=r)

    def count_broken_stream(self, reason: str) -> None:
        self.broken_streams.labels(reason).inc()

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
