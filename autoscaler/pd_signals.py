"""What `kvpilot router` reports of a disaggregated model's two legs (docs/disaggregation.md, "Router"),
read from its /metrics page with the queue depth and the SLO counter (router_source.py):

- `kvpilot_router_pd_prefill_seconds` (histogram; its sum and count): the prefill leg of each
  disaggregated request, from its admission to the prefill pod's answer (waiting for a prefill pod
  included). The P/D policy's TTFT breakdown (pd_decode.py) takes the prefill stage from it.
- `kvpilot_router_pd_requests_total{path="no_prefill"}`: requests whose prompt was long enough for
  the prefill pool but went straight to a decode pod because no prefill pod was routable (none
  Ready, or all ejected). The prefill role's wake-up from zero while decode runs (pd_prefill.py).
  Short prompts (`path="direct"`) say nothing about the prefill role.
- `kvpilot_router_pd_queued{path="prefill"}` (a gauge): the requests held in the model's central queue
  whose prompt still needs a prefill pod. The router's queue is one per model in front of the decode
  pool, so `kvpilot_router_queue_depth` also holds short prompts that will skip the prefill pool:
  only these count toward the prefill role's backlog (all held requests toward decode's). A router
  without the gauge (older) reports None here, and the autoscaler counts its whole queue
  (router_source.py fills it in per router).

Counters are cumulative, summed over the router replicas; the policy differences them between syncs.
With no router URL, a Prometheus metric source reads the same series (`ROUTER_PD_QUERIES`, summed over
the router replicas it scrapes; sources.PrometheusSource.router_pd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.autoscaler.samples import MetricsParseError

ROUTER_PD_REQUESTS_METRIC = "kvpilot_router_pd_requests_total"
ROUTER_PD_PREFILL_METRIC = "kvpilot_router_pd_prefill_seconds"
ROUTER_PD_QUEUED_METRIC = "kvpilot_router_pd_queued"
NO_PREFILL_PATH = "no_prefill"
PREFILL_HELD_PATH = "prefill"

# RouterPdCounts' fields as PromQL over every router replica Prometheus scrapes ({model}: the served
# name), each by model_name; a field whose query finds no series is left at its default.
ROUTER_PD_QUERIES: dict[str, str] = {
    "prefill_seconds": "sum by (model_name) (" + ROUTER_PD_PREFILL_METRIC + '_sum{model_name="{model}"})',
    "prefill_legs": "sum by (model_name) (" + ROUTER_PD_PREFILL_METRIC + '_count{model_name="{model}"})',
    "no_prefill": "sum by (model_name) ("
    + ROUTER_PD_REQUESTS_METRIC
    + '{model_name="{model}",path="'
    + NO_PREFILL_PATH
    + '"})',
    "held_prefill": "sum by (model_name) ("
    + ROUTER_PD_QUEUED_METRIC
    + '{model_name="{model}",path="'
    + PREFILL_HELD_PATH
    + '"})',
}


@dataclass(frozen=True)
class RouterPdCounts:
    """The routers' P/D counters for one model (cumulative), and the requests they hold that need a
    prefill pod (a gauge; None: the router does not say)."""

    prefill_seconds: float = 0.0  # sum of the prefill legs' seconds
    prefill_legs: float = 0.0  # prefill legs that answered
    no_prefill: float = 0.0  # long prompts sent to a decode pod for lack of a prefill pod
    held_prefill: float | None = None  # held requests whose prompt still needs a prefill pod

    def __add__(self, other: RouterPdCounts) -> RouterPdCounts:
        held = (
            None
            if self.held_prefill is None and other.held_prefill is None
            else (self.held_prefill or 0.0) + (other.held_prefill or 0.0)
        )
        return RouterPdCounts(
            self.prefill_seconds + other.prefill_seconds,
            self.prefill_legs + other.prefill_legs,
            self.no_prefill + other.no_prefill,
            held,
        )


def parse_router_pd(text: str) -> dict[str, RouterPdCounts]:
    """{model_name: RouterPdCounts} from a router's /metrics page (only the models with P/D series)."""
    found: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                model = s.labels.get("model_name")
                if not model or not math.isfinite(s.value):
                    continue
                key = None
                if s.name == ROUTER_PD_PREFILL_METRIC + "_sum":
                    key = "prefill_seconds"
                elif s.name == ROUTER_PD_PREFILL_METRIC + "_count":
                    key = "prefill_legs"
                elif s.name == ROUTER_PD_REQUESTS_METRIC and s.labels.get("path") == NO_PREFILL_PATH:
                    key = "no_prefill"
                elif s.name == ROUTER_PD_QUEUED_METRIC and s.labels.get("path") == PREFILL_HELD_PATH:
                    key = "held_prefill"
                if key is not None:
                    by = found.setdefault(model, {})
                    by[key] = by.get(key, 0.0) + max(0.0, float(s.value))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"router: not Prometheus text format: {exc}") from exc
    return {m: RouterPdCounts(**by) for m, by in found.items()}


def router_pd_from_queries(found: dict[str, float]) -> RouterPdCounts | None:
    """RouterPdCounts from ROUTER_PD_QUERIES' answers ({field: value}, a field absent when its query
    found nothing); None when none found anything (no router reports P/D series for the model)."""
    if not found:
        return None
    counts = {k: max(0.0, v) for k, v in found.items() if k in ROUTER_PD_QUERIES and math.isfinite(v)}
    return RouterPdCounts(**counts)


def held_for_prefill(router_queue: int | None, router: RouterPdCounts | None) -> int:
    """Requests the routers hold that the prefill role must run: what they report needing a prefill
    pod, else (a router that does not say) every request they hold."""
    if router is not None and router.held_prefill is not None:
        return round(router.held_prefill)
    return router_queue or 0


__all__ = [
    "NO_PREFILL_PATH",
    "ROUTER_PD_QUERIES",
    "RouterPdCounts",
    "held_for_prefill",
    "parse_router_pd",
    "router_pd_from_queries",
]
