"""Prometheus metrics of one server, with the names docs/runtime.md lists (label `model_name` on each).

Two sources: the server counts what it sees per request (tokens, finished requests, latencies),
and engine-side values (KV usage, running/waiting, preemptions, prefix cache, OOM recoveries, the
engine loop's watchdog) are read from `engine.stats()` when Prometheus scrapes, so they are always
current. While no engine is attached (the model is still loading) the engine-side series are
absent, not zero: the autoscaler treats a missing metric as "hold", and a zero as a real reading.

The same engine readings are also exposed under the names of the Gateway API Inference Extension's
Model Server Protocol (`vllm:*`, see MSP_* below), so a standard endpoint picker can route to a pod.

Each server gets its own `CollectorRegistry`, so tests (or two servers in one process) don't clash.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot.api import pod_metrics as pm
from kvpilot.api.pod_metrics import OUTPUT_TOKENS_BUCKETS, PROMPT_TOKENS_BUCKETS
from kvpilot.runtime.engine.kv_transfer.client import FAILURE_REASONS, FALLBACK_REASONS

log = logging.getLogger(__name__)

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
QUEUE_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
KV_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Output lengths (tokens per finished generation): api/pod_metrics.OUTPUT_TOKENS_BUCKETS, the points
# the autoscaler's TPOT tail rule reads the distribution at.

# (metric name, help, EngineStats attribute)
ENGINE_GAUGES = (
    (pm.KV_CACHE_USAGE.kvpilot, "Fraction of KV-cache blocks in use (0..1).", "kv_cache_usage"),
    (pm.REQUESTS_RUNNING.kvpilot, "Requests (sequences) in the running batch.", "num_running"),
    (
        pm.REQUESTS_WAITING.kvpilot,
        "Requests (sequences) admitted and not running: the engine's inbox, requests being prepared "
        "and the scheduler's queue.",
        "num_waiting",
    ),
    (
        "kvpilot_engine_stalled",
        "1 while the engine loop is stuck (no progress for --engine-stall-timeout with work to do) or "
        "has stopped: /health and /ready answer 503.",
        "engine_stalled",
    ),
    (
        "kvpilot_engine_heartbeat_age_seconds",
        "Seconds since the engine loop last made progress (finished a step or an idle wait).",
        "engine_heartbeat_age_seconds",
    ),
    (
        pm.KV_TRANSFERS_PENDING.kvpilot,
        "Prefill side: transfers whose KV blocks are pinned, waiting for a decode pod to pull and "
        "release them (or for --kv-transfer-ttl).",
        "kv_transfers_pending",
    ),
    (
        "kvpilot_spec_decode_draft_acceptance_rate",
        "Accepted over proposed speculative tokens since start (rate() of the two counters gives "
        "a windowed view).",
        "spec_acceptance_rate",
    ),
)
ENGINE_COUNTERS = (
    ("kvpilot_num_preemptions_total", "Sequences preempted for lack of KV blocks.", "num_preemptions"),
    (
        "kvpilot_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    ("kvpilot_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("kvpilot_oom_recoveries_total", "Out-of-memory conditions recovered from.", "oom_recoveries"),
    # speculative decoding (absent while it is off)
    (
        "kvpilot_spec_decode_num_drafts_total",
        "Verifications of speculative proposals (one per sequence and step that proposed).",
        "spec_num_drafts",
    ),
    (
        "kvpilot_spec_decode_num_draft_tokens_total",
        "Speculative tokens proposed.",
        "spec_num_draft_tokens",
    ),
    (
        "kvpilot_spec_decode_num_accepted_tokens_total",
        "Speculative tokens accepted by verification.",
        "spec_num_accepted_tokens",
    ),
    (
        "kvpilot_spec_decode_num_emitted_tokens_total",
        "Tokens verification steps produced (accepted proposals plus the target model's own token).",
        "spec_num_emitted_tokens",
    ),
)

# The Gateway API Inference Extension's Model Server Protocol: the metrics an endpoint picker (EPP)
# reads from every model server, under the names vLLM gives them ("Metrics Reporting" and "LoRA Adapter
# Serving" in gateway-api-inference-extension docs/proposals/003-model-server-protocol/README.md).
# They repeat readings kvpilot already exposes under its own names, from the same `stats()` call, so
# both names agree within a scrape. vLLM's `vllm:kv_cache_usage_perc` is a fraction (0..1, "1 means 100
# percent usage") despite its name, and the protocol names that metric, so it is the fraction here too.
MSP_GAUGES = (
    (
        pm.REQUESTS_WAITING.vllm[0],
        "Model Server Protocol TotalQueuedRequests: requests admitted and not running "
        "(= kvpilot_num_requests_waiting).",
        "num_waiting",
    ),
    (
        pm.REQUESTS_RUNNING.vllm[0],
        "Model Server Protocol TotalRunningRequests: requests in the running batch "
        "(= kvpilot_num_requests_running).",
        "num_running",
    ),
    (
        pm.KV_CACHE_USAGE.vllm[0],
        "Model Server Protocol KVCacheUtilization: fraction of KV-cache blocks in use, 0..1 as in vLLM "
        "(= kvpilot_kv_cache_usage_ratio).",
        "kv_cache_usage",
    ),
)
MSP_CACHE_CONFIG = "vllm:cache_config_info"
MSP_LORA = "vllm:lora_requests_info"

StatsSource = Callable[[], Any]


def msp_metrics(model_name: str, stats: Any, now: float) -> Iterator[Metric]:
    """The Model Server Protocol families from one engine reading (values absent from `stats` are left
    out, like kvpilot's own). `vllm:cache_config_info` and `vllm:lora_requests_info` carry their values in
    labels (strings), as vLLM's do; the info gauge's value is 1, the LoRA gauge's the time of the reading
    (seconds since the epoch: the protocol's "last updated timestamp", which a picker uses to take the
    newest sample)."""
    for name, help_text, attr in MSP_GAUGES:
        value = getattr(stats, attr, None)
        if value is not None:
            g = GaugeMetricFamily(name, help_text, labels=["model_name"])
            g.add_metric([model_name], float(value))
            yield g
    block_size, num_blocks = getattr(stats, "block_size", None), getattr(stats, "num_blocks", None)
    if block_size is not None and num_blocks is not None:
        g = GaugeMetricFamily(
            MSP_CACHE_CONFIG,
            "Model Server Protocol BlockSize and NumGPUBlocks: the KV cache's tokens per block and blocks "
            "in the pool (on every device kvpilot runs on), in labels; value 1.",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        g.add_metric([model_name, str(int(block_size)), str(int(num_blocks))], 1.0)
        yield g
    lora = getattr(stats, "lora", None)
    if lora is not None:
        g = GaugeMetricFamily(
            MSP_LORA,
            "Model Server Protocol LoRA adapters: max_lora (adapters the running batch may use at once), "
            "running_lora_adapters and waiting_lora_adapters (comma-separated adapters of running and "
            "queued requests); the value is when this was read (seconds since the epoch).",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        g.add_metric([model_name, str(lora.max_loras), ",".join(lora.running), ",".join(lora.waiting)], now)
        yield g


class EngineStatsCollector(Collector):
    """Reads `stats()` at scrape time and reports its values under the contract names, and under the
    Model Server Protocol's."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.source: StatsSource | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        try:
            stats = self.source()
        except Exception:  # a scrape must never take the server down
            log.exception("engine stats unavailable")
            return
        for name, help_text, attr in ENGINE_GAUGES:
            value = getattr(stats, attr, None)
            if value is not None:
                g = GaugeMetricFamily(name, help_text, labels=["model_name"])
                g.add_metric([self.model_name], float(value))
                yield g
        for name, help_text, attr in ENGINE_COUNTERS:
            value = getattr(stats, attr, None)
            if value is not None:
                c = CounterMetricFamily(name, help_text, labels=["model_name"])
                c.add_metric([self.model_name], float(value))
                yield c
        role = getattr(stats, "kv_role", None)
        if role is not None:
            g = GaugeMetricFamily(
                pm.ENGINE_INFO.kvpilot,
                "This pod's engine settings in labels: kv_role (--kv-role: prefill, decode or both); value 1.",
                labels=["model_name", pm.KV_ROLE_INFO_LABEL],
            )
            g.add_metric([self.model_name, str(role)], 1.0)
            yield g
        yield from msp_metrics(self.model_name, stats, time.time())


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._engine = EngineStatsCollector(model_name)
        self.registry.register(self._engine)
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            """A histogram of this model's series (one label, model_name)."""
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = Counter(
            pm.PROMPT_TOKENS.counter_base, "Prompt tokens received (once per prompt).", labels, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            pm.GENERATION_TOKENS.counter_base,
            "Tokens generated and delivered to clients.",
            labels,
            registry=r,
        ).labels(model_name)
        self._success = Counter(
            pm.REQUEST_SUCCESS.counter_base,
            "Finished generations (one per choice) by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(
            pm.TIME_TO_FIRST_TOKEN.kvpilot,
            "Time from request arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            pm.INTER_TOKEN_LATENCY.kvpilot,
            "Time between consecutive generated tokens of one sequence.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "kvpilot_e2e_request_latency_seconds", "Time from request arrival to its last token.", E2E_BUCKETS
        )
        self.queue_time = histogram(
            "kvpilot_request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            QUEUE_BUCKETS,
        )

        self.prompt_lengths = histogram(
            pm.REQUEST_PROMPT_TOKENS.kvpilot,
            "Prompt tokens per finished generation (one per choice; aborted ones are not counted).",
            PROMPT_TOKENS_BUCKETS,
        )
        self.admitted_prompt_lengths = histogram(
            pm.ADMITTED_PROMPT_TOKENS.kvpilot,
            "Prompt tokens per generation admitted (one per choice, observed as it is submitted).",
            PROMPT_TOKENS_BUCKETS,
        )
        self.output_tokens = histogram(
            pm.REQUEST_GENERATION_TOKENS.kvpilot,
            "Tokens generated per finished generation (one per choice; aborted ones are not counted).",
            OUTPUT_TOKENS_BUCKETS,
        )

        # prefill/decode disaggregation: the KV transfer (docs/disaggregation.md)
        kv_bytes = Counter(
            pm.KV_TRANSFER_BYTES.counter_base,
            "KV-transfer block bytes: sent by this prefill pod, received (pulled) by this decode pod.",
            ["model_name", "direction"],
            registry=r,
        )
        self.kv_bytes_sent = kv_bytes.labels(model_name, "sent")
        self.kv_bytes_received = kv_bytes.labels(model_name, "received")
        self.kv_transfer_seconds = histogram(
            pm.KV_TRANSFER_SECONDS.kvpilot,
            "Decode side: one KV pull, from the request to the prefill pod until its blocks are checked.",
            KV_TRANSFER_BUCKETS,
        )
        self._kv_failures = Counter(
            pm.KV_TRANSFER_FAILURES.counter_base,
            "KV transfers that failed, by reason (a pull's fault, or the prefill side's pin_capacity).",
            ["model_name", "reason"],
            registry=r,
        )
        self._kv_fallbacks = Counter(
            pm.KV_TRANSFER_FALLBACKS.counter_base,
            "Decode side: requests with kv_transfer_params whose prompt this pod recomputed, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in FAILURE_REASONS:  # every series from the start: rate() sees the first one
            self._kv_failures.labels(model_name, reason)
        for reason in FALLBACK_REASONS:
            self._kv_fallbacks.labels(model_name, reason)

    def kv_failure(self, reason: str) -> None:
        self._kv_failures.labels(self.model_name, reason).inc()

    def kv_fallback(self, reason: str) -> None:
        self._kv_fallbacks.labels(self.model_name, reason).inc()

    def attach_engine(self, stats: StatsSource | None) -> None:
        """Start (or stop, with None) reporting engine-side metrics from this `stats()` callable."""
        self._engine.source = stats

    def request_finished(
        self, finish_reason: str, output_tokens: int | None = None, prompt_tokens: int | None = None
    ) -> None:
        """A generation finished; with `output_tokens` (and `prompt_tokens`), its lengths go into the
        output-length (and prompt-length) histograms: the token mix of finished requests, which the
        autoscaler divides by the requests finished (the token counters run ahead of finishing)."""
        self._success.labels(self.model_name, finish_reason).inc()
        if output_tokens is not None:
            self.output_tokens.observe(output_tokens)
            if prompt_tokens is not None:
                self.prompt_lengths.observe(prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
