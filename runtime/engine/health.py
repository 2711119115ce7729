"""Is the engine alive? The decision behind `/health`, `/ready` and `kvpilot_engine_stalled`.

The engine loop (runtime/engine/async_engine.py, `AsyncEngine`) records a monotonic heartbeat at every turn: each
step and each idle wait (at most 0.5 s apart while idle). A loop that has work (requests admitted
and unfinished, or a turn under way) and no heartbeat for `--engine-stall-timeout` seconds is stuck
(a pathological kernel, a deadlock, a grammar compiling for minutes): the pod should stop getting
work (`/ready` 503) and be restarted (`/health` 503, the liveness probe). Idle without work is healthy.

One step's length follows its work: a chunk of 2,048 prompt tokens takes ~10 s on one CPU thread for a
135M model, minutes for an 8B one, and longer when the node's CPUs are shared. So the timeout is a
floor: a step under way may take STALL_SLACK times what the engine's measured pace (`StepPace`:
seconds per scheduled token of its recent steps) gives its tokens, when that is longer. A step far
slower than the engine's own recent steps, or no step at all for the timeout, is a stall.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.runtime.engine.protocol import HEALTHY, EngineHealth

STALL_SLACK = 4.0  # a step may take this many times what the measured pace gives its tokens
PACE_WEIGHT = 0.2  # a new step's weight in the pace's averages


@dataclass
class StepPace:
    """The engine's measured pace: seconds per scheduled token over its recent steps, the ratio of
    two exponentially weighted averages (the steps' seconds, their tokens), so a step weighs by its
    size; unknown before the first step. Written by the engine thread, read by the watchdog."""

    seconds: float = 0.0
    tokens: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds < 0:
            return
        if self.tokens <= 0:
            self.seconds, self.tokens = seconds, float(tokens)
            return
        self.seconds += PACE_WEIGHT * (seconds - self.seconds)
        self.tokens += PACE_WEIGHT * (tokens - self.tokens)

    def expected_s(self, tokens: int) -> float | None:
        """What a step of `tokens` should take at this pace (None: no step measured yet)."""
        if self.tokens <= 0 or tokens < 1:
            return None
        return tokens * self.seconds / self.tokens


def stall_limit_s(stall_timeout: float, expected_step_s: float | None) -> float:
    """Seconds without progress that count as stuck: the timeout, or STALL_SLACK times the step
    under way's expected length when longer."""
    if expected_step_s is None:
        return stall_timeout
    return max(stall_timeout, STALL_SLACK * expected_step_s)


def judge_progress(
    heartbeat_age: float, has_work: bool, stall_timeout: float, expected_step_s: float | None = None
) -> EngineHealth:
    """`heartbeat_age`: seconds since the engine loop last made progress; `has_work`: whether it has
    something to do; `stall_timeout`: seconds without progress, with work, that count as stuck
    (0 or less: never); `expected_step_s`: what the step under way should take at the engine's
    measured pace (None: no step under way, or no pace yet)."""
    limit = stall_limit_s(stall_timeout, expected_step_s)
    if stall_timeout <= 0 or not has_work or heartbeat_age < limit:
        return HEALTHY
    step = "" if limit == stall_timeout else f"; the step under way should take ~{expected_step_s:.0f}s"
    return EngineHealth(
        False,
        "engine stalled",
        f"the engine loop has made no progress for {heartbeat_age:.0f}s while it has work "
        f"(--engine-stall-timeout {stall_timeout:g}s{step})",
    )


def engine_stopped(error: BaseException) -> EngineHealth:
    """The engine loop died on an unexpected error (every request already failed with it). The body
    names the error's type only: /health needs no key, and a message could quote request data."""
    return EngineHealth(
        False,
        "engine stopped",
        f"the engine loop stopped on an unexpected {type(error).__name__}; see the log",
    )
