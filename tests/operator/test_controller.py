"""The work queue: de-duplication, one worker per key, retries with backoff."""

from __future__ import annotations

import asyncio
import threading
import time

from kvpilot.operator.controller import ReconcileController, WorkQueue


async def test_queue_dedupes_and_requeues_keys_added_while_processing() -> None:
    q = WorkQueue()
    q.add(("ns", "a"))
    q.add(("ns", "a"))
    q.add(("ns", "b"))
    assert len(q) == 2
    key = await q.get()
    assert key == ("ns", "a")
    q.add(("ns", "a"))  # changed again while being reconciled: not handed to a second worker now
    assert await q.get() == ("ns", "b")
    q.done(("ns", "b"))
    q.done(("ns", "a"))  # ... but once done, it comes back
    assert await asyncio.wait_for(q.get(), 1) == ("ns", "a")


async def test_add_after() -> None:
    q = WorkQueue()
    q.add_after(("ns", "a"), 0.05)
    assert len(q) == 0
    assert await asyncio.wait_for(q.get(), 1) == ("ns", "a")


async def test_controller_reconciles_each_key_once_per_burst_and_never_concurrently() -> None:
    calls: list[tuple[str, str]] = []
    active: set[tuple[str, str]] = set()
    overlap = []
    lock = threading.Lock()

    def reconcile(key: tuple[str, str]) -> None:
        with lock:
            if key in active:
                overlap.append(key)
            active.add(key)
        time.sleep(0.05)
        with lock:
            active.discard(key)
            calls.append(key)

    ctrl = ReconcileController(reconcile, workers=4, resync_seconds=3600)
    for _ in range(20):  # a burst of pod events for two models
        ctrl.enqueue(("ns", "a"))
        ctrl.enqueue(("ns", "b"))
    stop = asyncio.Event()
    task = asyncio.create_task(ctrl.run(stop))
    await asyncio.sleep(0.3)
    ctrl.enqueue_owner(
        {
            "metadata": {
                "namespace": "ns",
                "ownerReferences": [
                    {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel", "name": "a"}
                ],
            }
        }
    )
    ctrl.enqueue_owner({"metadata": {"namespace": "ns", "labels": {"kvpilot.dev/model": "c"}}})
    await asyncio.sleep(0.3)
    stop.set()
    await task
    ctrl.shutdown()
    assert sorted(calls) == [("ns", "a"), ("ns", "a"), ("ns", "b"), ("ns", "c")]
    assert overlap == []


async def test_failures_are_retried_with_backoff() -> None:
    attempts: list[float] = []

    def reconcile(key: tuple[str, str]) -> None:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise RuntimeError("conflict")

    ctrl = ReconcileController(reconcile, workers=1, resync_seconds=3600)
    ctrl.enqueue(("ns", "a"))
    stop = asyncio.Event()
    task = asyncio.create_task(ctrl.run(stop))
    await asyncio.sleep(2.0)
    stop.set()
    await task
    ctrl.shutdown()
    assert len(attempts) == 3
    assert attempts[2] - attempts[1] > attempts[1] - attempts[0] >= 0.4  # 0.5 s, then 1 s
    assert ctrl.failures == {}


async def test_resync_and_forget() -> None:
    calls: list[tuple[str, str]] = []
    ctrl = ReconcileController(calls.append, workers=1, resync_seconds=0.1)
    ctrl.enqueue(("ns", "a"))
    ctrl.enqueue(("ns", "gone"))
    ctrl.forget(("ns", "gone"))
    stop = asyncio.Event()
    task = asyncio.create_task(ctrl.run(stop))
    await asyncio.sleep(0.35)
    stop.set()
    await task
    ctrl.shutdown()
    assert calls.count(("ns", "a")) >= 3
    assert calls.count(("ns", "gone")) == 1  # queued before it was forgotten; never resynced
