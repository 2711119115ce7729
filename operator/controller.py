"""The work queue between watch events and reconciles, as in client-go/controller-runtime.

Events (an InferenceModel changed, one of its Deployments or pods changed, the periodic resync) only
*enqueue a key*; workers take keys off the queue and reconcile the model as it is now. A key that is
enqueued many times while waiting is reconciled once; a key is never reconciled by two workers at
once; a failed reconcile is retried with exponential backoff. The blocking Kubernetes calls run in a
thread pool so the event loop (and kopf's watches) never stall.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpilot.api.models import API_VERSION, KIND, MODEL_LABEL
from kvpilot.operator import metrics

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace, name)


class WorkQueue:
    """A de-duplicating queue of keys with 'processing' tracking (asyncio, one event loop)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._dirty: set[Key] = set()
        self._processing: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}

    def __len__(self) -> int:
        return len(self._dirty)

    def add(self, key: Key) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        metrics.QUEUE_DEPTH.set(len(self._dirty))
        if key not in self._processing:
            self._queue.put_nowait(key)

    def add_after(self, key: Key, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        self._timers[key] = asyncio.get_running_loop().call_later(delay, self._fire, key)

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def get(self) -> Key:
        key = await self._queue.get()
        self._dirty.discard(key)
        self._processing.add(key)
        metrics.QUEUE_DEPTH.set(len(self._dirty))
        return key

    def done(self, key: Key) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.put_nowait(key)

    def cancel_timers(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()


class ReconcileController:
    """Keys in, reconciles out. `reconcile_key` is the blocking work for one key."""

    def __init__(
        self,
        reconcile_key: Callable[[Key], Any],
        *,
        workers: int = 4,
        resync_seconds: float = 60.0,
        max_backoff: float = 60.0,
    ) -> None:
        self.reconcile_key = reconcile_key
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.max_backoff = max_backoff
        self.known: set[Key] = set()
        self.failures: dict[Key, int] = {}
        self._queue: WorkQueue | None = None
        self._pending: list[Key] = []  # keys seen before run() made the queue
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reconcile")

    # -- inputs (called from kopf handlers, in the event loop) --------------------------------

    def enqueue(self, key: Key) -> None:
        self.known.add(key)
        if self._queue is None:
            self._pending.append(key)
        else:
            self._queue.add(key)

    def forget(self, key: Key) -> None:
        self.known.discard(key)
        self.failures.pop(key, None)

    def enqueue_owner(self, body: dict[str, Any]) -> None:
        """Enqueue the InferenceModel that controls a child (Deployment) or its pod."""
        md = body.get("metadata", {})
        namespace = md.get("namespace", "")
        for ref in md.get("ownerReferences") or []:
            if ref.get("kind") == KIND and ref.get("apiVersion") == API_VERSION:
                self.enqueue((namespace, ref["name"]))
                return
        model = (md.get("labels") or {}).get(MODEL_LABEL)
        if model:
            self.enqueue((namespace, model))

    # -- the loop -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> None:
        self._queue = WorkQueue()
        for key in self._pending:
            self._queue.add(key)
        self._pending.clear()
        tasks = [
            asyncio.create_task(self._worker(i), name=f"reconcile-worker-{i}") for i in range(self.workers)
        ]
        tasks.append(asyncio.create_task(self._resync(), name="resync"))
        try:
            if stop is None:
                await asyncio.gather(*tasks)
            else:
                await stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._queue.cancel_timers()

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            for key in list(self.known):
                assert self._queue is not None
                self._queue.add(key)

    async def _worker(self, index: int) -> None:
        assert self._queue is not None
        queue = self._queue
        loop = asyncio.get_running_loop()
        while True:
            key = await queue.get()
            try:
                await loop.run_in_executor(self.executor, self.reconcile_key, key)
                self.failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                n = self.failures.get(key, 0) + 1
                self.failures[key] = n
                delay = min(self.max_backoff, 0.5 * 2 ** (n - 1))
                log.warning(
                    "reconcile %s/%s failed (%s); retry %d in %.1fs",
                    key[0],
                    key[1],
                    e,
                    n,
                    delay,
                    exc_info=n == 1,
                )
                if key in self.known:
                    queue.add_after(key, delay)
            finally:
                queue.done(key)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
