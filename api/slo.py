"""The service-level objective of one request, judged the same way everywhere: by the router on every
request it proxies, by the autoscaler's simulator on every simulated request, and by anything that
reports attainment. One definition, pure, no I/O.

A request meets the SLO when

    TTFT <= ttft_s + ttft_prefill_factor x solo_prefill_s(prompt_tokens)
    TPOT <= tpot_s     (time per output token after the first: (finish - first token) / (out - 1))

`solo_prefill_s` is the prompt's own prefill time on an idle replica, a floor no fleet size can lower
(see autoscaler/slo.py for why the TTFT target grows with it). The judge cannot know it without a
model of the replica; it takes it as `prefill_s_per_token` (and an optional quadratic term for
attention over long prompts), which the autoscaler derives from the model's calibration and publishes
in `status.autoscaler`, so the router, which reads the InferenceModel, judges with the same numbers.
Without them (0), the TTFT target is the base `ttft_s` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpilot.api.models import DEFAULT_TPOT_S, DEFAULT_TTFT_PREFILL_FACTOR, DEFAULT_TTFT_S

Outcome = Literal["met", "missed_ttft", "missed_tpot", "failed"]
OUTCOMES: tuple[Outcome, ...] = ("met", "missed_ttft", "missed_tpot", "failed")


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float = DEFAULT_TTFT_S
    tpot_s: float = DEFAULT_TPOT_S
    ttft_prefill_factor: float = DEFAULT_TTFT_PREFILL_FACTOR
    prefill_s_per_token: float = 0.0
    prefill_s_per_token_sq: float = 0.0

    def __post_init__(self) -> None:
        if not self.ttft_s > 0 or not self.tpot_s > 0:
            raise ValueError("SLO: ttft_s and tpot_s must be > 0")
        if min(self.ttft_prefill_factor, self.prefill_s_per_token, self.prefill_s_per_token_sq) < 0:
            raise ValueError("SLO: ttft_prefill_factor and the prefill terms must be >= 0")

    def solo_prefill_s(self, prompt_tokens: int) -> float:
        n = max(0, prompt_tokens)
        return self.prefill_s_per_token * n + self.prefill_s_per_token_sq * n * n

    def ttft_target(self, prompt_tokens: int) -> float:
        return self.ttft_s + self.ttft_prefill_factor * self.solo_prefill_s(prompt_tokens)


def request_tpot(first_token_s: float, finish_s: float, output_tokens: int) -> float | None:
    """Mean time per output token after the first; None with fewer than two output tokens."""
    if output_tokens < 2:
        return None
    return max(0.0, finish_s - first_token_s) / (output_tokens - 1)


def judge(
    targets: SloTargets, ttft_s: float | None, tpot_s: float | None, prompt_tokens: int
) -> Outcome:
    """The request's outcome. No first token (rejected, failed, cut off) is `failed`: it misses.
    A TTFT miss is reported before a TPOT miss; a request with one output token has no TPOT."""
    if ttft_s is None:
        return "failed"
    if ttft_s > targets.ttft_target(prompt_tokens):
        return "missed_ttft"
    if tpot_s is not None and tpot_s > targets.tpot_s:
        return "missed_tpot"
    return "met"
