"""The control loop: a thin I/O shell around the pure policy.

Every interval, for each InferenceModel with spec.autoscaling: list its Ready pods, collect samples
from the model's metric source, read the policy's history back from status, call policy.decide(),
then (scale-down only) mark the least-loaded pods cheapest to delete, write spec.replicas through the
scale subresource, record status.autoscaler and status.kvCacheUsage, and emit an Event.

What the loop does is reported to `SyncObserver`s (the Prometheus metrics of
kvpilot.autoscaler.metrics, the liveness state of kvpilot.autoscaler.liveness); the controller itself
keeps no counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpilot.api.models import MODEL_LABEL
from kvpilot.autoscaler.election import AlwaysLeader, is_leader
from kvpilot.autoscaler.kube import DELETION_COST, KubeApi, Obj
from kvpilot.autoscaler.policy import Decision, decide
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.sources import (
    MetricSource,
    ModelRef,
    PodScrapeSource,
    PodTarget,
    PrometheusSource,
    RouterQueueSource,
)
from kvpilot.autoscaler.spec import Behavior, ScalingTargets
from kvpilot.autoscaler.startup import measured_startup_s, pod_startup_seconds
from kvpilot.autoscaler.state import decision_to_status, history_from_status, kv_cache_usage_text

log = logging.getLogger(__name__)

RUNTIME_PORT = 8000
DEFAULT_MAX_NUM_SEQS = 64  # kvpilot.runtime.config.EngineConfig.max_num_seqs
# A ready pod that did not report is never cheap to delete: it is not known to be idle.
UNKNOWN_LOAD_COST = 1_000_000
# Where a sync failed (SyncObserver.sync_error): listing the InferenceModels, one model's sync (its
# pods, metrics, scale or status write), or the best-effort Event after a decision.
STAGE_LIST = "list"
STAGE_MODEL = "model"
STAGE_EVENT = "event"


@dataclass(frozen=True)
class ControllerConfig:
    namespace: str | None = None  # None: all namespaces
    interval_s: float = 15.0
    default_metrics_source: str = "pods"  # used when a spec leaves metricsSource out
    prometheus_url: str | None = None  # used when spec.autoscaling.prometheus.url is not set
    behavior: Behavior = field(default_factory=Behavior)
    pod_port: int = RUNTIME_PORT
    scrape_timeout_s: float = 2.0
    max_concurrent_models: int = 8
    identity: str | None = None  # written as status.autoscaler.decidedBy (which replica decided)
    # `kvpilot router` replicas' base URLs: their queue depth for a model is part of its queue signal,
    # and the one signal that wakes a model scaled to zero.
    router_urls: tuple[str, ...] = ()
    # Between syncs, read the routers' queues this often and sync at once when one grew.
    router_poll_s: float = 1.0


@dataclass(frozen=True)
class SyncResult:
    namespace: str
    name: str
    decision: Decision
    scaled: bool
    event_reason: str | None


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def runtime_max_num_seqs(spec: Mapping[str, Any], status: Mapping[str, Any]) -> int:
    """The batch slots each replica runs with: spec.runtime.maxNumSeqs (the runtime's default when
    unset), capped by what the operator's OOM adaptation lowered it to."""
    value = (spec.get("runtime") or {}).get("maxNumSeqs") or DEFAULT_MAX_NUM_SEQS
    override = ((status.get("oomAdaptation") or {}).get("overrides") or {}).get("maxNumSeqs")
    if isinstance(override, int) and override > 0:
        value = min(int(value), override)
    return max(1, int(value))


def condition_is_true(status: Mapping[str, Any], cond_type: str) -> bool:
    return any(
        c.get("type") == cond_type and c.get("status") == "True" for c in status.get("conditions") or []
    )


def deletion_costs(pods: Sequence[str], snapshot: MetricsSnapshot) -> dict[str, int]:
    """pod -> pod-deletion-cost: the least loaded pod gets the lowest cost, so the ReplicaSet deletes
    it first. Load is in-flight requests plus KV use; pods that did not report get the highest cost."""
    by_pod = {s.pod: s for s in snapshot.samples}
    costs: dict[str, int] = {}
    for name in pods:
        sample = by_pod.get(name)
        costs[name] = (
            UNKNOWN_LOAD_COST if sample is None else min(UNKNOWN_LOAD_COST - 1, round(sample.load * 100))
        )
    return costs


