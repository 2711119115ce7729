"""Leader election on a coordination.k8s.io/v1 Lease, like client-go's leaderelection package.

Shared by the operator and the autoscaler (`from kvpilot.kube.lease import LeaderElector`):

    # blocking: run `lead` only while leading (the operator)
    elector = LeaderElector(api_client=api_client, namespace="kvpilot-system", name="kvpilot-operator")
    code = run_as_leader(elector, lead=lambda stop: my_loop(stop), stop=stop_event)

    # or poll: campaign in the background and ask `elector.is_leader` each cycle (the autoscaler)
    task = asyncio.create_task(elector.run()); ...; elector.stop()

Semantics (same as client-go): a candidate takes the lease when it is free or when the holder has
not renewed it for `lease_duration` seconds *as observed by this candidate's own clock* (so clock
skew between hosts does not matter); the leader renews every `retry_period` and gives up leadership
when it could not renew for `renew_deadline`; on a clean shutdown it releases the lease so a standby
takes over at once. Writes use the Lease's resourceVersion, so two candidates can never both win.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from enum import Enum
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException

from kvpilot.kube.client import ApiKube
from kvpilot.kube.times import format_time, parse_time

log = logging.getLogger(__name__)

LEASE_DURATION_S = 15.0
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 5.0


def default_identity() -> str:
    """POD_NAME (downward API) or the hostname, plus the pid: unique per process."""
    host = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{host}_{os.getpid()}"


@dataclass(frozen=True)
class LeaseRecord:
    """The parts of a Lease's spec that election uses."""

    holder: str | None = None
    lease_duration_s: int = int(LEASE_DURATION_S)
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    transitions: int = 0
    resource_version: str | None = None

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "holderIdentity": self.holder,
            "leaseDurationSeconds": self.lease_duration_s,
            "leaseTransitions": self.transitions,
        }
        if self.acquire_time:
            spec["acquireTime"] = format_time(self.acquire_time, 6)
        if self.renew_time:
            spec["renewTime"] = format_time(self.renew_time, 6)
        return spec

    @classmethod
    def from_lease(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or None,
            lease_duration_s=int(spec.get("leaseDurationSeconds") or LEASE_DURATION_S),
            acquire_time=parse_time(spec.get("acquireTime")),
            renew_time=parse_time(spec.get("renewTime")),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
        )


class Conflict(Exception):
    """Someone else wrote the Lease first."""


class LeaseStore(Protocol):
    def get(self, namespace: str, name: str) -> LeaseRecord | None: ...

    def create(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord: ...

    def update(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        """Replace the Lease if its resourceVersion is still record.resource_version, else Conflict."""
        ...


class KubeLeaseStore:
    """LeaseStore over a kubernetes.client.ApiClient (plain JSON, MicroTime formatted exactly)."""

    def __init__(self, api_client: Any) -> None:
        self.kube = ApiKube(api_client, timeout=RENEW_DEADLINE_S / 2)

    @staticmethod
    def _path(namespace: str, name: str | None = None) -> str:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        return f"{path}/{name}" if name else path

    def get(self, namespace: str, name: str) -> LeaseRecord | None:
        try:
            return LeaseRecord.from_lease(self.kube.request("GET", self._path(namespace, name)))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace},
            "spec": record.to_spec(),
        }
        try:
            out = self.kube.request("POST", self._path(namespace), body=body, content_type="application/json")
        except ApiException as e:
            if e.status == 409:
                raise Conflict(str(e.reason)) from e
            raise
        return LeaseRecord.from_lease(out)

    def update(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": record.resource_version},
            "spec": record.to_spec(),
        }
        try:
            out = self.kube.request(
                "PUT", self._path(namespace, name), body=body, content_type="application/json"
            )
        except ApiException as e:
            if e.status == 409:
                raise Conflict(str(e.reason)) from e
            raise
        return LeaseRecord.from_lease(out)


class Action(Enum):
    CREATE = "create"  # no Lease yet
    ACQUIRE = "acquire"  # free or expired: take it over
    RENEW = "renew"  # we hold it
    WAIT = "wait"  # someone else holds it


def decide(record: LeaseRecord | None, identity: str, observed_at: float, now: float) -> Action:
    """What a candidate should do, given the Lease and when (monotonic) it last saw the Lease change."""
    if record is None:
        return Action.CREATE
    if record.holder == identity:
        return Action.RENEW
    if not record.holder:
        return Action.ACQUIRE
    if now - observed_at >= record.lease_duration_s:
        return Action.ACQUIRE
    return Action.WAIT


