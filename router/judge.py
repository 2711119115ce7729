"""The router's SLO book (docs/router.md, "Measured SLO"): each request judged against its model's
targets, the pods' latency averages kept where the routing policies read them, and the window gauges
exported at each scrape of /metrics. The figures live in measure.SloMeter; this puts them to use."""

from __future__ import annotations

import time
from collections.abc import Iterable

from kvpilot.api.slo import request_tpot
from kvpilot.router.call import Call
from kvpilot.router.measure import QUANTILES, SloMeter, estimate_tokens
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.pool import ModelPool, Pod


class SloBook:
    def __init__(self, meter: SloMeter, metrics: RouterMetrics) -> None:
        self.meter = meter
        self.metrics = metrics

    def judge(self, call: Call, status: int | None) -> None:
        """Judge the request against its model's SLO (api/slo.py). An answer in the 4xx other than
        429 is the client's error, not judged; none (the client left before an answer), a 429 or a
        5xx is `failed`; a stream that ended with an error event too."""
        if status is not None and 400 <= status < 500 and status != 429:
            return
        now, tally, model = time.monotonic(), call.tally, call.model
        prompt = tally.prompt_tokens
        if prompt is None:
            prompt = estimate_tokens(call.prompt_chars)
        if status is None or status >= 400:
            outcome = self.meter.record(model, now, None, None, prompt)
        elif not call.stream:
            total = (call.answered_at or now) - call.started
            outcome = self.meter.record_whole(model, now, total, tally.output_tokens, prompt)
        else:
            first = tally.first_content_s
            ttft = None if first is None else first - call.started
            tpot = (
                None
                if first is None
                else request_tpot(first, tally.last_content_s or first, tally.output_tokens)
            )
            if ttft is not None:
                self.metrics.ttft.labels(model).observe(ttft)
            if tpot is not None:
                self.metrics.tpot.labels(model).observe(tpot)
            outcome = self.meter.record(model, now, None if tally.error else ttft, tpot, prompt)
        self.metrics.slo_requests.labels(model, outcome).inc()

    def observe(self, pool: ModelPool, pod: Pod, ttft_s: float | None, tpot_s: float | None) -> None:
        self.meter.observe_pod(pool.model, pod.name, ttft_s, tpot_s)
        self.sync_latency(pool, pod)

    def sync_latency(self, pool: ModelPool, pod: Pod) -> None:
        """The pod's latency averages where the routing policies read them (its PodView)."""
        lat = self.meter.pod_latency(pool.model, pod.name)
        if lat is not None:
            pod.ttft_s, pod.tpot_s, pod.error_rate = lat.ttft_s, lat.tpot_s, lat.error_rate

    def export(self, now: float, pools: Iterable[ModelPool]) -> None:
        """The window gauges and the pods' averages, as of now (at each scrape of /metrics)."""
        m = self.metrics
        for model in self.meter.models():
            w = self.meter.window(model, now)
            m.slo_attainment.labels(model).set(w.attainment)
            m.slo_window_requests.labels(model).set(w.requests)
            for q in QUANTILES:
                m.ttft_window.labels(model, str(q)).set(w.ttft_s[q])
                m.tpot_window.labels(model, str(q)).set(w.tpot_s[q])
        for pool in pools:  # a disaggregated model's decode pool and its prefill pool
            model = pool.model
            for name, lat in self.meter.pods(model).items():
                if name not in pool.pods:
                    continue
                m.pod_errors.labels(model, name).set(lat.error_rate)
                if lat.ttft_s is not None:
                    m.pod_ttft.labels(model, name).set(lat.ttft_s)
                if lat.tpot_s is not None:
                    m.pod_tpot.labels(model, name).set(lat.tpot_s)
