"""Metric sources: where per-replica KV use and queue depth come from.

Two plug-ins share one interface (``MetricSource.collect``):
- PodScrapeSource: GET each Ready pod's /metrics (Prometheus text format) directly.
- PrometheusSource: instant queries against the Prometheus HTTP API, grouped by pod.

Both understand kvpilot's metric names and vLLM's. Each sample also carries the replica's finished
requests, when it exports them (the pod scrape: the counter; Prometheus: its rate over a minute), for
the policy's arrival-rate estimate. A pod that does not answer, answers with an error,
or lacks either metric is "not reporting": it gets no sample, and the policy holds its share.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.api import pod_metrics as pm
from kvpilot.autoscaler.attainment import SloCounts
from kvpilot.autoscaler.pd_signals import ROUTER_PD_QUERIES, RouterPdCounts, router_pd_from_queries
from kvpilot.autoscaler.router_source import (  # noqa: F401 (re-exported: the router's e2e reads queues)
    ROUTER_SLO_QUERY,
    RouterQueueSource,
    parse_router_queue,
)
from kvpilot.autoscaler.samples import MetricsParseError, MetricsSnapshot, ReplicaSample

log = logging.getLogger(__name__)
_Parsed = TypeVar("_Parsed")

# In order of preference: the first family a pod exports wins (the names: api/pod_metrics.py).
KV_METRICS = pm.KV_CACHE_USAGE.names
WAITING_METRICS = pm.REQUESTS_WAITING.names
RUNNING_METRICS = pm.REQUESTS_RUNNING.names
# Finished requests (a counter, one series per finish reason; summed).
COMPLETED_METRICS = pm.REQUEST_SUCCESS.names
# Prompt and generated tokens of the requests finished: the token mix the SLO planner sizes for
# (spec.autoscaling.slo) is their change over the change in finished requests. The length histograms'
# sums first (observed as a request finishes); the token counters where a pod has no such histogram
# (they count prompts as they arrive and tokens as they stream, so while the load changes they run
# ahead of the requests finished: a 6x surge on a saturated fleet read as prompts 6x longer).
PROMPT_TOKEN_METRICS = (*pm.REQUEST_PROMPT_TOKENS.sums, *pm.PROMPT_TOKENS.names)
GENERATION_TOKEN_METRICS = (*pm.REQUEST_GENERATION_TOKENS.sums, *pm.GENERATION_TOKENS.names)
# The generations the length histograms counted (finished; aborted ones are in neither): the token
# totals' denominator where a pod has them (ReplicaSample.finished_lengths_total).
FINISHED_LENGTHS_METRICS = pm.REQUEST_PROMPT_TOKENS.counts
# Generations admitted and their prompt tokens (the admitted-prompt histogram's count and sum): the
# planner's prompt mix where a pod exports them (kvpilot's runtime; ReplicaSample.admitted_total).
ADMITTED_COUNT_METRICS = pm.ADMITTED_PROMPT_TOKENS.counts
ADMITTED_SUM_METRICS = pm.ADMITTED_PROMPT_TOKENS.sums
# Output length per finished request (a histogram's cumulative buckets): the TPOT tail rule's
# output-length distribution (spec.autoscaling.slo.tpotTailBudget).
OUTPUT_TOKENS_BUCKET_METRICS = pm.REQUEST_GENERATION_TOKENS.buckets
# The pods' latency histograms: the measured-attainment fallback without a router (attainment.py).
TTFT_BUCKET_METRICS = pm.TIME_TO_FIRST_TOKEN.buckets
ITL_BUCKET_METRICS = pm.INTER_TOKEN_LATENCY.buckets
# A P/D decode pod's KV pulls (the decode role's link signal, autoscaler/pd_decode.py): the pull
# histogram's sum and count, and the bytes received (kvpilot's names only: vLLM has no equivalents).
KV_TRANSFER_SUM_METRICS = pm.KV_TRANSFER_SECONDS.sums
KV_TRANSFER_COUNT_METRICS = pm.KV_TRANSFER_SECONDS.counts
KV_TRANSFER_BYTES_METRICS = pm.KV_TRANSFER_BYTES.names
KV_RECEIVED = {"direction": "received"}

# Series are selected by namespace and the model's Ready pods ({pods}: a regex of their names), not by
# model_name: vLLM labels model_name with whatever --model / --served-model-name it was given (often
# the Hugging Face path), which need not be the InferenceModel's served name. The pods are the model's
# own (the controller lists them by the kvpilot.dev/model label), so their series are the model's.
_SELECT = '{namespace="{namespace}",pod=~"{pods}"}'
DEFAULT_KV_QUERY = f"max by (pod) ({pm.promql_any(KV_METRICS, _SELECT)})"
DEFAULT_QUEUE_QUERY = f"sum by (pod) ({pm.promql_any(WAITING_METRICS, _SELECT)})"
DEFAULT_RUNNING_QUERY = f"sum by (pod) ({pm.promql_any(RUNNING_METRICS, _SELECT)})"

# Completions per second over the last minute (the arrival-rate signal; see policy.measure_arrivals).
# Not in the CRD: a failed or empty answer only leaves the arrival rate out.
DEFAULT_COMPLETIONS_QUERY = f"sum by (pod) ({pm.promql_any(COMPLETED_METRICS, _SELECT, 'rate({}[1m])')})"
# The counters themselves (instant values, not rates): the SLO planner's token mix is the change in
# prompt / generated tokens of finished requests over the change in finished requests between two
# syncs, as from the pod scrape (arrivals.measure_token_mix); a pod's histogram sums (and their count,
# the finished requests without the aborted ones) where it has them (`or`: per pod, the first family it
# exports).
DEFAULT_COMPLETED_TOTAL_QUERY = f"sum by (pod) ({pm.promql_any(COMPLETED_METRICS, _SELECT)})"
DEFAULT_PROMPT_TOKENS_QUERY = f"sum by (pod) ({pm.promql_any(PROMPT_TOKEN_METRICS, _SELECT)})"
DEFAULT_GENERATION_TOKENS_QUERY = f"sum by (pod) ({pm.promql_any(GENERATION_TOKEN_METRICS, _SELECT)})"
DEFAULT_FINISHED_LENGTHS_QUERY = f"sum by (pod) ({pm.promql_any(FINISHED_LENGTHS_METRICS, _SELECT)})"
DEFAULT_ADMITTED_QUERY = f"sum by (pod) ({pm.promql_any(ADMITTED_COUNT_METRICS, _SELECT)})"
DEFAULT_ADMITTED_PROMPT_TOKENS_QUERY = f"sum by (pod) ({pm.promql_any(ADMITTED_SUM_METRICS, _SELECT)})"
DEFAULT_OUTPUT_TOKENS_BUCKETS_QUERY = (
    f"sum by (pod, le) ({pm.promql_any(OUTPUT_TOKENS_BUCKET_METRICS, _SELECT)})"
)
DEFAULT_TTFT_BUCKETS_QUERY = " or ".join(f"sum by (pod, le) ({m}{_SELECT})" for m in TTFT_BUCKET_METRICS)
DEFAULT_ITL_BUCKETS_QUERY = " or ".join(f"sum by (pod, le) ({m}{_SELECT})" for m in ITL_BUCKET_METRICS)
_RECEIVED_SELECT = '{namespace="{namespace}",pod=~"{pods}",direction="received"}'
DEFAULT_KV_TRANSFER_QUERIES = (
    f"sum by (pod) ({pm.promql_any(KV_TRANSFER_SUM_METRICS, _SELECT)})",
    f"sum by (pod) ({pm.promql_any(KV_TRANSFER_COUNT_METRICS, _SELECT)})",
    f"sum by (pod) ({pm.promql_any(KV_TRANSFER_BYTES_METRICS, _RECEIVED_SELECT)})",
)


@dataclass(frozen=True)
class PodTarget:
    """A Ready pod of the model, as the controller saw it."""

    name: str
    ip: str
    port: int = 8000


@dataclass(frozen=True)
class ModelRef:
    namespace: str
    name: str  # the InferenceModel's name
    served_name: str  # the model_name label value the runtime exports


class MetricSource(Protocol):
    async def collect(self, model: ModelRef, pods: Sequence[PodTarget]) -> MetricsSnapshot:
        """Samples for the pods that answered; len(pods) is the ready count."""
        ...

    async def close(self) -> None: ...


def _series(
    values: Mapping[str, list[tuple[dict[str, str], float]]],
    names: Iterable[str],
    model: str | None,
    having: Mapping[str, str] | None = None,
) -> list[float] | None:
    """Finite values of the first metric family present, restricted to the model's series if any match
    (and to the series with the labels `having`)."""
    for name in names:
        series = values.get(name)
        if having:
            series = [(lab, v) for lab, v in series or () if all(lab.get(k) == x for k, x in having.items())]
        if not series:
            continue
        matching = [v for labels, v in series if model is not None and labels.get("model_name") == model]
        # The pod was selected by the model's label already: a served name that differs from the
        # InferenceModel's (vLLM's HF path, say) still belongs to it.
        chosen = matching or [v for _, v in series]
        finite = [v for v in chosen if math.isfinite(v)]
        return finite or None
    return None


def _buckets(
    values: Mapping[str, list[tuple[dict[str, str], float]]], names: Iterable[str], model: str | None
) -> tuple[tuple[float, float], ...] | None:
    """Cumulative (le, count) of the first histogram present (its series summed bucket by bucket),
    restricted to the model's series if any match; None when absent."""
    for name in names:
        series = values.get(name)
        if not series:
            continue
        matching = [(lab, v) for lab, v in series if model is not None and lab.get("model_name") == model]
        total: dict[float, float] = {}
        for labels, v in matching or series:
            try:
                le = float(labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(le) and math.isfinite(v):
                total[le] = total.get(le, 0.0) + max(0.0, v)
        return tuple(sorted(total.items())) or None
    return None


def parse_metrics_text(text: str, pod: str, model: str | None = None) -> ReplicaSample | None:
    """A replica's sample from its /metrics page, or None when KV use or queue depth is missing.

    Raises MetricsParseError when the page is not Prometheus text format.
    """
    wanted = set(KV_METRICS) | set(WAITING_METRICS) | set(RUNNING_METRICS) | set(COMPLETED_METRICS)
    wanted |= set(PROMPT_TOKEN_METRICS) | set(GENERATION_TOKEN_METRICS) | set(OUTPUT_TOKENS_BUCKET_METRICS)
    wanted |= set(FINISHED_LENGTHS_METRICS) | set(ADMITTED_COUNT_METRICS) | set(ADMITTED_SUM_METRICS)
    wanted |= set(TTFT_BUCKET_METRICS) | set(ITL_BUCKET_METRICS)
    wanted |= set(KV_TRANSFER_SUM_METRICS) | set(KV_TRANSFER_COUNT_METRICS) | set(KV_TRANSFER_BYTES_METRICS)
    values: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in wanted:
                    values.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"{pod}: not Prometheus text format: {exc}") from exc
    kv = _series(values, KV_METRICS, model)
    waiting = _series(values, WAITING_METRICS, model)
    if kv is None or waiting is None:
        return None
    running = _series(values, RUNNING_METRICS, model) or [0.0]
    completed = _series(values, COMPLETED_METRICS, model)
    prompt_tokens = _series(values, PROMPT_TOKEN_METRICS, model)
    generation_tokens = _series(values, GENERATION_TOKEN_METRICS, model)
    finished_lengths = _series(values, FINISHED_LENGTHS_METRICS, model)
    admitted = _series(values, ADMITTED_COUNT_METRICS, model)
    admitted_prompt = _series(values, ADMITTED_SUM_METRICS, model)
    transfer_s = _series(values, KV_TRANSFER_SUM_METRICS, model)
    transfers = _series(values, KV_TRANSFER_COUNT_METRICS, model)
    received = _series(values, KV_TRANSFER_BYTES_METRICS, model, KV_RECEIVED)
    return ReplicaSample(
        pod=pod,
        # A ratio: several series (one per engine, say) are averaged; counts are summed.
        kv_cache_usage=min(1.0, max(0.0, sum(kv) / len(kv))),
        num_waiting=max(0, round(sum(waiting))),
        num_running=max(0, round(sum(running))),
        completed_total=None if completed is None else max(0.0, sum(completed)),
        prompt_tokens_total=None if prompt_tokens is None else max(0.0, sum(prompt_tokens)),
        generation_tokens_total=None if generation_tokens is None else max(0.0, sum(generation_tokens)),
        finished_lengths_total=None if finished_lengths is None else max(0.0, sum(finished_lengths)),
        admitted_total=None if admitted is None else max(0.0, sum(admitted)),
        admitted_prompt_tokens_total=None if admitted_prompt is None else max(0.0, sum(admitted_prompt)),
        output_tokens_buckets=_buckets(values, OUTPUT_TOKENS_BUCKET_METRICS, model),
        ttft_buckets=_buckets(values, TTFT_BUCKET_METRICS, model),
        itl_buckets=_buckets(values, ITL_BUCKET_METRICS, model),
        kv_transfer_seconds_total=None if transfer_s is None else max(0.0, sum(transfer_s)),
        kv_transfers_total=None if transfers is None else max(0.0, sum(transfers)),
        kv_transfer_bytes_total=None if received is None else max(0.0, sum(received)),
    )


