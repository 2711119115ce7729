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
none (scale to zero), stays at what the other signals ask.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Redundancy:
    replicas: int
    rate: float
    per_replica: float

    def text(self) -> str:
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
