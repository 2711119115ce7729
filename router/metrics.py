"""The router's Prometheus metrics (names are a contract: see docs/router.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# dense around the usual targets: TPOT 0.02-0.2 s, TTFT 0.2-5 s
LATENCY_BUCKETS = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
    0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip


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
            "Pods of the model out of routing now after failures in a row (outlier ejection; a "
            "disaggregated model's prefill pods too)",
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
        # -- the SLO as the clients get it (docs/router.md, "Measured SLO"; the autoscaler reads these)
        self.slo_requests = Counter(
            "kvpilot_router_slo_requests_total",
            "Requests judged against the model's SLO (api/slo.py): met, missed_ttft, missed_tpot, failed",
            ["model_name", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "kvpilot_router_time_to_first_token_seconds",
            "Streamed requests: from the request's arrival at the router to its first output token "
            "going out to the client",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvpilot_router_time_per_output_token_seconds",
            "Streamed requests: (last token - first token) / (output tokens - 1), as the client got them",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.slo_attainment = Gauge(
            "kvpilot_router_slo_attainment_ratio",
            "Share of the requests judged over the last --slo-window seconds that met the SLO",
            ["model_name"],
            registry=r,
        )
        self.slo_window_requests = Gauge(
            "kvpilot_router_slo_window_requests",
            "Requests judged over the last --slo-window seconds",
            ["model_name"],
            registry=r,
        )
        self.ttft_window = Gauge(
            "kvpilot_router_ttft_window_seconds",
            "TTFT quantiles of the streamed requests over the last --slo-window seconds",
            ["model_name", "quantile"],
            registry=r,
        )
        self.tpot_window = Gauge(
            "kvpilot_router_tpot_window_seconds",
            "TPOT quantiles of the streamed requests over the last --slo-window seconds",
            ["model_name", "quantile"],
            registry=r,
        )
        self.pod_ttft = Gauge(
            "kvpilot_router_pod_ttft_ewma_seconds",
            "Moving average of a pod's TTFT (from the request's sending to the pod), which routing reads",
            ["model_name", "pod"],
            registry=r,
        )
        self.pod_tpot = Gauge(
            "kvpilot_router_pod_tpot_ewma_seconds",
            "Moving average of a pod's TPOT, which routing reads",
            ["model_name", "pod"],
            registry=r,
        )
        self.pod_errors = Gauge(
            "kvpilot_router_pod_error_rate",
            "Moving average of a pod's failed exchanges (0..1), which routing reads",
            ["model_name", "pod"],
            registry=r,
        )
        self.migrations = Counter(
            "kvpilot_router_stream_migrations_total",
            "Streams continued on another pod after theirs died mid-stream (docs/router.md)",
            ["model_name"],
            registry=r,
        )
        # -- prefill/decode disaggregation (docs/disaggregation.md, "Router")
        self.pd_requests = Counter(
            "kvpilot_router_pd_requests_total",
            "Requests of disaggregated models by how they ran: disaggregated (prefill pod, then decode "
            "pod with the KV transfer), direct (a decode pod alone: a short prompt, echo, "
            "prompt_logprobs...), no_prefill (a decode pod alone: a long prompt while no prefill pod was "
            "routable), prefill_failed (the prefill leg failed or missed its deadline: a decode pod ran "
            "the whole request)",
            ["model_name", "path"],
            registry=r,
        )
        self.pd_prefill_seconds = Histogram(
            "kvpilot_router_pd_prefill_seconds",
            "Disaggregated requests: the prefill leg, from the request's admission to a decode pod to the "
            "prefill pod's answer (waiting for a prefill pod with room included)",
            ["model_name"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pd_prefill_speed = Gauge(
            "kvpilot_router_pd_prefill_tokens_per_second",
            "A disaggregated model's prefill pool as the router measures it: prompt tokens per second of "
            "its prefill legs (the wait in a prefill pod's own queue included; an average of the last "
            "legs), which bounds how long a prefill leg may run (docs/disaggregation.md)",
            ["model_name"],
            registry=r,
        )
        self.pd_queued = Gauge(
            "kvpilot_router_pd_queued",
            "Requests of a disaggregated model held in its central queue (kvpilot_router_queue_depth) by "
            "what they will need: prefill (a long prompt whose prefill leg has not run) or direct (a "
            "decode pod alone)",
            ["model_name", "path"],
            registry=r,
        )
        self.pd_prefill_pods = Gauge(
            "kvpilot_router_pd_prefill_pods",
            "Prefill pods the router can route a disaggregated model's prompts to "
            "(kvpilot_router_ready_pods counts its decode pods)",
            ["model_name"],
            registry=r,
        )
        self.rejections = Counter(
            "kvpilot_router_rejections_total",
            "Requests the router answered itself with 429/503/502/504, by the reason it named "
            "(x-kvpilot-reject-reason)",
            ["model_name", "reason"],
            registry=r,
        )