class PodScrapeSource:
    """Scrape http://POD_IP:PORT/metrics of every Ready pod, concurrently, each with a timeout."""

    def __init__(
        self,
        timeout_s: float = 2.0,
        path: str = "/metrics",
        session: aiohttp.ClientSession | None = None,
        max_concurrency: int = 32,
    ) -> None:
        self.timeout_s = timeout_s
        self.path = path
        self._session = session
        self._own_session = session is None
        self._limit = asyncio.Semaphore(max_concurrency)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"User-Agent": "kvpilot-autoscaler"},
            )
        return self._session

    async def scrape(self, model: ModelRef, pod: PodTarget) -> ReplicaSample | None:
        url = f"http://{pod.ip}:{pod.port}{self.path}"
        try:
            async with (
                self._limit,
                self._get_session().get(url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp,
            ):
                if resp.status != 200:
                    log.info(
                        "%s/%s: %s answered %d; not reporting",
                        model.namespace,
                        pod.name,
                        url,
                        resp.status,
                    )
                    return None
                text = await resp.text()
            sample = parse_metrics_text(text, pod.name, model.served_name)
        except (aiohttp.ClientError, TimeoutError, MetricsParseError, UnicodeDecodeError) as exc:
            log.info(
                "%s/%s: scrape failed (%s); not reporting",
                model.namespace,
                pod.name,
                exc or type(exc).__name__,
            )
            return None
        if sample is None:
            log.info("%s/%s: no KV/queue metrics at %s; not reporting", model.namespace, pod.name, url)
        return sample

    async def collect(self, model: ModelRef, pods: Sequence[PodTarget]) -> MetricsSnapshot:
        results = await asyncio.gather(*(self.scrape(model, p) for p in pods))
        return MetricsSnapshot(ready_replicas=len(pods), samples=tuple(s for s in results if s is not None))

    async def close(self) -> None:
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None


_RE2_SPECIAL = re.compile(r"([\\.+*?()|\[\]{}^$])")


def pods_regex(pods: Iterable[str]) -> str:
    """An RE2 alternation matching exactly these pod names (for `pod=~"{pods}"`)."""
    return "|".join(_RE2_SPECIAL.sub(r"\\\1", p) for p in sorted(set(pods)))


def render_query(template: str, namespace: str, model: str, pods: Iterable[str] = ()) -> str:
    """Fill {namespace}, {model} and {pods} in a PromQL template (plain replacement: PromQL uses braces
    too). {pods} is a regex of the model's Ready pod names."""

    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"')

    return (
        template.replace("{namespace}", esc(namespace))
        .replace("{model}", esc(model))
        .replace("{pods}", esc(pods_regex(pods)))
    )


class PrometheusQueryError(RuntimeError):
    pass


def parse_query_response(body: Any, label: str = "pod") -> dict[str, float]:
    """Map pod -> value from an /api/v1/query vector response; NaN values are dropped."""
    if not isinstance(body, dict) or body.get("status") != "success":
        err = body.get("error") if isinstance(body, dict) else None
        raise PrometheusQueryError(f"query failed: {err or body!r}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusQueryError(f"expected an instant vector, got {data.get('resultType')!r}")
    out: dict[str, float] = {}
    for item in data.get("result") or []:
        pod = (item.get("metric") or {}).get(label)
        try:
            value = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if pod and math.isfinite(value):
            out[pod] = out.get(pod, 0.0) + value
    return out


def parse_bucket_response(body: Any, label: str = "pod") -> dict[str, tuple[tuple[float, float], ...]]:
    """Map pod -> cumulative (le, count) pairs from an /api/v1/query vector grouped by pod and le."""
    if not isinstance(body, dict) or body.get("status") != "success":
        err = body.get("error") if isinstance(body, dict) else None
        raise PrometheusQueryError(f"query failed: {err or body!r}")
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise PrometheusQueryError(f"expected an instant vector, got {data.get('resultType')!r}")
    out: dict[str, dict[float, float]] = {}
    for item in data.get("result") or []:
        metric = item.get("metric") or {}
        pod = metric.get(label)
        try:
            le = float(metric["le"])
            value = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if pod and not math.isnan(le) and math.isfinite(value):
            per = out.setdefault(pod, {})
            per[le] = per.get(le, 0.0) + max(0.0, value)
    return {pod: tuple(sorted(b.items())) for pod, b in out.items()}


class PrometheusSource:
    """Ask Prometheus for per-pod KV use and queue depth of the model's Ready pods.

    Series for pods that are not Ready (terminated pods linger for the 5-minute lookback) are ignored.
    """

    def __init__(
        self,
        url: str,
        kv_query: str | None = None,
        queue_query: str | None = None,
        running_query: str | None = DEFAULT_RUNNING_QUERY,
        completions_query: str | None = DEFAULT_COMPLETIONS_QUERY,
        token_counters: bool = True,
        timeout_s: float = 5.0,
        session: aiohttp.ClientSession | None = None,
        pod_label: str = "pod",
    ) -> None:
        self.url = url.rstrip("/")
        self.kv_query = kv_query or DEFAULT_KV_QUERY
        self.queue_query = queue_query or DEFAULT_QUEUE_QUERY
        self.running_query = running_query
        self.completions_query = completions_query
        # Completed-request and token counters for the SLO planner's token mix (optional queries: a
        # runtime without them leaves the planner off, as with the pod scrape).
        self.counter_queries: tuple[str, ...] = (
            (
                DEFAULT_COMPLETED_TOTAL_QUERY,
                DEFAULT_PROMPT_TOKENS_QUERY,
                DEFAULT_GENERATION_TOKENS_QUERY,
                DEFAULT_FINISHED_LENGTHS_QUERY,
                DEFAULT_ADMITTED_QUERY,
                DEFAULT_ADMITTED_PROMPT_TOKENS_QUERY,
            )
            if token_counters
            else ()
        )
        # The output-length histogram for the TPOT tail rule (optional, like the counters).
        self.buckets_query: str | None = DEFAULT_OUTPUT_TOKENS_BUCKETS_QUERY if token_counters else None
        # The latency histograms (the measured-attainment fallback) and the routers' SLO counter.
        self.latency_queries: tuple[str, ...] = (
            (DEFAULT_TTFT_BUCKETS_QUERY, DEFAULT_ITL_BUCKETS_QUERY) if token_counters else ()
        )
        self.router_slo_query: str | None = ROUTER_SLO_QUERY if token_counters else None
        # The routers' P/D counters of a disaggregated model (pd_signals.py; asked by its controller).
        self.router_pd_queries: Mapping[str, str] = ROUTER_PD_QUERIES if token_counters else {}
        # A P/D decode pod's KV pulls (optional: only decode pods export them).
        self.transfer_queries: tuple[str, ...] = DEFAULT_KV_TRANSFER_QUERIES if token_counters else ()
        self.timeout_s = timeout_s
        self.pod_label = pod_label
        self._session = session
        self._own_session = session is None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"User-Agent": "kvpilot-autoscaler"},
            )
        return self._session

    async def query(self, promql: str) -> dict[str, float]:
        return parse_query_response(await self._body(promql), self.pod_label)

    async def _body(self, promql: str) -> Any:
        async with self._get_session().get(
            f"{self.url}/api/v1/query",
            params={"query": promql},
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        ) as resp:
            try:
                body = await resp.json(content_type=None)
            except ValueError as exc:
                raise PrometheusQueryError(f"HTTP {resp.status}: not JSON") from exc
            if resp.status != 200 and not isinstance(body, dict):
                raise PrometheusQueryError(f"HTTP {resp.status}")
            return body

    async def _optional(
        self,
        model: ModelRef,
        template: str | None,
        pods: Sequence[PodTarget],
        parse: Callable[[Any, str], _Parsed],
        what: str,
    ) -> _Parsed | None:
        """A query whose failure only leaves its signal out (logged), never the whole snapshot."""
        if not template:
            return None
        promql = render_query(template, model.namespace, model.served_name, (p.name for p in pods))
        try:
            return parse(await self._body(promql), self.pod_label)
        except (aiohttp.ClientError, TimeoutError, PrometheusQueryError) as exc:
            log.info(
                "%s/%s: %s failed (%s); left out",
                model.namespace,
                model.name,
                what,
                exc or type(exc).__name__,
            )
            return None

    async def _optional_buckets(
        self, model: ModelRef, pods: Sequence[PodTarget], query: str | None = None
    ) -> dict[str, tuple[tuple[float, float], ...]]:
        """A histogram by pod, the output lengths by default ({} when the query is off or fails)."""
        got = await self._optional(
            model, query or self.buckets_query, pods, parse_bucket_response, "histogram query"
        )
        return got or {}

    async def router_slo(self, model: ModelRef) -> SloCounts | None:
        """The routers' kvpilot_router_slo_requests_total for the model, by outcome; None when no
        router reports it (or the query fails)."""
        got = await self._optional(
            model,
            self.router_slo_query,
            (),
            lambda body, _label: parse_query_response(body, "outcome"),
            "router SLO query",
        )
        return None if not got else SloCounts.from_outcomes(got)

    async def router_pd(self, model: ModelRef) -> RouterPdCounts | None:
        """The routers' P/D counters for a disaggregated model (summed over the router replicas
        Prometheus scrapes); None when no router reports them (or every query fails)."""
        fields = list(self.router_pd_queries)
        answers = await asyncio.gather(
            *(
                self._optional(
                    model,
                    self.router_pd_queries[f],
                    (),
                    lambda body, _label: parse_query_response(body, "model_name"),
                    "router P/D query",
                )
                for f in fields
            )
        )
        found = {f: got[model.served_name] for f, got in zip(fields, answers, strict=True) if got}
        return router_pd_from_queries(found)

    async def _optional_query(
        self, model: ModelRef, template: str | None, pods: Sequence[PodTarget]
    ) -> dict[str, float]:
        got = await self._optional(model, template, pods, parse_query_response, "optional Prometheus query")
        return got or {}

    async def collect(self, model: ModelRef, pods: Sequence[PodTarget]) -> MetricsSnapshot:
        queries = [self.kv_query, self.queue_query]
        if self.running_query:
            queries.append(self.running_query)
        if not pods:
            return MetricsSnapshot(ready_replicas=0)  # `pod=~""` would match series without a pod label
        names = [p.name for p in pods]
        rendered = [render_query(q, model.namespace, model.served_name, names) for q in queries]
        try:
            results, completions, counted, buckets, latency, router_slo = await asyncio.gather(
                asyncio.gather(*(self.query(q) for q in rendered)),
                self._optional_query(model, self.completions_query, pods),
                asyncio.gather(
                    *(
                        self._optional_query(model, q, pods)
                        for q in (*self.counter_queries, *self.transfer_queries)
                    )
                ),
                self._optional_buckets(model, pods),
                asyncio.gather(*(self._optional_buckets(model, pods, q) for q in self.latency_queries)),
                self.router_slo(model),
            )
        except (aiohttp.ClientError, TimeoutError, PrometheusQueryError) as exc:
            log.warning(
                "%s/%s: Prometheus at %s failed (%s); no replica reporting",
                model.namespace,
                model.name,
                self.url,
                exc or type(exc).__name__,
            )
            return MetricsSnapshot(ready_replicas=len(pods))
        kv, waiting = results[0], results[1]
        running = results[2] if len(results) > 2 else {}
        counters, pulls = counted[: len(self.counter_queries)], counted[len(self.counter_queries) :]
        done, prompt, generated, lengths, admitted, admitted_prompt = counters if counters else ({},) * 6
        ttft, itl = latency if latency else ({}, {})
        pull_s, pull_n, pull_bytes = pulls if pulls else ({}, {}, {})
        samples = []
        for p in pods:
            if p.name in kv and p.name in waiting:
                samples.append(
                    ReplicaSample(
                        pod=p.name,
                        kv_cache_usage=min(1.0, max(0.0, kv[p.name])),
                        num_waiting=max(0, round(waiting[p.name])),
                        num_running=max(0, round(running.get(p.name, 0.0))),
                        completion_rate=None if p.name not in completions else max(0.0, completions[p.name]),
                        completed_total=done.get(p.name),
                        prompt_tokens_total=prompt.get(p.name),
                        generation_tokens_total=generated.get(p.name),
                        finished_lengths_total=lengths.get(p.name),
                        admitted_total=admitted.get(p.name),
                        admitted_prompt_tokens_total=admitted_prompt.get(p.name),
                        output_tokens_buckets=buckets.get(p.name),
                        ttft_buckets=ttft.get(p.name),
                        itl_buckets=itl.get(p.name),
                        kv_transfer_seconds_total=pull_s.get(p.name),
                        kv_transfers_total=pull_n.get(p.name),
                        kv_transfer_bytes_total=pull_bytes.get(p.name),
                    )
                )
        return MetricsSnapshot(ready_replicas=len(pods), samples=tuple(samples), router_slo=router_slo)

    async def close(self) -> None:
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None
