"""Prefill/decode disaggregation through two real servers around SmolLM2 (docs/disaggregation.md): a
`--kv-role prefill` pod runs the prompt and answers kv_transfer_params, a `--kv-role decode` pod pulls
the blocks over HTTP and generates exactly what an aggregated run generates; transfer faults (the
prefill pod gone, a corrupt or stalled stream, an unknown transfer) fall back to recomputing, counted,
never an error for the client."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from fake_engine import LiveServer
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.runtime.engine.core import LLMEngine

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

PROMPT = (
    "Write a short note about the lighthouse keeper who kept a diary of every ship that passed the "
    "northern cape during the long winter of the storms, and of the letters she never sent. " * 2
)
CHAT = [{"role": "user", "content": "Name three rivers in Europe and one fact about each of them, please."}]


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def samples(url: str) -> dict[tuple[str, str], float]:
    """(sample name, the non-model label's value) -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            extra = [v for k, v in s.labels.items() if k != "model_name"]
            out[(s.name, extra[0] if extra else "")] = s.value
    return out


@pytest.fixture(scope="module")
def pods(make_engine: Callable[..., LLMEngine]) -> Iterator[tuple[LiveServer, LiveServer]]:
    from kvpilot.runtime.engine.async_engine import AsyncEngine

    servers = []
    for role in ("prefill", "decode"):
        engine = AsyncEngine(
            make_engine(kv_role=role, kv_cache_memory=32 * 2**20, max_model_len=1024, kv_transfer_timeout=2.0)
        )
        engine.start()
        servers.append(LiveServer(engine, model_name=engine.model_name))
    yield servers[0], servers[1]
    for s in servers:
        s.close()


def prefill(p: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = post(
        p.url + path,
        {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 200, out
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_url"] == p.url
    return dict(params)


def text_of(out: dict[str, Any]) -> str:
    choice = out["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ],
    ids=["completions", "chat"],
)
def test_prefill_then_decode_gives_the_aggregated_output(
    pods: tuple[LiveServer, LiveServer], path: str, body: dict[str, Any]
) -> None:
    p, d = pods
    greedy = {**body, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    status, reference = post(p.url + path, greedy)  # every role serves plain requests: the aggregated run
    assert status == 200
    before_d, before_p = samples(d.url), samples(p.url)
    params = prefill(p, path, body)
    assert samples(p.url)[("kvpilot_kv_transfers_pending", "")] >= 1
    status, out = post(d.url + path, {**greedy, "kv_transfer_params": params})
    assert status == 200, out
    assert text_of(out) == text_of(reference)
    after_d, after_p = samples(d.url), samples(p.url)
    received = (
        after_d[("kvpilot_kv_transfer_bytes_total", "received")]
        - before_d[("kvpilot_kv_transfer_bytes_total", "received")]
    )
    sent = (
        after_p[("kvpilot_kv_transfer_bytes_total", "sent")]
        - before_p[("kvpilot_kv_transfer_bytes_total", "sent")]
    )
    assert received > 0 and received == sent
    assert (
        after_d[("kvpilot_kv_transfer_seconds_count", "")]
        == before_d.get(("kvpilot_kv_transfer_seconds_count", ""), 0) + 1
    )
    assert sum(v for (n, _), v in after_d.items() if n == "kvpilot_kv_transfer_fallbacks_total") == sum(
        v for (n, _), v in before_d.items() if n == "kvpilot_kv_transfer_fallbacks_total"
    )
    assert (
        after_d[("kvpilot_engine_info", "decode")] == 1 and after_p[("kvpilot_engine_info", "prefill")] == 1
    )


def test_a_decode_pod_pulls_only_what_its_prefix_cache_lacks(pods: tuple[LiveServer, LiveServer]) -> None:
    p, d = pods
    body = {"prompt": "Once more: " + PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    received = ("kvpilot_kv_transfer_bytes_total", "received")
    r0 = samples(d.url)[received]
    status, _ = post(
        d.url + "/v1/completions", {**body, "kv_transfer_params": prefill(p, "/v1/completions", body)}
    )
    r1 = samples(d.url)[received]
    longer = {**body, "prompt": body["prompt"] + " And then the spring came."}
    status, second = post(
        d.url + "/v1/completions", {**longer, "kv_transfer_params": prefill(p, "/v1/completions", longer)}
    )
    r2 = samples(d.url)[received]
    assert status == 200

    def blocks(prompt: str) -> int:  # full blocks before the prompt's last token
        return (len(d.engine.tokenizer.encode(prompt, add_special_tokens=True)) - 1) // 16

    block_bytes = 2 * 30 * 16 * 3 * 64 * 4  # one block of SmolLM2's 30 layers in float32
    assert r1 - r0 == blocks(body["prompt"]) * block_bytes
    # the second prompt's shared blocks came from the decode pod's own prefix cache
    assert r2 - r1 == (blocks(longer["prompt"]) - blocks(body["prompt"])) * block_bytes
    assert blocks(longer["prompt"]) - blocks(body["prompt"]) < blocks(body["prompt"])
    _, reference = post(p.url + "/v1/completions", longer)
    assert text_of(second) == text_of(reference)


def test_each_role_refuses_the_other_roles_params(pods: tuple[LiveServer, LiveServer]) -> None:
    p, d = pods
    status, out = post(
        d.url + "/v1/completions", {"prompt": "hi", "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert (
        status == 400
        and out["error"]["param"] == "kv_transfer_params"
        and "--kv-role decode" in out["error"]["message"]
    )
    params = prefill(p, "/v1/completions", {"prompt": PROMPT})
    status, out = post(p.url + "/v1/completions", {"prompt": PROMPT, "kv_transfer_params": params})
    assert status == 400 and out["error"]["param"] == "kv_transfer_params"
    status, out = post(
        p.url + "/v1/completions",
        {"prompt": "hi", "stream": True, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert status == 400 and out["error"]["param"] == "kv_transfer_params"
    # the transfer endpoints: only the prefill side serves them; a release is final
    req = urllib.request.Request(f"{p.url}/v1/kv/transfers/{params['transfer_id']}", method="DELETE")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
    for url in (f"{p.url}/v1/kv/transfers/{params['transfer_id']}", f"{d.url}/v1/kv/transfers/x"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        assert e.value.code == 404


class Proxy:
    """A real HTTP hop between the pods that breaks the transfer stream as told: `corrupt` flips a byte
    in the middle, `stall` never answers."""

    def __init__(self, target: str, mode: str) -> None:
        self.target, self.mode = target, mode
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> int:
        import aiohttp

        self.unstall = asyncio.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            if self.mode == "stall" and request.method == "GET":
                await self.unstall.wait()  # past the decode pod's deadline: close() lets it go
            async with (
                aiohttp.ClientSession() as s,
                s.request(request.method, self.target + request.path_qs) as r,
            ):
                body = bytearray(await r.read())
            if self.mode == "corrupt" and request.method == "GET":
                body[len(body) // 2] ^= 0x01
            return web.Response(status=r.status, body=bytes(body))

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.unstall.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.mark.parametrize("fault", ["peer_gone", "not_found", "checksum", "timeout", "mismatch"])
def test_a_failed_transfer_is_recomputed_and_counted(pods: tuple[LiveServer, LiveServer], fault: str) -> None:
    p, d = pods
    body = {"prompt": f"[{fault}] " + PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    params = prefill(p, "/v1/completions", body)
    proxy = None
    if fault == "peer_gone":
        params["remote_url"] = "http://127.0.0.1:9"  # nothing listens there
    elif fault == "not_found":
        params["transfer_id"] = "0" * 32
    elif fault == "mismatch":
        params["model_fingerprint"] = "another-model"
    else:
        proxy = Proxy(p.url, "corrupt" if fault == "checksum" else "stall")
        params["remote_url"] = proxy.url
    before = samples(d.url)
    try:
        status, out = post(d.url + "/v1/completions", {**body, "kv_transfer_params": params})
    finally:
        if proxy is not None:
            proxy.close()
    assert status == 200, out
    _, reference = post(p.url + "/v1/completions", body)
    assert text_of(out) == text_of(reference)
    after = samples(d.url)
    for name in ("kvpilot_kv_transfer_failures_total", "kvpilot_kv_transfer_fallbacks_total"):
        assert after[(name, fault)] == before[(name, fault)] + 1, name
