"""Prometheus metrics of the operator itself (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("kvpilot_operator_reconcile_total", "InferenceModel reconciles by result", ["result"])
RECONCILE_SECONDS = Histogram(
    "kvpilot_operator_reconcile_duration_seconds",
    "Time to reconcile one InferenceModel",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
APPLIES = Counter(
    "kvpilot_operator_child_apply_total",
    "Children applied or skipped (already as desired)",
    ["kind", "action"],
)
STATUS_PATCHES = Counter("kvpilot_operator_status_patch_total", "Status patches written")
EVENTS = Counter("kvpilot_operator_events_total", "Kubernetes Events posted", ["type", "reason"])
OOM_ADAPTATIONS = Counter("kvpilot_operator_oom_adaptations_total", "Runtime configs adapted after an OOM")
QUEUE_DEPTH = Gauge("kvpilot_operator_queue_depth", "InferenceModels waiting to be reconciled")
LEADER = Gauge("kvpilot_operator_leader", "1 while this replica holds the leader lease")
