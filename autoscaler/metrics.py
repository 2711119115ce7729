"""Prometheus metrics of `kvpilot autoscaler run` (served on --metrics-port).

`AutoscalerMetrics` is a SyncObserver: the controller reports what it does, this turns it into
series. The metrics live in the registry given (the CLI passes prometheus_client's default one, which
also carries the process and Python collectors; tests pass a fresh CollectorRegistry each).

Per-model gauges come from the leader only: a standby drops them, and a model that is deleted or loses
spec.autoscaling loses its series at the next sync, so `desired_replicas` never shows two answers or
a ghost. Their `namespace` label is the model's namespace (the chart's ServiceMonitor keeps it with
honorLabels, as for kube-state-metrics).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvpilot.autoscaler.controller import STAGE_EVENT, STAGE_LIST, STAGE_MODEL, SyncObserver, SyncResult

PREFIX = "kvpilot_autoscaler_"
SYNC_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STAGES = (STAGE_LIST, STAGE_MODEL, STAGE_EVENT)
DIRECTIONS = ("up", "down")


class AutoscalerMetrics(SyncObserver):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.syncs = Counter(
            f"{PREFIX}syncs_total", "Syncs of every autoscaled InferenceModel (leader only)", registry=r
        )
        self.sync_errors = Counter(
            f"{PREFIX}sync_errors_total",
            "Sync failures by stage: list (listing InferenceModels), model (one model's sync), "
            "event (a best-effort Event)",
            ["stage"],
            registry=r,
        )
        self.scale_writes = Counter(
            f"{PREFIX}scale_writes_total",
            "spec.replicas writes through the scale subresource, by direction",
            ["direction"],
            registry=r,
        )
        self.leader = Gauge(f"{PREFIX}leader", "1 while this replica holds the autoscaler Lease", registry=r)
        self.last_success = Gauge(
            f"{PREFIX}last_successful_sync_timestamp_seconds",
            "Unix time of the last sync that listed the models and synced every one without error "
            "(0: none yet)",
            registry=r,
        )
        self.sync_duration = Histogram(
            f"{PREFIX}sync_duration_seconds",
            "Time to sync every autoscaled InferenceModel once",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        labels = ["namespace", "model"]
        self.desired = Gauge(
            f"{PREFIX}desired_replicas", "Replicas the last decision asked for", labels, registry=r
        )
        self.current = Gauge(
            f"{PREFIX}current_replicas", "spec.replicas the last decision started from", labels, registry=r
        )
        self.reporting = Gauge(
            f"{PREFIX}reporting_replicas",
            "Ready replicas whose metrics the last decision had",
            labels,
            registry=r,
        )
        self.attainment = Gauge(
            f"{PREFIX}slo_attainment",
            "Share of the requests judged in the attainment window that met the SLO (status.autoscaler.slo; "
            "absent while unknown)",
            labels,
            registry=r,
        )
        self.attainment_target = Gauge(
            f"{PREFIX}slo_attainment_target", "spec.autoscaling.slo.attainmentTarget", labels, registry=r
        )
        self.capacity_factor = Gauge(
            f"{PREFIX}slo_capacity_factor",
            "The planner's per-replica capacity over the replica model's, within the measured bounds (1: the model as is)",
            labels,
            registry=r,
        )
        # Labelled series appear at 0 from the start, so rate() and absent() work before the first error.
        for stage in STAGES:
            self.sync_errors.labels(stage)
        for direction in DIRECTIONS:
            self.scale_writes.labels(direction)
        # Keys with per-model series. Only the controller's event loop calls the hooks, so no lock: the
        # scrape thread reads the gauges, which guard themselves.
        self._models: set[tuple[str, str]] = set()

    # -- SyncObserver ---------------------------------------------------------------------------------

    def iteration_finished(self, leader: bool) -> None:
        self.leader.set(1 if leader else 0)
        if not leader:
            self._forget(set(self._models))

    def sync_finished(self, duration_s: float, ok: bool, now: float) -> None:
        self.syncs.inc()
        self.sync_duration.observe(duration_s)
        if ok:
            self.last_success.set(now)

    def sync_error(self, stage: str) -> None:
        self.sync_errors.labels(stage).inc()

    def models_listed(self, models: Collection[tuple[str, str]]) -> None:
        self._forget(self._models - set(models))

    def model_synced(self, result: SyncResult) -> None:
        key = (result.namespace, result.name)
        self._models.add(key)
        self.desired.labels(*key).set(result.decision.desired)
        self.current.labels(*key).set(result.decision.current)
        self.reporting.labels(*key).set(result.decision.reporting)
        d = result.decision
        for gauge, value in (
            (self.attainment, d.attainment),
            (self.attainment_target, d.attainment_target),
            (self.capacity_factor, d.capacity_factor),
        ):
            if value is None:  # unknown is no series, never a number
                with contextlib.suppress(KeyError):
                    gauge.remove(*key)
            else:
                gauge.labels(*key).set(value)

    def scaled(self, namespace: str, name: str, from_replicas: int, to_replicas: int) -> None:
        if to_replicas != from_replicas:
            self.scale_writes.labels("up" if to_replicas > from_replicas else "down").inc()

    def _forget(self, keys: set[tuple[str, str]]) -> None:
        for key in keys:
            for gauge in (
                self.desired,
                self.current,
                self.reporting,
                self.attainment,
                self.attainment_target,
                self.capacity_factor,
            ):
                with contextlib.suppress(KeyError):
                    gauge.remove(*key)
            self._models.discard(key)


__all__ = ["PREFIX", "AutoscalerMetrics"]
