"""What the router measures of the requests it proxies: each request's SLO outcome, a window of recent
requests per model (quantiles and attainment for humans and dashboards), and per pod an exponentially
weighted moving average of TTFT, TPOT and errors that the routing policies read. Pure: the clock is an
argument, Prometheus export is the server's.

A request's outcome is api/slo.py's `judge`, with the model's `SloTargets` (from its InferenceModel,
else the router's flags). TTFT is from the request's arrival at the router to its first content
chunk going out to the client; TPOT is `request_tpot` over the output tokens delivered.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpilot.api.slo import OUTCOMES, Outcome, SloTargets, judge

CHARS_PER_TOKEN = 4  # the prompt-size estimate without the pod's usage (keys.py's footprint uses it too)
QUANTILES = (0.5, 0.9, 0.99)
MAX_WINDOW_SAMPLES = 100_000  # per model: a window of a busy model keeps its latest this many


def estimate_tokens(chars: int) -> int:
    return max(1, math.ceil(chars / CHARS_PER_TOKEN)) if chars > 0 else 0


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of ascending values; NaN when there are none."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


@dataclass(frozen=True)
class Sample:
    at: float
    outcome: Outcome
    ttft_s: float | None
    tpot_s: float | None


@dataclass(frozen=True)
class WindowStats:
    requests: int
    attainment: float  # met / judged, NaN with no request in the window
    ttft_s: dict[float, float]  # quantile -> seconds (NaN when nothing measured)
    tpot_s: dict[float, float]
    outcomes: dict[str, int]


@dataclass
class PodLatency:
    """EWMAs of one pod: TTFT and TPOT of the requests it served, and its error rate (0..1)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    error_rate: float = 0.0
    samples: int = 0


def ewma(old: float | None, value: float, alpha: float) -> float:
    return value if old is None else old + alpha * (value - old)


@dataclass
class _ModelWindow:
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=MAX_WINDOW_SAMPLES))


class SloMeter:
    """Per model: targets and a window of judged requests; per pod: latency EWMAs."""

    def __init__(
        self, default: SloTargets | None = None, window_s: float = 300.0, alpha: float = 0.2
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"the SLO window must be > 0 seconds, got {window_s}")
        if not 0 < alpha <= 1:
            raise ValueError(f"the EWMA weight must be in (0, 1], got {alpha}")
        self.default = default or SloTargets()
        self.window_s = window_s
        self.alpha = alpha
        self._targets: dict[str, SloTargets] = {}
        self._windows: dict[str, _ModelWindow] = {}
        self._pods: dict[tuple[str, str], PodLatency] = {}

    # -- targets -----------------------------------------------------------------------------

    def set_targets(self, model: str, targets: SloTargets | None) -> None:
        """The model's targets (None: the router's default)."""
        if targets is None:
            self._targets.pop(model, None)
        else:
            self._targets[model] = targets

    def targets(self, model: str) -> SloTargets:
        return self._targets.get(model, self.default)

    # -- requests ----------------------------------------------------------------------------

    def record(
        self, model: str, now: float, ttft_s: float | None, tpot_s: float | None, prompt_tokens: int
    ) -> Outcome:
        """Judge one request and add it to the model's window."""
        outcome = judge(self.targets(model), ttft_s, tpot_s, prompt_tokens)
        self._windows.setdefault(model, _ModelWindow()).samples.append(Sample(now, outcome, ttft_s, tpot_s))
        return outcome

    def record_whole(
        self, model: str, now: float, total_s: float, output_tokens: int, prompt_tokens: int
    ) -> Outcome:
        """Judge a request answered in one body (not streamed): the client's first token came with
        its last, so the one time there is, the total, is held to the whole budget, the TTFT target
        plus the TPOT target for each token after the first (a miss is reported as missed_ttft)."""
        tpot_budget = self.targets(model).tpot_s * max(0, output_tokens - 1)
        return self.record(model, now, max(0.0, total_s - tpot_budget), None, prompt_tokens)

    def observe_pod(self, model: str, pod: str, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request the pod served: its TTFT from the request's sending to the pod, its TPOT."""
        p = self._pods.setdefault((model, pod), PodLatency())
        if ttft_s is not None:
            p.ttft_s = ewma(p.ttft_s, ttft_s, self.alpha)
        if tpot_s is not None:
            p.tpot_s = ewma(p.tpot_s, tpot_s, self.alpha)
        p.error_rate = ewma(p.error_rate, 0.0, self.alpha)
        p.samples += 1

    def pod_error(self, model: str, pod: str) -> None:
        """An exchange with the pod failed (no answer, a 5xx, a broken stream) whatever became of
        the request (another pod may have served it): its error rate rises."""
        p = self._pods.setdefault((model, pod), PodLatency())
        p.error_rate = ewma(p.error_rate, 1.0, self.alpha)
        p.samples += 1

    def pod_latency(self, model: str, pod: str) -> PodLatency | None:
        return self._pods.get((model, pod))

    def pods(self, model: str) -> dict[str, PodLatency]:
        return {pod: p for (m, pod), p in self._pods.items() if m == model}

    def forget_pod(self, model: str, pod: str) -> None:
        self._pods.pop((model, pod), None)

    def forget_model(self, model: str) -> None:
        self._windows.pop(model, None)
        self._targets.pop(model, None)
        for key in [k for k in self._pods if k[0] == model]:
            del self._pods[key]

    # -- windows -----------------------------------------------------------------------------

    def window(self, model: str, now: float) -> WindowStats:
        """The model's requests judged within the last window_s seconds."""
        w = self._windows.get(model)
        samples = w.samples if w is not None else deque()
        while samples and samples[0].at < now - self.window_s:
            samples.popleft()
        counts: dict[str, int] = {o: 0 for o in OUTCOMES}
        for s in samples:
            counts[s.outcome] += 1
        ttft = sorted(s.ttft_s for s in samples if s.ttft_s is not None)
        tpot = sorted(s.tpot_s for s in samples if s.tpot_s is not None)
        n = len(samples)
        return WindowStats(
            requests=n,
            attainment=counts["met"] / n if n else math.nan,
            ttft_s={q: quantile(ttft, q) for q in QUANTILES},
            tpot_s={q: quantile(tpot, q) for q in QUANTILES},
            outcomes=counts,
        )

    def models(self) -> list[str]:
        return sorted(self._windows)