def autoscaled_key(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of an InferenceModel with spec.autoscaling, else None."""
    meta = obj.get("metadata") or {}
    if not (obj.get("spec") or {}).get("autoscaling") or not meta.get("namespace") or not meta.get("name"):
        return None
    return str(meta["namespace"]), str(meta["name"])


def hold_kind(decision: Decision) -> str | None:
    """Why a hold is worth an Event (None: a plain, uneventful hold)."""
    if decision.desired != decision.current:
        return None
    if decision.ready and decision.reporting == 0:
        return "no-metrics"
    if decision.reporting < decision.ready:
        return "not-reporting"
    if any(n.startswith("ScalingLimited") for n in decision.notes):
        return "scaling-limited"
    if decision.recommendation != decision.current:
        return "stabilization"
    return None


class SyncObserver:
    """Hooks the control loop calls as it works. Every method here does nothing: subclass and override
    what you need. Hooks run on the event loop, so they must be quick; one that raises is logged and
    otherwise ignored (observing must never stop scaling)."""

    def iteration_finished(self, leader: bool) -> None:
        """One turn of `run()` ended (a leader's after its sync, a standby's at once); `leader`: now."""

    def sync_finished(self, duration_s: float, ok: bool, now: float) -> None:
        """A sync (`sync_all`) ended; ok: the models were listed and every model synced without error.
        `now` is the controller's clock (wall time)."""

    def sync_error(self, stage: str) -> None:
        """Something failed at `stage` (STAGE_LIST, STAGE_MODEL or STAGE_EVENT)."""

    def models_listed(self, models: Collection[tuple[str, str]]) -> None:
        """(namespace, name) of every InferenceModel with spec.autoscaling that this sync found."""

    def model_synced(self, result: SyncResult) -> None:
        """A model's decision was made and written."""

    def scaled(self, namespace: str, name: str, from_replicas: int, to_replicas: int) -> None:
        """spec.replicas was written through the scale subresource."""


class ScalingController:
    def __init__(
        self,
        api: KubeApi,
        config: ControllerConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        elector: Any = None,
        pod_source: MetricSource | None = None,
        prometheus_factory: Callable[[str, str | None, str | None], MetricSource] | None = None,
        observers: Sequence[SyncObserver] = (),
    ) -> None:
        self.api = api
        self.config = config or ControllerConfig()
        self.clock = clock
        self.elector = elector or AlwaysLeader()
        self._pod_source = pod_source
        self._prometheus_factory = prometheus_factory or (
            lambda url, kvq, qq: PrometheusSource(url, kv_query=kvq, queue_query=qq)
        )
        self._prometheus: dict[tuple[str, str | None, str | None], MetricSource] = {}
        self.observers = tuple(observers)
        self._router = (
            RouterQueueSource(self.config.router_urls, self.config.scrape_timeout_s)
            if self.config.router_urls
            else None
        )

    def _notify(self, hook: str, *args: Any) -> None:
        for observer in self.observers:
            try:
                getattr(observer, hook)(*args)
            except Exception:
                log.exception("observer %s.%s failed", type(observer).__name__, hook)

    def _source_for(self, autoscaling: Mapping[str, Any]) -> MetricSource:
        kind = autoscaling.get("metricsSource") or self.config.default_metrics_source
        if kind == "prometheus":
            prom = autoscaling.get("prometheus") or {}
            url = prom.get("url") or self.config.prometheus_url
            if not url:
                raise ValueError(
                    "metricsSource is prometheus but neither spec.autoscaling.prometheus.url "
                    "nor --prometheus-url is set"
                )
            key = (url, prom.get("kvQuery"), prom.get("queueQuery"))
            if key not in self._prometheus:
                self._prometheus[key] = self._prometheus_factory(*key)
            return self._prometheus[key]
        if self._pod_source is None:
            self._pod_source = PodScrapeSource(timeout_s=self.config.scrape_timeout_s)
        return self._pod_source

    async def sync_model(self, obj: Obj) -> SyncResult | None:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        autoscaling = spec.get("autoscaling")
        if not autoscaling:
            return None
        ns, name = meta["namespace"], meta["name"]
        if not is_leader(self.elector):  # lost the Lease during this sync: a standby writes nothing
            return None
        if spec.get("disaggregation"):  # two roles, one decision (pd_controller.py)
            from kvpilot.autoscaler.pd_controller import sync_disaggregated

            return await sync_disaggregated(self, obj)
        max_seqs = runtime_max_num_seqs(spec, status)
        try:
            targets = ScalingTargets.from_spec(autoscaling, self.config.behavior, max_num_seqs=max_seqs)
        except ValueError as exc:
            if not autoscaling.get("slo"):
                raise
            # A calibration this autoscaler does not know: scale on the KV and queue rules alone.
            log.warning("%s/%s: spec.autoscaling.slo ignored: %s", ns, name, exc)
            without = {k: v for k, v in autoscaling.items() if k != "slo"}
            targets = ScalingTargets.from_spec(without, self.config.behavior, max_num_seqs=max_seqs)
        replicas = spec.get("replicas")
        # The operator renders minReplicas while spec.replicas is unset; that is the current size.
        current = int(replicas) if replicas is not None else targets.min_replicas

        pods = await self.api.list_pods(ns, f"{MODEL_LABEL}={name}")
        ready = [p for p in pods if pod_is_ready(p)]
        pod_targets = [
            PodTarget(p["metadata"]["name"], p["status"]["podIP"], self.config.pod_port) for p in ready
        ]
        served = (spec.get("model") or {}).get("servedName") or name
        snapshot = await self._source_for(autoscaling).collect(ModelRef(ns, name, served), pod_targets)
        snapshot = replace(
            snapshot,
            scaling_limited=condition_is_true(status, "ScalingLimited"),
            startup_s=measured_startup_s(pod_startup_seconds(ready)),
        )
        if self._router is not None:
            snapshot = replace(snapshot, router_queue=await self._router.queue_depth(served))
            slo = (self._router.last_slo or {}).get(served)
            if slo is not None:  # read from every router pod; preferred to a Prometheus answer
                snapshot = replace(snapshot, router_slo=slo)

        previous = status.get("autoscaler") or {}
        now = self.clock()
        decision = decide(current, snapshot, targets, history_from_status(previous), now)

        event_reason: str | None = None
        if not is_leader(self.elector):  # the metric queries took long enough to lose the Lease
            return None
        if decision.desired < current:
            await self._mark_deletion_costs(ns, ready, snapshot)
        if decision.desired != current:
            await self.api.patch_scale(ns, name, decision.desired)
            self._notify("scaled", ns, name, current, decision.desired)
            event_reason = "ScaledUp" if decision.desired > current else "ScaledDown"
            log.info("%s/%s: %d -> %d: %s", ns, name, current, decision.desired, decision.reason)
        kind = hold_kind(decision)
        if kind and previous.get("heldKind") != kind:
            event_reason = "ScalingHeld"
        block = decision_to_status(decision, now, previous, self.config.identity or None, kind or None)
        await self.api.patch_status(
            ns, name, {"autoscaler": block, "kvCacheUsage": kv_cache_usage_text(decision.avg_kv_cache_usage)}
        )
        if event_reason:
            etype = "Warning" if kind in ("no-metrics", "not-reporting", "scaling-limited") else "Normal"
            try:
                await self.api.create_event(ns, obj, event_reason, decision.reason, etype)
            except Exception as exc:  # an Event is best effort; the scale already happened
                self._notify("sync_error", STAGE_EVENT)
                log.warning("%s/%s: could not record Event %s: %s", ns, name, event_reason, exc)
        return SyncResult(ns, name, decision, decision.desired != current, event_reason)

    async def _mark_deletion_costs(self, ns: str, ready: Sequence[Obj], snapshot: MetricsSnapshot) -> None:
        costs = deletion_costs([p["metadata"]["name"] for p in ready], snapshot)
        for pod in ready:
            pod_name = pod["metadata"]["name"]
            value = str(costs[pod_name])
            if (pod["metadata"].get("annotations") or {}).get(DELETION_COST) != value:
                await self.api.annotate_pod(ns, pod_name, {DELETION_COST: value})

    async def sync_all(self) -> list[SyncResult]:
        started = time.monotonic()
        try:
            models = await self.api.list_models(self.config.namespace)
        except Exception:
            self._notify("sync_error", STAGE_LIST)
            self._notify("sync_finished", time.monotonic() - started, False, self.clock())
            raise
        self._notify("models_listed", {key for m in models if (key := autoscaled_key(m)) is not None})
        limit = asyncio.Semaphore(self.config.max_concurrent_models)
        failed: list[str] = []

        async def one(obj: Obj) -> SyncResult | None:
            async with limit:
                try:
                    return await self.sync_model(obj)
                except Exception:
                    meta = obj.get("metadata") or {}
                    failed.append(f"{meta.get('namespace')}/{meta.get('name')}")
                    self._notify("sync_error", STAGE_MODEL)
                    log.exception("%s/%s: sync failed", meta.get("namespace"), meta.get("name"))
                    return None

        results = [r for r in await asyncio.gather(*(one(m) for m in models)) if r is not None]
        for r in results:
            self._notify("model_synced", r)
        self._notify("sync_finished", time.monotonic() - started, not failed, self.clock())
        return results

    async def run(self, stop: asyncio.Event) -> None:
        """Sync every interval while leader, until stop is set. A standby's loop still turns (and
        reports each turn to the observers: the liveness probe needs to see it alive)."""
        while not stop.is_set():
            started = time.monotonic()
            if is_leader(self.elector):
                try:
                    await self.sync_all()
                except Exception:
                    log.exception("listing InferenceModels failed; retrying next interval")
            self._notify("iteration_finished", is_leader(self.elector))
            await self._wait_next(stop, started + self.config.interval_s)

    async def _wait_next(self, stop: asyncio.Event, next_sync: float) -> None:
        """Until the next sync is due, or earlier when a router's queue for some model grew (a burst,
        or the first request for a model at zero replicas): that is decided within router_poll_s."""
        # the queues as the sync read them: a request held since then counts as growth
        last = self._router.last if self._router is not None else None
        while not stop.is_set():
            remaining = next_sync - time.monotonic()
            if remaining <= 0:
                return
            step = remaining if self._router is None else min(remaining, self.config.router_poll_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=step)
            if self._router is None or stop.is_set() or not is_leader(self.elector):
                continue
            depths = await self._router.depths()
            if depths is None:
                continue
            grew = sorted(m for m, d in depths.items() if d > (last or {}).get(m, 0))
            if grew and last is not None:
                log.info("router queue grew for %s: syncing now", ", ".join(grew))
                return
            last = depths

    async def close(self) -> None:
        sources = [*self._prometheus.values(), *([self._pod_source] if self._pod_source else [])]
        for s in sources:
            await s.close()
        if self._router is not None:
            await self._router.close()
