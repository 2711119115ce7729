"""Redundancy: a busy model is not served by one replica. Pure; policy.decide() calls it.

A fleet of one has no spare for anything: the pod's own failure or restart is an outage for a
startup, and traffic that turns heavier (the same request rate, longer prompts) queues on it for the
sync and the startup the fleet needs to grow. On the mix-shift battery (benchmarks/fleet_battery.py
--mix-shift 3: prompts three times longer from half time on) the minute of the shift cost one
replica fleets their whole hour's budget at once (seed 2: 100 of 187 requests late in that minute,
63 with two replicas; docs/autoscaler.md, "Seventh round"). A fixed fleet never has that minute.

The rule: while the forecast load needs at least `Behavior.redundancy_load` of one replica (at the
planner's per-replica rate, else the measured service rate), the fleet keeps at least
`Behavior.redundancy_replicas` (within maxReplicas). A model that sees a request now and then, or
none (scale to zero), stays at what the other signals ask. Once it applied, the floor is held for the
scale-down window (held_redundancy), as the window holds any recommendation: applied after the
window, a forecast hovering at the threshold started a replica one sync and stopped it the next
(the battery's seed 59 did 1 -> 2 -> 1 four times in its first half hour).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Redundancy:
    replicas: int
    rate: float
    per_replica: float
    # Set when the floor is held (held_redundancy): seconds since the load last needed it, and the
    # scale-down window that holds it.
    since_s: float | None = None
    window_s: float | None = None

    def text(self) -> str:
        if self.since_s is not None:
            return (
                f"redundancy: {self.replicas} replicas, held for the scale-down window ({self.window_s:g}s): "
                f"the load needed them {self.since_s:.0f}s ago ({self.rate:.2f}/s)"
            )
        return (
            f"redundancy: {self.replicas} replicas while serving {self.rate:.2f}/s "
            f"({self.rate / self.per_replica:.2f} of one replica's {self.per_replica:.2f}/s)"
        )


def redundancy(
    rate: float | None, per_replica: float | None, replicas: int, load: float, max_replicas: int
) -> Redundancy | None:
    """The fewest replicas a load of `rate` requests/s is served by (None: the rule does not apply:
    no rate or per-replica rate known, a load below `load` of one replica, or replicas <= 1)."""
    if rate is None or not per_replica or per_replica <= 0.0 or replicas <= 1:
        return None
    if rate < load * per_replica:
        return None
    return Redundancy(min(replicas, max(1, max_replicas)), rate, per_replica)


def held_redundancy(last: tuple[float, Redundancy] | None, now: float, window_s: float) -> Redundancy | None:
    """The floor that applied at `last` = (time, floor), held while `now` is within the scale-down
    window after it, as the window holds any recommendation: a load hovering at the threshold does
    not start a replica one sync and stop it the next (None: no floor within the window)."""
    if last is None:
        return None
    at, floor = last
    if now - at > window_s or at > now:
        return None
    return Redundancy(floor.replicas, floor.rate, floor.per_replica, since_s=now - at, window_s=window_s)
