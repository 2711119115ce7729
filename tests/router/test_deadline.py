"""PodDeadline (router/deadline.py) on a real event loop: a live pod extends it, a silent one ends it."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot.router.deadline import PodDeadline, Silent


class Pod:
    """What the deadline asks: is the pod alive? (counts the questions)"""

    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.asked: list[float] = []

    async def __call__(self, since: float) -> bool:
        self.asked.append(since)
        await asyncio.sleep(0.01)  # a probe takes a while
        return self.alive


def deadline(pod: Pod, timeout_s: float = 0.05, limit_s: float = 30.0) -> PodDeadline:
    return PodDeadline(pod, timeout_s, limit_s, "first_byte", "response headers")


async def test_a_live_pod_extends_the_deadline_period_by_period() -> None:
    pod, done = Pod(alive=True), asyncio.Event()
    asyncio.get_running_loop().call_later(0.4, done.set)
    async with deadline(pod):
        await done.wait()
    assert len(pod.asked) >= 3 and pod.asked == sorted(pod.asked)


async def test_a_pod_that_fails_its_probe_is_given_up_on() -> None:
    pod = Pod(alive=False)
    with pytest.raises(Silent) as caught:
        async with deadline(pod):
            await asyncio.Event().wait()
    assert caught.value.phase == "first_byte" and "health probe" in str(caught.value)
    assert len(pod.asked) == 1


async def test_the_silence_limit_ends_even_a_live_wait() -> None:
    pod = Pod(alive=True)
    with pytest.raises(Silent, match="silence limit"):
        async with deadline(pod, timeout_s=0.05, limit_s=0.3):
            await asyncio.Event().wait()


async def test_a_quick_answer_asks_nothing_and_other_errors_pass_through() -> None:
    pod = Pod(alive=False)
    async with deadline(pod, timeout_s=0.2):
        await asyncio.sleep(0)
    await asyncio.sleep(0.3)  # the deadline is disarmed: nothing fires later
    assert pod.asked == []
    with pytest.raises(TimeoutError) as caught:  # aiohttp's own connect deadline, say
        async with deadline(pod):
            raise TimeoutError("connect")
    assert not isinstance(caught.value, Silent) and str(caught.value) == "connect"


async def test_a_wait_cancelled_from_outside_is_a_cancellation_not_a_timeout() -> None:
    pod = Pod(alive=True)

    async def wait() -> None:
        async with deadline(pod):
            await asyncio.Event().wait()

    task = asyncio.create_task(wait())
    await asyncio.sleep(0.2)  # past a few periods, probes included
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
