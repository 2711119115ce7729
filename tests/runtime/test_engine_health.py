"""The engine's watchdog and the bounded exit (issue 22): `/health` and `/ready` tell the truth about
a stuck engine loop, the waiting gauge counts every admitted request, and SIGTERM always ends
`kvpilot serve`. The loop is made to stick with a model step that blocks (`LLMEngine.before_execute`
in process; tests/runtime/wedged_serve.py for the real `kvpilot serve` process)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fake_engine import LiveServer

from kvpilot.net import free_port
from kvpilot.runtime.config import EXIT_GRACE_S
from kvpilot.runtime.engine.async_engine import AsyncEngine
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.health import STALL_SLACK, StepPace, judge_progress, stall_limit_s
from kvpilot.runtime.engine.scheduler import SchedulerOutput
from kvpilot.runtime.serving.lifecycle import EXIT_STUCK

pytestmark = pytest.mark.timeout(240)

STALL_S = 1.0  # --engine-stall-timeout of these tests' engines
HANG_S = 60.0  # "does not hang" bound of each wait


# -- the decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("age", "has_work", "timeout", "healthy"),
    [
        (0.1, True, 60.0, True),  # busy and progressing
        (59.9, True, 60.0, True),  # a long step, still under the limit
        (60.0, True, 60.0, False),  # stuck
        (3600.0, True, 60.0, False),
        (3600.0, False, 60.0, True),  # no work: an old heartbeat is no stall (thread not turning)
        (3600.0, True, 0.0, True),  # 0: the watchdog is off
    ],
)
def test_judge_progress(age: float, has_work: bool, timeout: float, healthy: bool) -> None:
    verdict = judge_progress(age, has_work, timeout)
    assert verdict.healthy is healthy
    if healthy:
        assert verdict.body() == {"status": "ok"}
    else:
        assert verdict.status == "engine stalled"
        assert verdict.reason is not None and f"{age:.0f}s" in verdict.reason
        assert "--engine-stall-timeout 60s" in verdict.reason


def test_a_step_may_take_what_the_engines_pace_gives_its_tokens() -> None:
    """The timeout is a floor: a 2,048-token prefill chunk on a slow or shared CPU takes longer than
    it, and is no stall while it runs within STALL_SLACK times what the measured pace expects."""
    pace = StepPace()
    assert pace.expected_s(2048) is None  # no step measured yet: the timeout alone
    pace.observe(512, 10.0)  # a prefill chunk: ~20 ms a token
    assert pace.expected_s(2048) == pytest.approx(40.0)
    limit = stall_limit_s(60.0, pace.expected_s(2048))
    assert limit == pytest.approx(STALL_SLACK * 40.0)
    assert judge_progress(100.0, True, 60.0, pace.expected_s(2048)).healthy
    stuck = judge_progress(limit + 1, True, 60.0, pace.expected_s(2048))
    assert not stuck.healthy and stuck.reason is not None and "should take ~40s" in stuck.reason
    # a small step stays under the timeout's floor; a decode step is no reason to wait longer
    assert stall_limit_s(60.0, pace.expected_s(8)) == 60.0
    assert not judge_progress(61.0, True, 60.0, pace.expected_s(8)).healthy
    # steps weigh by their tokens: many decode steps move the pace less than their count
    for _ in range(10):
        pace.observe(4, 0.04)  # 10 ms a token
    per_token = (pace.expected_s(1000) or 0) / 1000
    assert 0.01 < per_token < 0.02
    # nonsense samples are ignored; 0 turns the watchdog off whatever the pace
    before = pace.expected_s(100)
    pace.observe(0, 5.0)
    pace.observe(10, -1.0)
    assert pace.expected_s(100) == before and pace.expected_s(0) is None
    assert judge_progress(1e6, True, 0.0, 1.0).healthy


# -- a real engine whose step blocks --------------------------------------------------------------


class Wedge:
    """A model step that blocks until released (the engine's fault-injection hook)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, sched: SchedulerOutput) -> None:
        self.entered.set()
        self.release.wait(HANG_S * 3)


@contextmanager
def wedged_server(
    make_engine: Callable[..., LLMEngine], shutdown_timeout: float = 5.0
) -> Iterator[tuple[LiveServer, AsyncEngine, Wedge]]:
    engine = AsyncEngine(make_engine(max_model_len=256, engine_stall_timeout=STALL_S))
    wedge = Wedge()
    engine.engine.before_execute = wedge
    engine.start()
    live = LiveServer(engine, model_name=engine.model_name, shutdown_timeout=shutdown_timeout)
    try:
        yield live, engine, wedge
    finally:
        wedge.release.set()
        live.close()


def get(url: str, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url + path, timeout=HANG_S) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    return status, json.loads(body) if path != "/metrics" else body.decode()


def gauge(url: str, name: str) -> float:
    text = get(url, "/metrics")[1]
    found = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in /metrics"
    return float(found.group(1))


def submit(url: str, results: list[Any], max_tokens: int = 2) -> threading.Thread:
    """A completion in a background thread; its status (or error) lands in `results`."""

    def run() -> None:
        body = json.dumps({"prompt": "Hello", "max_tokens": max_tokens, "temperature": 0}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=HANG_S * 3) as resp:
                results.append(resp.status)
        except Exception as e:  # cut by a shutdown
            results.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def wait_for(cond: Callable[[], bool], timeout: float = HANG_S) -> None:
    if not eventually(cond, timeout):
        raise AssertionError("condition not met in time")


def eventually(cond: Callable[[], bool], timeout: float = HANG_S) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_stuck_step_fails_health_and_ready_until_it_resumes(
    make_engine: Callable[..., LLMEngine],
) -> None:
    with wedged_server(make_engine) as (live, _, wedge):
        assert get(live.url, "/health") == (200, {"status": "ok"})  # idle, no work: healthy
        assert get(live.url, "/ready")[0] == 200
        results: list[Any] = []
        t = submit(live.url, results)
        assert wedge.entered.wait(HANG_S)
        wait_for(lambda: get(live.url, "/health")[0] == 503)
        status, body = get(live.url, "/health")
        assert status == 503 and body["status"] == "engine stalled"
        assert "no progress" in body["reason"] and "--engine-stall-timeout 1s" in body["reason"]
        status, body = get(live.url, "/ready")
        assert status == 503 and body["status"] == "engine stalled"
        assert gauge(live.url, "kvpilot_engine_stalled") == 1
        assert gauge(live.url, "kvpilot_engine_heartbeat_age_seconds") >= STALL_S
        assert results == []  # the request is still in the stuck step

        wedge.release.set()
        t.join(HANG_S)
        assert results == [200]
        wait_for(lambda: get(live.url, "/health") == (200, {"status": "ok"}))
        assert get(live.url, "/ready") == (200, {"status": "ready"})
        assert gauge(live.url, "kvpilot_engine_stalled") == 0


def test_a_step_the_engines_pace_expects_to_be_long_is_no_stall(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """The step under way is judged against the engine's own measured pace: on an engine whose
    steps take 30 s a token (a large model on a shared CPU), a step held for three times the 1 s
    timeout is still healthy, and it finishes."""
    with wedged_server(make_engine) as (live, engine, wedge):
        engine.engine.pace.observe(1, 30.0)
        results: list[Any] = []
        t = submit(live.url, results)
        assert wedge.entered.wait(HANG_S)
        assert engine.engine.step_tokens > 0
        assert (engine.engine.expected_step_s() or 0) >= 30.0
        time.sleep(3 * STALL_S)
        assert engine.heartbeat_age() >= 3 * STALL_S
        assert get(live.url, "/health") == (200, {"status": "ok"})
        assert gauge(live.url, "kvpilot_engine_stalled") == 0
        wedge.release.set()
        t.join(HANG_S)
        assert results == [200]
        assert engine.engine.step_tokens == 0 and engine.engine.expected_step_s() is None


def test_the_waiting_gauge_counts_requests_the_loop_has_not_taken(
    make_engine: Callable[..., LLMEngine],
) -> None:
    with wedged_server(make_engine) as (live, engine, wedge):
        results: list[Any] = []
        threads = [submit(live.url, results)]
        assert wedge.entered.wait(HANG_S)  # the first request is in the (stuck) step
        threads += [submit(live.url, results) for _ in range(3)]  # these stay in the inbox
        wait_for(lambda: engine.num_unfinished() == 4)
        assert gauge(live.url, "kvpilot_num_requests_running") == 1
        assert gauge(live.url, "kvpilot_num_requests_waiting") == 3

        wedge.release.set()
        for t in threads:
            t.join(HANG_S)
        assert results == [200] * 4
        # (the engine thread counts a request done just after handing over its last output)
        wait_for(lambda: gauge(live.url, "kvpilot_num_requests_waiting") == 0)
        assert gauge(live.url, "kvpilot_num_requests_running") == 0


def test_a_dead_engine_fails_ready_too(make_engine: Callable[..., LLMEngine]) -> None:
    with wedged_server(make_engine) as (live, engine, _):

        def boom(sched: SchedulerOutput) -> None:
            raise RuntimeError("a bug in a step")

        engine.engine.before_execute = boom
        results: list[Any] = []
        submit(live.url, results).join(HANG_S)
        assert engine.dead is not None
        status, body = get(live.url, "/ready")
        assert status == 503 and body["status"] == "engine stopped"
        status, body = get(live.url, "/health")
        assert status == 503 and body["status"] == "engine stopped"
        assert "RuntimeError" in body["reason"] and "a bug in a step" not in body["reason"]
        assert gauge(live.url, "kvpilot_engine_stalled") == 1


def test_serve_returns_in_bounded_time_when_the_engine_is_stuck(
    make_engine: Callable[..., LLMEngine],
) -> None:
    shutdown_timeout = 1.0
    with wedged_server(make_engine, shutdown_timeout) as (live, _, wedge):
        submit(live.url, [])
        assert wedge.entered.wait(HANG_S)
        live.begin_shutdown()  # what SIGTERM does
        # serve() itself bounds the drain, closing the connections and the wait for the engine
        # thread (the exit deadline of `kvpilot serve` comes 5 s before the last one ends)
        assert live.wait_exit(timeout=shutdown_timeout + EXIT_GRACE_S + 5.0 + 15.0) == 0


# -- the `kvpilot serve` process ------------------------------------------------------------------


def test_sigterm_ends_kvpilot_serve_with_a_wedged_engine(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    shutdown_timeout = 2.0
    log_path = tmp_path / "serve.log"
    script = Path(__file__).with_name("wedged_serve.py")
    flags = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--threads", "1"]
    flags += ["--kv-cache-memory", "64MiB", "--max-model-len", "256", "--log-level", "warning"]
    flags += ["--engine-stall-timeout", str(STALL_S), "--shutdown-timeout", str(shutdown_timeout)]
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, str(script), *flags],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:

        def answers(path: str, status: int) -> bool:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                return get(url, path)[0] == status
            except OSError:  # not listening yet
                return False

        wait_for(lambda: answers("/ready", 200), timeout=180)
        submit(url, [])
        wait_for(lambda: "WEDGED" in log_path.read_text())
        # the liveness probe would restart the pod, the readiness probe take it out of service
        stalled = eventually(lambda: answers("/health", 503))
        ready_status = get(url, "/ready")[1]["status"]

        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        bound = shutdown_timeout + EXIT_GRACE_S + 20.0  # generous: a "does not hang" bound
        try:
            code = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            log = log_path.read_text()[-4000:]
            raise AssertionError(f"still running {bound:.0f}s after SIGTERM:\n{log}") from None
        elapsed = time.monotonic() - start
        log = log_path.read_text()
        assert code == EXIT_STUCK, log
        assert stalled and ready_status == "engine stalled"
        assert elapsed >= shutdown_timeout  # the drain still got its time
        assert "something is stuck" in log and "_wedged_execute" in log  # why, and the stuck stack
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
