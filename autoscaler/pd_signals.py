"""What `kvpilot router` reports of a disaggregated model's two legs (docs/disaggregation.md, "Router"),
read from its /metrics page with the queue depth and the SLO counter (router_source.py):

- `kvpilot_router_pd_prefill_seconds` (histogram; its sum and count): the prefill leg of each
  disaggregated request, from its admission to the prefill pod's answer (waiting for a prefill pod
  included). The P/D policy's TTFT breakdown (pd_decode.py) takes the prefill stage from it.
- `kvpilot_router_pd_requests_total{path="no_prefill"}`: requests whose prompt was long enough for
  the prefill pool but went straight to a decode pod because no prefill pod was routable (none
  Ready, or all ejected). The prefill role's wake-up from zero while decode runs (pd_prefill.py).
  Short prompts (`path="direct"`) say nothing about the prefill role.

Counters are cumulative, summed over the router replicas; the policy differences them between syncs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.autoscaler.samples import MetricsParseError

ROUTER_PD_REQUESTS_METRIC = "kvpilot_router_pd_requests_total"
ROUTER_PD_PREFILL_METRIC = "kvpilot_router_pd_prefill_seconds"
NO_PREFILL_PATH = "no_prefill"


@dataclass(frozen=True)
class RouterPdCounts:
    """The routers' P/D counters for one model (cumulative)."""

    prefill_seconds: float = 0.0  # sum of the prefill legs' seconds
    prefill_legs: float = 0.0  # prefill legs that answered
    no_prefill: float = 0.0  # long prompts sent to a decode pod for lack of a prefill pod

    def __add__(self, other: RouterPdCounts) -> RouterPdCounts:
        return RouterPdCounts(
            self.prefill_seconds + other.prefill_seconds,
            self.prefill_legs + other.prefill_legs,
            self.no_prefill + other.no_prefill,
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
                if key is not None:
                    by = found.setdefault(model, {})
                    by[key] = by.get(key, 0.0) + max(0.0, float(s.value))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"router: not Prometheus text format: {exc}") from exc
    return {m: RouterPdCounts(**by) for m, by in found.items()}


__all__ = ["NO_PREFILL_PATH", "RouterPdCounts", "parse_router_pd"]
