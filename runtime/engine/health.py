"""Is the engine alive? The decision behind `/health`, `/ready` and `kvpilot_engine_stalled`.

The engine loop (runtime/engine/async_engine.py, `AsyncEngine`) records a monotonic heartbeat at every turn: each
step and each idle wait (at most 0.5 s apart while idle). A loop that has work (requests admitted
and unfinished, or a turn under way) and no heartbeat for `--engine-stall-timeout` seconds is stuck
(a pathological kernel, a deadlock, a grammar compiling for minutes): the pod should stop getting
work (`/ready` 503) and be restarted (`/health` 503, the liveness probe). Idle without work is healthy.
"""

from __future__ import annotations

from kvpilot.runtime.engine.protocol import HEALTHY, EngineHealth


def judge_progress(heartbeat_age: float, has_work: bool, stall_timeout: float) -> EngineHealth:
    """`heartbeat_age`: seconds since the engine loop last made progress; `has_work`: whether it has
    something to do; `stall_timeout`: seconds without progress, with work, that count as stuck
    (0 or less: never)."""
    if stall_timeout <= 0 or not has_work or heartbeat_age < stall_timeout:
        return HEALTHY
    return EngineHealth(
        False,
        "engine stalled",
        f"the engine loop has made no progress for {heartbeat_age:.0f}s while it has work "
        f"(--engine-stall-timeout {stall_timeout:g}s)",
    )


def engine_stopped(error: BaseException) -> EngineHealth:
    """The engine loop died on an unexpected error (every request already failed with it). The body
    names the error's type only: /health needs no key, and a message could quote request data."""
    return EngineHealth(
        False,
        "engine stopped",
        f"the engine loop stopped on an unexpected {type(error).__name__}; see the log",
    )
