"""The load generator of runtime_vs_peers.py: an OpenAI-compatible server run as a subprocess
(`Server`), and the openai-client workloads against it: all requests at once, one stream, and
Poisson arrivals with streaming (TTFT, inter-token latency, time per output token). `HttpServer`
is the engine adapter for any such server (llama-server, vLLM, kvpilot serve).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import workload as wl

from peers.measure import BenchEngine, dist, single_stream_figures


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with status {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f}s")


@dataclass
class Server:
    name: str
    argv: list[str]
    port: int
    ready_path: str
    log_path: Path
    env: dict[str, str] | None = None
    ready_timeout: float = 600.0  # seconds from the start until ready_path answers 200
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_http(f"http://127.0.0.1:{self.port}{self.ready_path}", self.proc, self.ready_timeout)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def model_id(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/models", timeout=30) as resp:
            data = json.load(resp)
        return str(data["data"][0]["id"])


def completion_body(r: wl.Request) -> dict[str, Any]:
    """Extra request fields: exact lengths (`ignore_eos`; llama-server's own `n_predict`, which the
    other servers ignore)."""
    return {"ignore_eos": True, "n_predict": r.max_tokens}


async def http_batch(base_url: str, model: str, reqs: list[wl.Request]) -> dict[str, Any]:
    """All requests at once, non-streaming; throughput from first send to last answer."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=7200, max_retries=0)

    async def one(r: wl.Request) -> int:
        resp = await client.completions.create(
            model=model,
            prompt=r.prompt_ids,
            max_tokens=r.max_tokens,
            temperature=0.0,
            extra_body=completion_body(r),
        )
        assert resp.usage is not None
        return int(resp.usage.completion_tokens)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - t0
    await client.close()
    got = sum(counts)
    return {
        "wall_s": round(wall, 2),
        "output_tokens": got,
        "output_tokens_expected": sum(r.max_tokens for r in reqs),
        "lengths_exact": all(c == r.max_tokens for c, r in zip(counts, reqs, strict=True)),
        "output_tok_per_s": round(got / wall, 1),
        "total_tok_per_s": round((got + sum(r.prompt_len for r in reqs)) / wall, 1),
    }


@dataclass
class StreamResult:
    send: float
    chunk_times: list[float]
    tokens: int


async def http_stream_one(client: Any, model: str, r: wl.Request, delay: float = 0.0) -> StreamResult:
    if delay > 0:
        await asyncio.sleep(delay)
    send = time.perf_counter()
    times: list[float] = []
    usage_tokens: int | None = None
    stream = await client.completions.create(
        model=model,
        prompt=r.prompt_ids,
        max_tokens=r.max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=completion_body(r),
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if getattr(chunk, "usage", None) is not None:
            usage_tokens = int(chunk.usage.completion_tokens)
    return StreamResult(send, times, usage_tokens if usage_tokens is not None else len(times))


async def http_single_stream(base_url: str, model: str, req: wl.Request) -> dict[str, Any]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=3600, max_retries=0)
    res = await http_stream_one(client, model, req)
    await client.close()
    out = single_stream_figures(res.send, res.chunk_times, res.tokens)
    if len(res.chunk_times) >= 2:  # chunks may carry several tokens: count tokens, not chunks
        out["decode_tok_per_s"] = round((res.tokens - 1) / (res.chunk_times[-1] - res.chunk_times[0]), 1)
    out["chunks"] = len(res.chunk_times)
    return out


async def http_online(base_url: str, model: str, reqs: list[wl.OnlineRequest]) -> dict[str, Any]:
    """Poisson arrivals, streaming: TTFT, inter-token latency, time per output token, e2e."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", timeout=7200, max_retries=0)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(http_stream_one(client, model, r, r.arrival_s) for r in reqs))
    wall = time.perf_counter() - t0
    await client.close()
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    for res in results:
        if not res.chunk_times:
            continue
        ttft.append(res.chunk_times[0] - res.send)
        e2e.append(res.chunk_times[-1] - res.send)
        itl.extend(b - a for a, b in itertools.pairwise(res.chunk_times))
        if res.tokens > 1:
            tpot.append((res.chunk_times[-1] - res.chunk_times[0]) / (res.tokens - 1))
    tokens = sum(r.tokens for r in results)
    return {
        "wall_s": round(wall, 2),
        "output_tokens": tokens,
        "lengths_exact": all(res.tokens == r.max_tokens for res, r in zip(results, reqs, strict=True)),
        "output_tok_per_s": round(tokens / wall, 1),
        "ttft_ms": dist(ttft),
        "itl_ms": dist(itl),
        "tpot_ms": dist(tpot),
        "e2e_s": dist(e2e, scale=1.0, digits=2),
    }


class HttpServer(BenchEngine):
    """An OpenAI-compatible server driven by the openai client (llama-server, vLLM, kvpilot serve)."""

    def __init__(self, name: str, server: Server, config: dict[str, Any], warm_prompt: list[int]) -> None:
        self.name, self.server, self.config, self.warm_prompt = name, server, config, warm_prompt
        self.in_rounds = name != "kvpilot_serve"
        self.model = ""

    def setup(self, record: dict[str, Any]) -> None:
        record["config"] = self.config
        t0 = time.monotonic()
        self.server.__enter__()
        record["start_s"] = round(time.monotonic() - t0, 1)  # process start until ready_path answers
        self.model = self.server.model_id()
        # one short request first: first-request costs (warm-up) stay out of the figures
        asyncio.run(http_batch(self.server.base_url, self.model, [wl.Request(0, self.warm_prompt[:32], 8)]))

    def batch(self, reqs: list[wl.Request], tag: str) -> dict[str, Any]:
        return asyncio.run(http_batch(self.server.base_url, self.model, reqs))

    def single(self, req: wl.Request) -> dict[str, Any]:
        return asyncio.run(http_single_stream(self.server.base_url, self.model, req))

    def online(self, reqs: list[wl.OnlineRequest]) -> dict[str, Any]:
        return asyncio.run(http_online(self.server.base_url, self.model, reqs))

    def close(self) -> None:
        self.server.__exit__()
