"""Leader election: LeaseElection driving the operator's LeaderElector over an in-memory Lease store."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from kvpilot.autoscaler.election import AlwaysLeader, LeaseElection, is_leader
from kvpilot.kube.lease import Conflict, LeaderElector, LeaseRecord


class MemoryLeaseStore:
    """A Lease with resourceVersion semantics: an update with a stale version is a Conflict."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.version = 0
        self.lock = threading.Lock()

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        with self.lock:
            return self.record

    def create(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        with self.lock:
            if self.record is not None:
                raise Conflict("exists")
            return self._write(record)

    def update(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        with self.lock:
            if self.record is None or record.resource_version != self.record.resource_version:
                raise Conflict("stale")
            return self._write(record)

    def _write(self, record: LeaseRecord) -> LeaseRecord:
        self.version += 1
        self.record = replace(record, resource_version=str(self.version))
        return self.record


def elector(store: Any, identity: str) -> LeaderElector:
    return LeaderElector(
        store,
        namespace="ns",
        name="kvpilot-autoscaler",
        identity=identity,
        lease_duration=1.0,  # whole seconds: a Lease stores leaseDurationSeconds as an integer
        renew_deadline=0.5,
        retry_period=0.05,
    )


def wait_for(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_one_leader_and_the_standby_takes_over_on_a_clean_stop():
    store = MemoryLeaseStore()
    a = LeaseElection(elector(store, "a")).start()
    wait_for(lambda: a.is_leader)
    b = LeaseElection(elector(store, "b")).start()
    time.sleep(0.3)
    assert a.is_leader and not b.is_leader
    a.stop()
    assert not a.is_leader
    # Released, not left to expire: the standby may take it at once.
    assert store.record is not None and store.record.holder in (None, "b")
    wait_for(lambda: b.is_leader)
    assert store.record.holder == "b"
    b.stop()
    assert store.record.holder is None


def test_a_lost_lease_stops_acting_and_campaigns_again():
    store = MemoryLeaseStore()
    a = LeaseElection(elector(store, "a")).start()
    wait_for(lambda: a.is_leader)
    # Someone else takes the Lease (say a's renewals were slow and it expired elsewhere).
    with store.lock:
        assert store.record is not None
        store.record = replace(store.record, holder="intruder", resource_version="x")
    wait_for(lambda: not a.is_leader)
    # The intruder never renews: once the Lease expires, a campaigns its way back.
    wait_for(lambda: a.is_leader, timeout=10.0)
    a.stop()


def test_is_leader_accepts_a_property_or_a_method():
    class Method:
        def is_leader(self) -> bool:
            return False

    assert is_leader(AlwaysLeader())
    assert not is_leader(Method())
