"""The fleet router on the local control plane, in front of e2e/localpods.py's real runtimes.

`LocalPodSource` is the router's own Kubernetes discovery (`kube_discovery.kube_source`: the
namespace's InferenceModels and Ready pods, listed from the API server) with pod networking supplied
by `LocalKubelet`: kwok pods have addresses nothing listens on, so each endpoint's URL becomes the
pod's local process, and a pod counts only once that process answers /ready (what a kubelet's
readiness probe does; kwok marks pods Ready at once). `RouterThread` serves a real `Router` on
127.0.0.1 from a background thread. `stream_completion` and `closed_loop` send streaming completions
and record, per request, when it was sent, its first token and end, and which pod served it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from e2e.harness import wait_until
from e2e.localpods import LocalKubelet
from kvpilot.api.slo import SloTargets
from kvpilot.net import free_port
from kvpilot.router.cli import serve
from kvpilot.router.pd import PdSettings
from kvpilot.router.pool import Endpoint
from kvpilot.router.server import POD_HEADER, EndpointSource, Router, UpdateEndpoints


class LocalPodSource:
    """Wrap an EndpointSource whose endpoints are named by pod: keep the pods whose local process is
    Ready, at that process's URL; re-checked every `poll_s` (a process becomes Ready after its pod)."""

    def __init__(self, inner: EndpointSource, kubelet: LocalKubelet, poll_s: float = 0.25) -> None:
        self.inner = inner
        self.kubelet = kubelet
        self.poll_s = poll_s

    async def run(self, update: UpdateEndpoints, synced: Callable[[], None]) -> None:
        Listed = tuple[
            list[Endpoint],
            str | None,
            str | None,
            tuple[str, ...] | None,
            SloTargets | None,
            PdSettings | None,
        ]
        listed: dict[str, Listed] = {}
        pushed: dict[str, Listed] = {}

        def push(model: str) -> None:
            endpoints, policy, fallback, adapters, slo, pd = listed[model]
            local = self.kubelet.ready_urls()
            mapped = [replace(e, url=local[e.name]) for e in endpoints if e.name in local]
            if pushed.get(model) != (mapped, policy, fallback, adapters, slo, pd):
                pushed[model] = (mapped, policy, fallback, adapters, slo, pd)
                update(model, mapped, policy, fallback, adapters, slo, pd)

        def record(
            model: str,
            endpoints: list[Endpoint] | None,
            policy: str | None = None,
            fallback: str | None = None,
            adapters: Sequence[str] | None = None,
            slo: SloTargets | None = None,
            disaggregation: PdSettings | None = None,
        ) -> None:
            if endpoints is None:
                listed.pop(model, None)
                pushed.pop(model, None)
                update(model, None)
                return
            listed[model] = (
                list(endpoints),
                policy,
                fallback,
                None if adapters is None else tuple(adapters),
                slo,
                disaggregation,
            )
            push(model)

        task = asyncio.create_task(self.inner.run(record, synced))
        try:
            while not task.done():
                await asyncio.sleep(self.poll_s)
                for model in list(listed):
                    push(model)
            await task  # the inner source failed: let the router log it
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


class RouterThread:
    """A real Router served on 127.0.0.1:<free port> from a background thread."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="router", daemon=True)
        self.error: BaseException | None = None

    def _main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve(self.router, "127.0.0.1", self.port, self._stop)

        try:
            asyncio.run(main())
        except BaseException as exc:  # surfaced by ready()
            self.error = exc

    def start(self, timeout: float = 30) -> RouterThread:
        self._thread.start()
        wait_until(self.ready, timeout=timeout, what="router /ready")
        return self

    def ready(self) -> bool:
        if self.error is not None:
            raise RuntimeError(f"router thread failed: {self.error!r}")
        try:
            with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


@dataclass
class RequestRecord:
    """One streamed completion as the client saw it (times are time.time())."""

    sent: float
    status: int = 0
    pod: str | None = None  # X-Kvpilot-Pod through the router; the URL when sent to a pod directly
    first_token: float | None = None
    done: float | None = None
    chunks: int = 0  # SSE events with text
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    """POST a streaming /v1/completions (ignore_eos: max_tokens tokens or an error) and read it to the end."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    rec = RequestRecord(sent=time.time())
    try:
        async with session.post(f"{base_url}/v1/completions", json=body, headers=headers or {}) as resp:
            rec.status = resp.status
            rec.pod = resp.headers.get(POD_HEADER) or base_url
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                rec.done = time.time()
                return rec
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event: dict[str, Any] = json.loads(data)
                if "error" in event:
                    rec.error = str(event["error"])
                    break
                choice = (event.get("choices") or [{}])[0]
                if choice.get("text"):
                    rec.chunks += 1
                    if rec.first_token is None:
                        rec.first_token = time.time()
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.done = time.time()
    return rec


async def closed_loop(
    targets: Callable[[], Sequence[str]],
    model: str,
    *,
    concurrency: int,
    max_tokens: int,
    stop: Callable[[list[RequestRecord]], bool],
    max_s: float,
    prompt: str = "Write a short story about a lighthouse keeper.",
) -> list[RequestRecord]:
    """`concurrency` clients, each sending one streamed completion after another to the next of
    `targets()` (one router URL, or the pods' URLs round-robin like a Service) until stop(records) or
    max_s. No retries: a failed request stays a failure."""
    records: list[RequestRecord] = []
    started = time.monotonic()
    rr = 0
    timeout = aiohttp.ClientTimeout(total=600)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal rr
        while time.monotonic() - started < max_s and not stop(records):
            urls = targets()
            if not urls:
                await asyncio.sleep(0.2)
                continue
            url = urls[rr % len(urls)]
            rr += 1
            records.append(await stream_completion(session, url, model, prompt, max_tokens))

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return records
