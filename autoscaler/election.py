"""Leader election: only one autoscaler acts, however many `kvpilot autoscaler run` replicas there are.

The Lease mechanics are the shared platform layer's (`kvpilot.kube.lease.LeaderElector`: client-go semantics,
resourceVersion-guarded writes, release on a clean stop). The controller only asks "am I the leader
now?" before each sync and before writing each model, so it codes against the small `LeaderElector`
Protocol below; `LeaseElection` campaigns in a background thread.

Unlike the operator (which exits when it loses the Lease, as controller-runtime does), the autoscaler
keeps running and campaigns again: it holds no state worth a restart (the policy's history is in each
InferenceModel's status), and a standby that stops acting is all that correctness needs.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

LEASE_NAME = "kvpilot-autoscaler"


@runtime_checkable
class LeaderElector(Protocol):
    @property
    def is_leader(self) -> bool: ...


class AlwaysLeader:
    """For a single instance (tests, the simulator, --no-leader-elect)."""

    @property
    def is_leader(self) -> bool:
        return True


class LeaseElection:
    """Campaign for a Lease in a thread; `is_leader` while this process holds it.

    `elector` is a kvpilot.kube.lease.LeaderElector: anything with `is_leader` and a blocking
    `campaign(stop, lost)` (older versions: `run(stop, lost)`) that returns when `stop` is set, after
    releasing the Lease, or when leadership is lost, after setting `lost`.
    """

    def __init__(self, elector: Any) -> None:
        self.elector = elector
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def identity(self) -> str:
        return str(getattr(self.elector, "identity", ""))

    @property
    def is_leader(self) -> bool:
        return bool(self.elector.is_leader)

    def start(self) -> LeaseElection:
        self._thread = threading.Thread(target=self._campaign, name="autoscaler-leader-election", daemon=True)
        self._thread.start()
        return self

    def _campaign(self) -> None:
        while not self._stop.is_set():
            lost = threading.Event()
            campaign = getattr(self.elector, "campaign", None) or self.elector.run
            campaign(self._stop, lost)
            if lost.is_set() and not self._stop.is_set():
                log.warning("lost the %s Lease; standing by and campaigning again", LEASE_NAME)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop campaigning; the elector releases the Lease if held, so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)


def lease_election(
    api_client: Any,
    namespace: str,
    identity: str | None = None,
    lease_name: str = LEASE_NAME,
    lease_duration: float | None = None,
    renew_deadline: float | None = None,
    retry_period: float | None = None,
) -> LeaseElection:
    """A LeaseElection on `namespace/lease_name` through the Kubernetes API (not started).

    Timings left as None take the elector's defaults (15 s lease, 10 s renew deadline, 5 s retry).
    """
    from kvpilot.kube import lease

    elector = lease.LeaderElector(
        lease.KubeLeaseStore(api_client),
        namespace=namespace,
        name=lease_name,
        identity=identity,
        lease_duration=lease.LEASE_DURATION_S if lease_duration is None else lease_duration,
        renew_deadline=lease.RENEW_DEADLINE_S if renew_deadline is None else renew_deadline,
        retry_period=lease.RETRY_PERIOD_S if retry_period is None else retry_period,
    )
    return LeaseElection(elector)


def is_leader(elector: Any) -> bool:
    """Works with an `is_leader` property or method."""
    value = elector.is_leader
    return bool(value() if callable(value) else value)