class LeaderElector:
    """Acquire, renew and release one Lease. Thread-safe enough for one run loop plus readers."""

    def __init__(
        self,
        store: LeaseStore | None = None,
        *,
        namespace: str,
        name: str,
        identity: str | None = None,
        api_client: Any = None,
        lease_duration: float = LEASE_DURATION_S,
        renew_deadline: float = RENEW_DEADLINE_S,
        retry_period: float = RETRY_PERIOD_S,
        monotonic: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0")
        if store is None:
            if api_client is None:
                raise ValueError("pass a LeaseStore or a kubernetes ApiClient")
            store = KubeLeaseStore(api_client)
        self.store: LeaseStore = store
        self.namespace = namespace
        self.name = name
        self.identity = identity or default_identity()
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.monotonic = monotonic
        self.wallclock = wallclock
        self.leading = threading.Event()
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0
        self._last_renew = 0.0

    @property
    def is_leader(self) -> bool:
        return self.leading.is_set()

    def _observe(self, record: LeaseRecord | None) -> None:
        key = (record.holder, record.renew_time, record.resource_version) if record else None
        old = self._observed
        old_key = (old.holder, old.renew_time, old.resource_version) if old else None
        if key != old_key:
            self._observed = record
            self._observed_at = self.monotonic()

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this candidate holds the Lease afterwards."""
        try:
            record = self.store.get(self.namespace, self.name)
            self._observe(record)
            action = decide(record, self.identity, self._observed_at, self.monotonic())
            now = self.wallclock()
            duration = int(self.lease_duration)
            if action is Action.WAIT:
                return False
            if action is Action.CREATE:
                new = LeaseRecord(self.identity, duration, now, now, 0)
                written = self.store.create(self.namespace, self.name, new)
            else:
                assert record is not None
                if action is Action.RENEW:
                    new = replace(record, renew_time=now, lease_duration_s=duration)
                else:
                    new = replace(
                        record,
                        holder=self.identity,
                        lease_duration_s=duration,
                        acquire_time=now,
                        renew_time=now,
                        transitions=record.transitions + 1,
                    )
                written = self.store.update(self.namespace, self.name, new)
            self._observe(written)
            self._last_renew = self.monotonic()
            if action is not Action.RENEW:
                log.info("acquired lease %s/%s as %s", self.namespace, self.name, self.identity)
            return True
        except Conflict:
            return False
        except Exception:
            log.warning("lease %s/%s: acquire/renew failed", self.namespace, self.name, exc_info=True)
            return False

    def release(self) -> None:
        """Give the Lease up (only if we hold it), so a standby can take over without waiting."""
        try:
            record = self.store.get(self.namespace, self.name)
            if record is None or record.holder != self.identity:
                return
            self.store.update(
                self.namespace,
                self.name,
                replace(record, holder=None, lease_duration_s=1, renew_time=self.wallclock()),
            )
            log.info("released lease %s/%s", self.namespace, self.name)
        except Exception:
            log.warning("could not release lease %s/%s", self.namespace, self.name, exc_info=True)
        finally:
            self.leading.clear()

    def campaign(self, stop: threading.Event, lost: threading.Event | None = None) -> None:
        """Campaign (blocking) until `stop`; set `leading` while leading; set `lost` (and return) if
        leadership is lost. Releases the Lease when stopped while leading."""
        while not stop.is_set():
            if self.try_acquire_or_renew():
                self.leading.set()
            elif self.leading.is_set() and self.monotonic() - self._last_renew >= self.renew_deadline:
                log.error(
                    "lease %s/%s: could not renew for %.0fs; stepping down",
                    self.namespace,
                    self.name,
                    self.renew_deadline,
                )
                self.leading.clear()
                if lost is not None:
                    lost.set()
                return
            elif (
                self.leading.is_set()
                and self._observed is not None
                and self._observed.holder != self.identity
            ):
                log.error("lease %s/%s: taken over by %s", self.namespace, self.name, self._observed.holder)
                self.leading.clear()
                if lost is not None:
                    lost.set()
                return
            stop.wait(self.retry_period)
        if self.leading.is_set():
            self.release()

    # -- for callers that only ask `is_leader` (the autoscaler) ----------------------------------

    async def run(self) -> None:
        """Campaign in a worker thread until `stop()`; meanwhile `is_leader` tells the state."""
        import asyncio

        await asyncio.to_thread(self.campaign, self._stop, self.lost)

    def start(self) -> threading.Thread:
        """Campaign in a daemon thread until `stop()`."""
        thread = threading.Thread(
            target=self.campaign, args=(self._stop, self.lost), name="lease", daemon=True
        )
        thread.start()
        return thread

    def stop(self) -> None:
        """End `run()`/`start()`; the Lease is released if held."""
        self._stop.set()


def run_as_leader(
    elector: LeaderElector,
    lead: Callable[[threading.Event], int],
    stop: threading.Event,
) -> int:
    """Wait to lead, then run `lead(stop_flag)` until it returns, `stop` is set or leadership is lost.

    Returns lead's exit code, 0 when stopped before leading, or 1 when leadership was lost (the
    process should exit so that it restarts clean, as controller-runtime does).
    """
    lost = threading.Event()
    campaign_stop = threading.Event()
    thread = threading.Thread(
        target=elector.campaign, args=(campaign_stop, lost), name="leader-election", daemon=True
    )
    thread.start()
    log.info("waiting to become leader of %s/%s as %s", elector.namespace, elector.name, elector.identity)
    while not (stop.is_set() or elector.leading.wait(0.2) or lost.is_set()):
        pass
    if stop.is_set() or lost.is_set():
        campaign_stop.set()
        thread.join(timeout=elector.renew_deadline)
        return 1 if lost.is_set() else 0

    lead_stop = threading.Event()

    def watch() -> None:
        while not lead_stop.is_set():
            if stop.is_set() or lost.is_set():
                lead_stop.set()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, name="leader-watch", daemon=True)
    watcher.start()
    try:
        code = lead(lead_stop)
    finally:
        lead_stop.set()
        campaign_stop.set()
        thread.join(timeout=elector.renew_deadline)
    return 1 if lost.is_set() else code
