"""A deadline that a slow but live pod extends: `async with PodDeadline(...)` around one wait on a pod
(its response headers, the next chunk of its body).

When `timeout_s` passes with the wait unfinished, `alive(since)` is asked, meanwhile the wait goes on:
True (the pod answered its health probe, or anything else since `since`, the start of the period)
gives it another `timeout_s`; False, or `silence_limit_s` passed since the start, cancels the wait and
the block raises `Silent`. The wait itself is awaited directly, not in a task, so a fast answer costs
no extra event-loop turn; what the block awaits must be safe to cancel (aiohttp's request, or a read
of its response, which keeps the bytes already buffered).

Other exceptions from the block, aiohttp's own timeouts among them, pass through unchanged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import TracebackType


class Silent(Exception):
    """The pod sent nothing within the deadline and failed its probe (or the silence limit passed)."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(message)
        self.phase = phase


class PodDeadline:
    def __init__(
        self,
        alive: Callable[[float], Awaitable[bool]],
        timeout_s: float,
        silence_limit_s: float,
        phase: str,
        what: str,
    ) -> None:
        self._alive = alive
        self._timeout_s = timeout_s
        self._limit_s = silence_limit_s
        self.phase = phase  # a metric label: first_byte, idle
        self._what = what  # for messages: "response headers", "the next chunk"
        self._why: str | None = None  # set when the pod is given up on
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None
        self._probe: asyncio.Future[bool] | None = None
        self._open = False

    async def __aenter__(self) -> PodDeadline:
        self._loop = asyncio.get_running_loop()
        self._started = time.monotonic()
        await self._timeout.__aenter__()
        self._open = True
        self._arm()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._open = False
        if self._handle is not None:
            self._handle.cancel()
        if self._probe is not None:
            self._probe.cancel()  # this wait's interest in the probe, not a probe others share
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            if self._why is not None:
                raise Silent(self.phase, self._why) from None
            raise

    def _arm(self) -> None:
        now = time.monotonic()
        left = self._started + self._limit_s - now
        self._handle = self._loop.call_later(max(0.0, min(self._timeout_s, left)), self._check, now)

    def _check(self, since: float) -> None:
        if not self._open:
            return
        if time.monotonic() - self._started >= self._limit_s:
            self._give_up(f"no {self._what} for {self._limit_s:g}s (the silence limit)")
            return
        self._probe = asyncio.ensure_future(self._alive(since))
        self._probe.add_done_callback(self._probed)

    def _probed(self, probe: asyncio.Future[bool]) -> None:
        if not self._open or probe.cancelled():
            return
        if probe.exception() is None and probe.result():
            self._arm()  # slow, not gone: another period
        else:
            self._give_up(f"no {self._what} within {self._timeout_s:g}s and no answer to its health probe")

    def _give_up(self, why: str) -> None:
        self._why = why
        self._timeout.reschedule(self._loop.time())  # expire now: cancels the wait
