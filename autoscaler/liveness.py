"""Liveness and readiness of `kvpilot autoscaler run` (served on --health-port by kvpilot.kube.health).

The control loop is alive while its turns keep finishing: a leader's after each sync, a standby's every
interval (a standby is healthy: it waits for the Lease). `loop_liveness` and `loop_readiness` decide
from timestamps alone, so they are pure and tested without a loop; `LoopHealth` is the SyncObserver
that keeps the timestamps and hands the probes to the health server.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvpilot.autoscaler.controller import SyncObserver
from kvpilot.kube.health import Check, Probe

# A turn may run long (many models, slow scrapes), so a loop is stale only after several intervals,
# and never sooner than this.
MIN_STALE_S = 60.0
STALE_INTERVALS = 3


def stale_after(interval_s: float) -> float:
    """Seconds without a finished turn after which the loop counts as stuck: max(3 x interval, 60 s)."""
    return max(STALE_INTERVALS * interval_s, MIN_STALE_S)


def loop_liveness(now: float, started: float, last_turn: float | None, interval_s: float) -> Probe:
    """Alive while the last turn finished (or, before the first, the loop started) less than
    `stale_after(interval_s)` ago. Times are seconds on one monotonic clock."""
    if last_turn is None:
        since, what = now - started, "since start, no turn finished"
    else:
        since, what = now - last_turn, "since the last turn"
    limit = stale_after(interval_s)
    if since < limit:
        return Probe(True, f"ok: {since:.1f}s {what} (stale after {limit:g}s)")
    return Probe(False, f"control loop stale: {since:.1f}s {what} (limit {limit:g}s)")


def loop_readiness(last_turn: float | None) -> Probe:
    """Ready once the first turn finished."""
    if last_turn is None:
        return Probe(False, "not ready: the first turn of the control loop has not finished")
    return Probe(True, "ok")


class LoopHealth(SyncObserver):
    """Keeps when the loop started and last finished a turn (monotonic); its probes read them."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.started = clock()
        self.last_turn: float | None = None
        self.leader = False

    def iteration_finished(self, leader: bool) -> None:
        self.last_turn = self.clock()  # one float store: safe to read from the health server's thread
        self.leader = leader

    def liveness(self) -> Probe:
        probe = loop_liveness(self.clock(), self.started, self.last_turn, self.interval_s)
        return Probe(probe.ok, f"{probe.detail} ({'leader' if self.leader else 'standby'})")

    def readiness(self) -> Probe:
        return loop_readiness(self.last_turn)

    def checks(self) -> dict[str, Check]:
        return {"/healthz": self.liveness, "/livez": self.liveness, "/readyz": self.readiness}


__all__ = ["LoopHealth", "loop_liveness", "loop_readiness", "stale_after"]
