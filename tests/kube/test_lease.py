"""Lease leader election with an in-memory Lease store and fake clocks."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from kvpilot.kube.lease import (
    Action,
    Conflict,
    LeaderElector,
    LeaseRecord,
    decide,
    default_identity,
    run_as_leader,
)


class MemoryLeases:
    """A LeaseStore with resourceVersion checks, like the API server."""

    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.rv = 0
        self.fail = False

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        if self.fail:
            raise ConnectionError("api down")
        return self.record

    def create(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        if self.record is not None:
            raise Conflict("exists")
        return self._write(record)

    def update(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        if self.fail:
            raise ConnectionError("api down")
        assert self.record is not None
        if record.resource_version != self.record.resource_version:
            raise Conflict("stale")
        return self._write(record)

    def _write(self, record: LeaseRecord) -> LeaseRecord:
        self.rv += 1
        self.record = replace(record, resource_version=str(self.rv))
        return self.record


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self.t)


def elector(store: MemoryLeases, clock: Clock, identity: str) -> LeaderElector:
    return LeaderElector(
        store, namespace="ns", name="lease", identity=identity, monotonic=clock.mono, wallclock=clock.wall
    )


@pytest.mark.parametrize(
    ("record", "observed_at", "now", "action"),
    [
        (None, 0, 0, Action.CREATE),
        (LeaseRecord("me"), 0, 100, Action.RENEW),
        (LeaseRecord(None), 0, 0, Action.ACQUIRE),
        (LeaseRecord("other", 15), 90, 100, Action.WAIT),
        (LeaseRecord("other", 15), 85, 100, Action.ACQUIRE),
    ],
)
def test_decide(record: LeaseRecord | None, observed_at: float, now: float, action: Action) -> None:
    assert decide(record, "me", observed_at, now) is action


def test_one_leader_then_takeover_after_expiry() -> None:
    store, clock = MemoryLeases(), Clock()
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.try_acquire_or_renew() is True
    assert b.try_acquire_or_renew() is False
    clock.t += 5
    assert a.try_acquire_or_renew() is True  # renews
    clock.t += 10
    assert b.try_acquire_or_renew() is False  # b saw a renewal 10 s ago
    clock.t += 16  # a stopped renewing; b's own clock says the lease expired
    assert b.try_acquire_or_renew() is True
    assert store.record is not None and store.record.holder == "b" and store.record.transitions == 1
    assert a.try_acquire_or_renew() is False  # a lost it


def test_concurrent_writers_cannot_both_win() -> None:
    store, clock = MemoryLeases(), Clock()
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    store.record = LeaseRecord(None, resource_version="0")
    a_view = store.get("ns", "lease")
    assert a_view is not None
    assert b.try_acquire_or_renew() is True
    with pytest.raises(Conflict):  # a's write is based on the old resourceVersion
        store.update("ns", "lease", replace(a_view, holder="a"))
    assert a.try_acquire_or_renew() is False


def test_release_lets_a_standby_in_at_once() -> None:
    store, clock = MemoryLeases(), Clock()
    a, b = elector(store, clock, "a"), elector(store, clock, "b")
    assert a.try_acquire_or_renew()
    a.release()
    assert store.record is not None and store.record.holder is None
    assert b.try_acquire_or_renew() is True
    b.release()
    b.release()  # idempotent
    a_again = elector(store, clock, "a")
    a_again.release()  # not the holder: does nothing


def test_micro_time_round_trip() -> None:
    record = LeaseRecord(
        "a", 15, datetime(2026, 1, 1, 0, 0, 0, 5, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC), 3
    )
    spec = record.to_spec()
    assert spec["acquireTime"] == "2026-01-01T00:00:00.000005Z"
    assert spec["renewTime"] == "2026-01-01T00:00:00.000000Z"
    back = LeaseRecord.from_lease({"spec": spec, "metadata": {"resourceVersion": "9"}})
    assert back == replace(record, resource_version="9")


def test_api_errors_are_not_leadership() -> None:
    store, clock = MemoryLeases(), Clock()
    a = elector(store, clock, "a")
    store.fail = True
    assert a.try_acquire_or_renew() is False


def test_run_steps_down_when_it_cannot_renew() -> None:
    store = MemoryLeases()
    a = LeaderElector(
        store,
        namespace="ns",
        name="lease",
        identity="a",
        lease_duration=0.3,
        renew_deadline=0.2,
        retry_period=0.05,
    )
    stop, lost = threading.Event(), threading.Event()
    t = threading.Thread(target=a.campaign, args=(stop, lost))
    t.start()
    assert a.leading.wait(2)
    store.fail = True
    assert lost.wait(2)
    t.join(2)
    assert not a.is_leader
    stop.set()


def test_run_as_leader_runs_and_releases() -> None:
    store = MemoryLeases()
    a = LeaderElector(
        store,
        namespace="ns",
        name="lease",
        identity="a",
        lease_duration=0.3,
        renew_deadline=0.2,
        retry_period=0.05,
    )
    stop = threading.Event()
    ran = []

    def lead(lead_stop: threading.Event) -> int:
        ran.append(True)
        stop.set()  # e.g. SIGTERM
        assert lead_stop.wait(2)
        return 0

    assert run_as_leader(a, lead, stop) == 0
    assert ran == [True]
    assert store.record is not None and store.record.holder is None  # released


def test_run_as_leader_standby_exits_cleanly() -> None:
    store = MemoryLeases()
    store.record = LeaseRecord("someone-else", 3600, resource_version="1")
    b = LeaderElector(
        store,
        namespace="ns",
        name="lease",
        identity="b",
        lease_duration=0.3,
        renew_deadline=0.2,
        retry_period=0.05,
    )
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert run_as_leader(b, lambda _s: 99, stop) == 0


def test_invalid_timings_rejected() -> None:
    with pytest.raises(ValueError):
        LeaderElector(MemoryLeases(), namespace="n", name="l", lease_duration=5, renew_deadline=10)


def test_default_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "kvpilot-operator-7d9-abc")
    assert default_identity().startswith("kvpilot-operator-7d9-abc_")


async def test_async_run_and_stop_for_pollers() -> None:
    import asyncio

    store = MemoryLeases()
    a = LeaderElector(
        store,
        namespace="ns",
        name="lease",
        identity="a",
        lease_duration=0.3,
        renew_deadline=0.2,
        retry_period=0.05,
    )
    task = asyncio.create_task(a.run())
    for _ in range(100):
        if a.is_leader:
            break
        await asyncio.sleep(0.01)
    assert a.is_leader
    a.stop()
    await asyncio.wait_for(task, 2)
    assert not a.is_leader and store.record is not None and store.record.holder is None


def test_the_autoscaler_election_uses_this_elector() -> None:
    """kvpilot.autoscaler.election builds on LeaderElector(KubeLeaseStore(api), ...).campaign()."""
    from kubernetes import client

    from kvpilot.autoscaler import election

    wrapped = election.lease_election(client.ApiClient(client.Configuration()), "ns", "me")
    elector = wrapped.elector
    assert isinstance(elector, LeaderElector)
    assert (elector.namespace, elector.identity, elector.name) == ("ns", "me", election.LEASE_NAME)
    assert callable(elector.campaign) and wrapped.is_leader is False
