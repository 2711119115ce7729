"""The router's Prometheus metrics (names are a contract: see docs/router.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "kvpilot_router_queue_depth",
            "Requests held in the router's central queue (no pod with room, or none Ready yet)",
            ["model_name"],
            registry=r,
        )
        self.requests = Counter(
            "kvpilot_router_requests_total",
            "Requests answered by the router, by HTTP status sent to the client",
            ["model_name", "code"],
            registry=r,
        )
        self.queue_time = Histogram(
            "kvpilot_router_queue_time_seconds",
            "Time a request waited in the router before a pod took it",
            ["model_name"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvpilot_router_upstream_retries_total",
            "Requests sent to another pod after a refused/reset connection, a missed connect or first-byte "
            "deadline, or a 503, before any byte reached the client",
            ["model_name"],
            registry=r,
        )
        self.stream_failures = Counter(
            "kvpilot_router_upstream_failures_total",
            "Upstream streams that broke after bytes reached the client (ended with an error event)",
            ["model_name"],
            registry=r,
        )
        self.timeouts = Counter(
            "kvpilot_router_upstream_timeouts_total",
            "Requests a pod missed a deadline on: connect, first_byte (no response headers) or idle "
            "(no next chunk), the last two after it also failed its health probe",
            ["model_name", "phase"],
            registry=r,
        )
        self.ejections = Counter(
            "kvpilot_router_pod_ejections_total",
            "Times a pod was taken out of routing after failures in a row (outlier ejection)",
            ["model_name", "pod"],
            registry=r,
        )
        self.ejected_pods = Gauge(
            "kvpilot_router_ejected_pods",
            "Pods of the model out of routing now after failures in a row (outlier ejection)",
            ["model_name"],
            registry=r,
        )
        self.fallbacks = Counter(
            "kvpilot_router_fallbacks_total",
            "Requests served by the model's fallback model instead of a 429",
            ["model_name", "fallback"],
            registry=r,
        )
        self.in_flight = Gauge(
            "kvpilot_router_in_flight",
            "Requests the router has running on the model's pods",
            ["model_name"],
            registry=r,
        )
        self.ready_pods = Gauge(
            "kvpilot_router_ready_pods",
            "Pods the router can route the model to",
            ["model_name"],
            registry=r,
        )
