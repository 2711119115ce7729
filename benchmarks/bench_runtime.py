#!/usr/bin/env python
"""kvpilot runtime vs Hugging Face transformers and llama.cpp's server, on CPU, in one run.

Prints one JSON document: the machine (CPU model, bf16/AMX flags, cores, load average, versions), the
configuration each engine ran with, and the figures:

* batched throughput: N requests submitted at once (prompts 32..512 tokens of real English text,
  outputs 64..512 tokens, EOS ignored so lengths are exact). kvpilot runs offline (`LLMEngine`) and,
  when `kvpilot serve` starts, over HTTP too; HF `generate` runs static batches of 32 with left
  padding (only requested tokens count as useful output); llama-server runs 32 slots with continuous
  batching behind the same OpenAI client as kvpilot serve.
* the fraction of the machine's matmul peak (same-shape torch matmuls in kvpilot's dtype, measured in
  this run) that kvpilot's batched run reaches in model FLOPs.
* single-stream decode tokens/s for every engine.
* TTFT / inter-token latency percentiles of an online run with Poisson arrivals over HTTP (streaming,
  openai client) against `kvpilot serve` and llama-server.

Usage:
    python benchmarks/bench_runtime.py --engines kvpilot,hf,llamacpp --num-requests 128
    python benchmarks/bench_runtime.py --quick          # small smoke run
llama-server comes from benchmarks/build_llamacpp.sh (built once, cached in benchmarks/.build/).
The machine may be shared: every phase records the load average and a short matmul probe
(`cpu_probe_gflops`) taken right before it, so figures from a noisy moment can be recognised.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.net import free_port

# OpenMP threads that spin while they wait for work are a disaster on a shared 2-core machine: a
# barrier waits for a descheduled sibling every op (HF decode step 3.2 s active vs 0.12 s passive at
# load 10). It must be in the environment before torch (libgomp) loads, so it is read from argv here.


def _omp_wait_policy(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a.startswith("--omp-wait-policy="):
            return a.split("=", 1)[1]
        if a == "--omp-wait-policy" and i + 1 < len(argv):
            return argv[i + 1]
    return os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


os.environ["OMP_WAIT_POLICY"] = _omp_wait_policy(sys.argv)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as wl  # noqa: E402

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / ".build"
RESULTS_DIR = HERE / "results"
DEFAULT_LLAMACPP_VERSION = "0.3.36"
ALL_ENGINES = ("kvpilot", "hf", "llamacpp")

TARGETS = {
    "kvpilot_vs_hf_throughput": {"min": 2.0, "aim": 3.0},
    "kvpilot_vs_llamacpp_throughput": {"min": 1.5},
    "kvpilot_matmul_peak_fraction": {"aim": 0.5},
}


# ---------------------------------------------------------------------------------------------
# Machine, model shape, FLOPs


def machine_info() -> dict[str, Any]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = "unknown"
    flags: set[str] = set()
    cores: set[tuple[str, str]] = set()
    phys = core = ""
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key == "model name" and model == "unknown":
            model = val
        elif key == "flags" and not flags:
            flags = set(val.split())
        elif key == "physical id":
            phys = val
        elif key == "core id":
            core = val
            cores.add((phys, core))
    mem_gib = None
    if Path("/proc/meminfo").exists():
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    interesting = (
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "avx512_fp16",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    )
    info: dict[str, Any] = {
        "cpu_model": model,
        "flags": {f: f in flags for f in interesting},
        "logical_cpus": os.cpu_count(),
        "physical_cores": len(cores) or None,
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": mem_gib,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_parallel": torch.__config__.parallel_info().splitlines()[-1].strip(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "mkldnn_bf16": bool(getattr(torch.backends.mkldnn, "is_available", lambda: False)()),
    }
    for pkg in ("transformers", "gguf", "openai", "kvpilot"):
        try:
            import importlib.metadata as md

            info[pkg] = md.version(pkg)
        except Exception:
            info[pkg] = None
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True
        )
        info["kvpilot_git"] = rev.stdout.strip() or None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "runtime", "kernels"],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
        )
        info["kvpilot_runtime_uncommitted_changes"] = bool(dirty.stdout.strip())
    except OSError:
        info["kvpilot_git"] = None
    return info


@dataclass(frozen=True)
class ModelDims:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_linears(self) -> list[tuple[str, int, int]]:
        """(name, out_features, in_features) of one decoder layer's matmuls (fused as kvpilot fuses)."""
        kv = self.kv_heads * self.head_dim
        return [
            ("qkv_proj", self.hidden + 2 * kv, self.hidden),
            ("o_proj", self.hidden, self.hidden),
            ("gate_up_proj", 2 * self.ffn, self.hidden),
            ("down_proj", self.hidden, self.ffn),
        ]

    @property
    def layer_params(self) -> int:
        return self.layers * sum(o * i for _, o, i in self.layer_linears())

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden


def model_dims(gguf_path: Path) -> ModelDims:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    arch = str(reader.fields["general.architecture"].contents())

    def get(key: str) -> int:
        return int(reader.fields[f"{arch}.{key}"].contents())

    vocab_field = reader.fields.get(f"{arch}.vocab_size")
    vocab = (
        int(vocab_field.contents()) if vocab_field else len(reader.fields["tokenizer.ggml.tokens"].contents())
    )
    return ModelDims(
        layers=get("block_count"),
        hidden=get("embedding_length"),
        ffn=get("feed_forward_length"),
        heads=get("attention.head_count"),
        kv_heads=get("attention.head_count_kv"),
        vocab=vocab,
    )


def model_flops(reqs: list[wl.Request], dims: ModelDims) -> dict[str, float]:
    """Useful model FLOPs of running `reqs` to completion once (no padding, no recomputation).

    Every token that enters the model (the prompt and all outputs but the last) costs 2 * layer params;
    every sampled token costs the LM head; attention costs 2 * 2 * heads * head_dim per (query, key)
    pair under the causal mask.
    """
    fed = 0
    sampled = 0
    pairs = 0
    for r in reqs:
        n = r.prompt_len + r.max_tokens - 1
        fed += n
        sampled += r.max_tokens
        pairs += n * (n + 1) // 2
    linear = 2.0 * dims.layer_params * fed
    head = 2.0 * dims.lm_head_params * sampled
    attn = 4.0 * dims.layers * dims.heads * dims.head_dim * pairs
    return {
        "tokens_fed": fed,
        "tokens_sampled": sampled,
        "linear_flops": linear,
        "lm_head_flops": head,
        "attention_flops": attn,
        "total_flops": linear + head + attn,
    }


def cpu_probe(seconds: float = 0.4) -> float:
    """GFLOP/s of a small fp32 matmul loop right now: how much CPU this process is getting."""
    a = torch.randn(256, 576)
    b = torch.randn(1536, 576)
    torch.nn.functional.linear(a, b)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.nn.functional.linear(a, b)
        n += 1
    dt = time.perf_counter() - t0
    return round(2 * 256 * 576 * 1536 * n / dt / 1e9, 1)


def _best_rate(fn: Callable[[], object], flop: float, seconds: float, repeats: int = 5) -> float:
    """Best GFLOP/s of `fn` over `repeats` windows of `seconds / repeats` (a peak, robust to noise)."""
    return round(flop / wl.best_seconds(fn, seconds, repeats) / 1e9, 1)


def matmul_peak(
    dims: ModelDims, dtype: torch.dtype, token_counts: list[int], seconds: float
) -> dict[str, Any]:
    """FLOP/s of the model's own matmul shapes ([T x in] @ [in x out], as F.linear) at T tokens per step.

    For each T, one decoder layer's four matmuls run back to back (best of 5 windows); the LM head is
    timed at 128 rows. The peak is the best of these: what this CPU gives these shapes in `dtype`.
    """
    shapes = dims.layer_linears()
    weights = [torch.randn(o, i).to(dtype) for _, o, i in shapes]
    flop_per_t = 2 * sum(o * i for _, o, i in shapes)
    by_tokens: dict[str, float] = {}
    with torch.inference_mode():
        for t in token_counts:
            xs = {i: torch.randn(t, i).to(dtype) for _, _, i in shapes}

            def layer(xs: dict[int, torch.Tensor] = xs) -> None:
                for w in weights:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

            by_tokens[str(t)] = _best_rate(layer, flop_per_t * t, seconds)
        head_t = 128
        head_w = torch.randn(dims.vocab, dims.hidden).to(dtype)
        head_x = torch.randn(head_t, dims.hidden).to(dtype)
        head = _best_rate(
            lambda: torch.nn.functional.linear(head_x, head_w), 2 * dims.vocab * dims.hidden * head_t, seconds
        )
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "layer_matmuls_gflops_by_tokens_per_step": by_tokens,
        f"lm_head_gflops_at_{head_t}_rows": head,
        "peak_gflops": max([*by_tokens.values(), head]),
    }


@contextmanager
def phase(record: dict[str, Any], name: str, probe: bool = True) -> Iterator[dict[str, Any]]:
    """Time a phase and note the machine's state around it."""
    gc.collect()
    entry: dict[str, Any] = {"load_avg_before": [round(x, 2) for x in os.getloadavg()]}
    if probe:
        entry["cpu_probe_gflops_before"] = cpu_probe()
    t0 = time.perf_counter()
    try:
        yield entry
    finally:
        entry["phase_wall_s"] = round(time.perf_counter() - t0, 2)
        entry["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
        record.setdefault("phases", {})[name] = entry


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def dist(values: list[float], scale: float = 1000.0, digits: int = 1) -> dict[str, float | None]:
    """p50/p90/p99/mean (in ms by default)."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x * scale, digits)

    return {
        "p50": r(pct(values, 0.5)),
        "p90": r(pct(values, 0.9)),
        "p99": r(pct(values, 0.99)),
        "mean": r(statistics.fmean(values)) if values else None,
        "n": len(values),
    }


# ---------------------------------------------------------------------------------------------
# kvpilot offline (LLMEngine)


def kvpilot_config(args: argparse.Namespace, gguf_path: Path) -> dict[str, Any]:
    return {
        "model": str(gguf_path),
        "device": "cpu",
        "dtype": args.kvpilot_dtype,
        "threads": args.threads,
        "max_num_seqs": args.kvpilot_max_num_seqs,
        "max_num_batched_tokens": args.kvpilot_max_batched_tokens,
        "kv_cache_memory": int(args.kvpilot_kv_gib * 2**30),
        "enable_prefix_caching": True,
        "quantization": args.kvpilot_quantization,
    }


def load_kvpilot(args: argparse.Namespace, gguf_path: Path) -> Any:
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine import LLMEngine

    return LLMEngine.from_config(EngineConfig(**kvpilot_config(args, gguf_path)))


def kvpilot_params(max_tokens: int) -> Any:
    from kvpilot.runtime.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_kvpilot_batch(engine: Any, reqs: list[wl.Request], prefix: str) -> dict[str, Any]:
    s0 = engine.stats()
    seqs = []
    t0 = time.perf_counter()
    for r in reqs:
        rid = f"{prefix}-{r.index}"
        engine.add_request(rid, r.prompt_ids, kvpilot_params(r.max_tokens))
        seqs.append(engine.requests[rid].seq)
    step_s: list[float] = []
    while engine.has_unfinished():
        ts = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - ts)
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    got = sum(len(s.output_token_ids) for s in seqs)
    want = sum(r.max_tokens for r in reqs)
    ttft = [s.first_token_time - s.arrival_time for s in seqs if s.first_token_time is not None]
    return {
        "wall_s": round(wall, 2),
        "output_tokens": got,
        "output_tokens_expected": want,
        "lengths_exact": all(
            len(s.output_token_ids) == r.max_tokens for s, r in zip(seqs, reqs, strict=True)
        ),
        "output_tok_per_s": round(got / wall, 1),
        "total_tok_per_s": round((got + sum(r.prompt_len for r in reqs)) / wall, 1),
        "steps": s1.num_steps - s0.num_steps,
        "step_ms": dist(step_s),
        "prompt_tokens_computed": s1.prompt_tokens - s0.prompt_tokens,
        "prefix_cache_hit_tokens": s1.prefix_cache_hits - s0.prefix_cache_hits,
        "preemptions": s1.num_preemptions - s0.num_preemptions,
        "ttft_s": dist(ttft, scale=1.0, digits=2),
    }


def kvpilot_single_stream(engine: Any, req: wl.Request) -> dict[str, Any]:
    rid = "single"
    engine.add_request(rid, req.prompt_ids, kvpilot_params(req.max_tokens))
    seq = engine.requests[rid].seq
    times: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        n = len(seq.output_token_ids)
        engine.step()
        if len(seq.output_token_ids) > n:
            times.append(time.perf_counter())
    return single_stream_figures(t0, times, len(seq.output_token_ids))


def single_stream_figures(t0: float, token_times: list[float], n_tokens: int) -> dict[str, Any]:
    if len(token_times) < 2:
        return {"error": "fewer than 2 tokens"}
    decode = (len(token_times) - 1) / (token_times[-1] - token_times[0])
    gaps = [b - a for a, b in itertools.pairwise(token_times)]
    return {
        "output_tokens": n_tokens,
        "ttft_ms": round((token_times[0] - t0) * 1000, 1),
        "decode_tok_per_s": round(decode, 1),
        "itl_ms": dist(gaps),
    }


def engine_matmul_dtype(engine: Any) -> torch.dtype:
    for p in engine.runner.model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers


def load_hf(gguf_path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model = model.to(dtype).eval()
    # never stop early: lengths come from max_new_tokens only (the equivalent of ignore_eos)
    model.generation_config.eos_token_id = None
    return model


class _TimingStreamer:
    """A transformers streamer that only records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate_batch(
    model: Any, batch: list[wl.Request], pad_id: int, streamer: Any = None
) -> tuple[int, float]:
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
        mask[i, width - r.prompt_len :] = 1
    new = max(r.max_tokens for r in batch)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=None,
            streamer=streamer,
        )
    dt = time.perf_counter() - t0
    generated = int(out.shape[1] - width)
    if generated != new:
        raise RuntimeError(f"HF generated {generated} tokens, expected {new}")
    return generated * len(batch), dt


def hf_pick_dtype(
    gguf_path: Path, pad_id: int, reqs: list[wl.Request]
) -> tuple[torch.dtype, dict[str, float]]:
    """Time a small batch in fp32 and bf16; the faster one is the fastest HF configuration here."""
    probe = [wl.Request(i, r.prompt_ids[:64], 16) for i, r in enumerate(reqs[:8])]
    times: dict[str, float] = {}
    for dt in (torch.float32, torch.bfloat16):
        model = load_hf(gguf_path, dt)
        hf_generate_batch(model, probe[:2], pad_id)  # warm up
        _, t = hf_generate_batch(model, probe, pad_id)
        times[str(dt).removeprefix("torch.")] = round(t, 2)
        del model
        gc.collect()
    best = torch.bfloat16 if times["bfloat16"] < times["float32"] else torch.float32
    return best, times


# ---------------------------------------------------------------------------------------------
# HTTP servers (llama-server, kvpilot serve) and the OpenAI client


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
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            wait_http(f"http://127.0.0.1:{self.port}{self.ready_path}", self.proc, timeout=600)
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


def llamacpp_binary(version: str, explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    path = BUILD_DIR / f"llama.cpp-{version}" / "bin" / "llama-server"
    if not path.exists():
        print(f"building llama-server {version} (benchmarks/build_llamacpp.sh) ...", file=sys.stderr)
        subprocess.run(["bash", str(HERE / "build_llamacpp.sh"), version], check=True, stdout=sys.stderr)
    return path


def llamacpp_server(args: argparse.Namespace, gguf_path: Path, binary: Path) -> Server:
    port = free_port()
    argv = [
        str(binary),
        "-m",
        str(gguf_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.llamacpp_threads or args.threads),
        "-tb",
        str(args.llamacpp_threads or args.threads),
        "-np",
        str(args.llamacpp_slots),
        "-c",
        str(args.llamacpp_slots * args.llamacpp_ctx_per_slot),
        "-b",
        "2048",
        "-ub",
        str(args.llamacpp_ubatch),
        "--cont-batching",
        "--no-webui",
        *args.llamacpp_extra.split(),
    ]
    return Server("llamacpp", argv, port, "/health", BUILD_DIR / "logs" / "llama-server.log")


def kvpilot_server(args: argparse.Namespace, gguf_path: Path) -> Server:
    port = free_port()
    cfg = kvpilot_config(args, gguf_path)
    argv = [
        sys.executable,
        "-m",
        "kvpilot",
        "serve",
        cfg["model"],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        cfg["dtype"],
        "--threads",
        str(cfg["threads"]),
        "--max-num-seqs",
        str(cfg["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(cfg["max_num_batched_tokens"]),
        "--kv-cache-memory",
        str(cfg["kv_cache_memory"]),
        *(["--quantization", cfg["quantization"]] if cfg["quantization"] else []),
        "--max-model-len",
        "2048",
        "--log-level",
        "warning",
    ]
    return Server("kvpilot-serve", argv, port, "/ready", BUILD_DIR / "logs" / "kvpilot-serve.log")


def completion_body(r: wl.Request) -> dict[str, Any]:
    """Extra request fields both servers understand: exact lengths, greedy."""
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


# ---------------------------------------------------------------------------------------------
# Engines: set up once, then measured (in rounds, rotating the order, when --rounds > 1)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BenchEngine:
    """One engine under test: `setup()` once, then `batch()` / `single()` as often as asked."""

    name = "engine"
    in_rounds = True  # part of the round-robin comparison (kvpilot serve runs its parts once)

    def setup(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def batch(self, reqs: list[wl.Request], tag: str) -> dict[str, Any]:
        raise NotImplementedError

    def single(self, req: wl.Request) -> dict[str, Any]:
        raise NotImplementedError

    def online(self, reqs: list[wl.OnlineRequest]) -> dict[str, Any]:
        raise NotImplementedError("offline engine")

    def close(self) -> None:
        pass


class KvpilotOffline(BenchEngine):
    name = "kvpilot"

    def __init__(self, args: argparse.Namespace, gguf_path: Path, warm_prompt: list[int]) -> None:
        self.args, self.gguf_path, self.warm_prompt = args, gguf_path, warm_prompt
        self.engine: Any = None

    def setup(self, record: dict[str, Any]) -> None:
        self.engine = load_kvpilot(self.args, self.gguf_path)
        dtype = str(engine_matmul_dtype(self.engine)).removeprefix("torch.")
        record["config"] = {
            **kvpilot_config(self.args, self.gguf_path),
            "resolved_dtype": dtype,
            "attention_backend": getattr(self.engine.runner.backend, "name", None),
            "transport": "in-process LLMEngine (add_request + step)",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }
        self.engine.generate([self.warm_prompt[:32]], kvpilot_params(8))  # warm up

    def batch(self, reqs: list[wl.Request], tag: str) -> dict[str, Any]:
        return run_kvpilot_batch(self.engine, reqs, tag)

    def single(self, req: wl.Request) -> dict[str, Any]:
        return kvpilot_single_stream(self.engine, req)

    def close(self) -> None:
        self.engine = None
        gc.collect()


class HFGenerate(BenchEngine):
    name = "hf"

    def __init__(self, args: argparse.Namespace, gguf_path: Path, probe_reqs: list[wl.Request]) -> None:
        self.args, self.gguf_path, self.probe_reqs = args, gguf_path, probe_reqs
        self.model: Any = None
        self.pad_id = 2

    def setup(self, record: dict[str, Any]) -> None:
        if self.args.hf_dtype == "auto":
            dtype, probe = hf_pick_dtype(self.gguf_path, self.pad_id, self.probe_reqs)
            record["dtype_probe_s"] = probe
        else:
            dtype = getattr(torch, self.args.hf_dtype)
        self.model = load_hf(self.gguf_path, dtype)
        record["config"] = {
            "dtype": str(dtype).removeprefix("torch."),
            "threads": self.args.threads,
            "batch_size": self.args.hf_batch_size,
            "padding": "left",
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "loaded_from": f"from_pretrained(dir, gguf_file={self.gguf_path.name!r}) (dequantized)",
            "transport": "in-process model.generate, static batches in submission order, greedy",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }
        hf_generate_batch(self.model, [wl.Request(0, self.probe_reqs[0].prompt_ids[:32], 4)], self.pad_id)

    def batch(self, reqs: list[wl.Request], tag: str) -> dict[str, Any]:
        return run_hf_batch(self.model, reqs, self.args.hf_batch_size, self.pad_id)

    def single(self, req: wl.Request) -> dict[str, Any]:
        return hf_single_stream(self.model, req, self.pad_id)

    def close(self) -> None:
        self.model = None
        gc.collect()


class HttpServer(BenchEngine):
    """An OpenAI-compatible server driven by the openai client (llama-server, kvpilot serve)."""

    def __init__(self, name: str, server: Server, config: dict[str, Any], warm_prompt: list[int]) -> None:
        self.name, self.server, self.config, self.warm_prompt = name, server, config, warm_prompt
        self.in_rounds = name != "kvpilot_serve"
        self.model = ""

    def setup(self, record: dict[str, Any]) -> None:
        record["config"] = self.config
        self.server.__enter__()
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


def measure(record: dict[str, Any], key: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """Run one part inside a phase; a failure is recorded instead of losing the other figures."""
    with phase(record, key):
        try:
            return fn()
        except Exception as exc:
            record.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"
            log(f"{key} failed: {exc!r}")
            return None


def keep_best(record: dict[str, Any], key: str, results: list[dict[str, Any] | None], metric: str) -> None:
    """record[key] = the best round by `metric` (contention only ever slows an engine down)."""
    ok = [r for r in results if r and r.get(metric)]
    if not ok:
        return
    values = [r[metric] for r in ok]
    best = max(ok, key=lambda r: r[metric])
    record[key] = {**best, "rounds": values, "median_of_rounds": round(statistics.median(values), 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ALL_ENGINES), help="comma list of kvpilot,hf,llamacpp")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small smoke run (few, short requests)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the batch and single-stream parts, rotating the engine order; report the best round",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--omp-wait-policy",
        default=os.environ["OMP_WAIT_POLICY"],
        choices=["PASSIVE", "ACTIVE"],
        help="OpenMP idle threads sleep (PASSIVE, default: best on a shared machine) or spin",
    )
    p.add_argument(
        "--skip",
        default="",
        help="comma list of parts to skip: batch,single,online,peak,serve (kvpilot serve),serve-batch",
    )
    p.add_argument("--online-requests", type=int, default=24)
    p.add_argument("--online-rate", type=float, default=0.1, help="Poisson arrival rate (requests/s)")
    p.add_argument("--single-prompt", type=int, default=128)
    p.add_argument("--single-output", type=int, default=256)
    p.add_argument("--kvpilot-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--kvpilot-quantization", default=None, choices=["int8", "int4", "auto"], help="--quantization"
    )
    p.add_argument("--kvpilot-max-num-seqs", type=int, default=128)
    p.add_argument("--kvpilot-max-batched-tokens", type=int, default=2048)
    p.add_argument("--kvpilot-kv-gib", type=float, default=2.0)
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--llamacpp-version", default=DEFAULT_LLAMACPP_VERSION)
    p.add_argument("--llamacpp-bin", default=None, help="use this llama-server instead of building one")
    p.add_argument("--llamacpp-threads", type=int, default=None, help="default: --threads")
    p.add_argument("--llamacpp-slots", type=int, default=32)
    p.add_argument("--llamacpp-ctx-per-slot", type=int, default=1024)
    p.add_argument("--llamacpp-ubatch", type=int, default=512)
    p.add_argument("--llamacpp-extra", default="", help="extra llama-server flags")
    p.add_argument("--output", default=None, help="also write the JSON here (default benchmarks/results/)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
        args.online_requests = min(args.online_requests, 4)
        args.online_rate = 1.0
        args.single_prompt, args.single_output = 32, 32
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [e for e in args.engines.split(",") if e]
    unknown = set(names) - set(ALL_ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines: {sorted(unknown)} (choose from {', '.join(ALL_ENGINES)})")
    skip = {s for s in args.skip.split(",") if s}
    torch.set_num_threads(args.threads)
    gguf_path = wl.smollm2_gguf()
    dims = model_dims(gguf_path)
    prompt_range, output_range = ((32, 96), (16, 48)) if args.quick else ((32, 512), (64, 512))
    corpus = wl.corpus_token_ids(str(gguf_path))
    reqs = wl.make_requests(args.num_requests, prompt_range, output_range, args.seed, corpus)
    online = wl.make_online_requests(
        args.online_requests, args.online_rate, prompt_range, output_range, args.seed + 1, corpus
    )

    def round_requests(r: int) -> list[wl.Request]:
        """Round r: the same lengths on different text (nothing a prefix cache could reuse)."""
        return wl.make_requests(args.num_requests, prompt_range, output_range, args.seed, corpus, r)

    def round_single(r: int) -> wl.Request:
        start = 1000 + r * (args.single_prompt + 64)
        return wl.Request(0, corpus[start : start + args.single_prompt], args.single_output)

    single = round_single(0)
    flops = model_flops(reqs, dims)
    warm = corpus[-64:]  # warm-up text that no measured prompt starts with

    doc: dict[str, Any] = {
        "benchmark": "kvpilot runtime vs HF transformers vs llama.cpp server (CPU)",
        "command": " ".join(
            ["python benchmarks/bench_runtime.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "model": {"gguf": gguf_path.name, "dims": dims.__dict__, "layer_params": dims.layer_params},
        "workload": {
            "seed": args.seed,
            "batch": {**wl.summarize(reqs), "prompt_range": prompt_range, "output_range": output_range},
            "online": {**wl.summarize(online), "rate_per_s": args.online_rate},
            "single_stream": {"prompt_tokens": single.prompt_len, "output_tokens": single.max_tokens},
            "text": "token windows of stdlib docstrings (benchmarks/workload.py); EOS ignored; greedy",
            "model_flops_batch": flops,
        },
        "rounds": args.rounds,
        "engines": {},
    }
    res: dict[str, Any] = doc["engines"]

    engines: list[BenchEngine] = []
    if "kvpilot" in names:
        engines.append(KvpilotOffline(args, gguf_path, warm))
    if "hf" in names:
        engines.append(HFGenerate(args, gguf_path, reqs))
    if "llamacpp" in names:
        try:
            binary = llamacpp_binary(args.llamacpp_version, args.llamacpp_bin)
            srv = llamacpp_server(args, gguf_path, binary)
            rel = binary.is_relative_to(HERE.parent)
            cfg = {
                "llama_cpp_python_sdist": args.llamacpp_version,
                "binary": str(binary.relative_to(HERE.parent)) if rel else str(binary),
                "argv": srv.argv[1:],
                "weights": "the same GGUF (Q4_1), run quantized",
                "transport": "llama-server /v1/completions, openai client (same requests as kvpilot serve)",
            }
            engines.append(HttpServer("llamacpp", srv, cfg, warm))
        except Exception as exc:
            res["llamacpp"] = {"errors": {"setup": f"{type(exc).__name__}: {exc}"}}
            log(f"llama.cpp unavailable: {exc!r}")

    ready: list[BenchEngine] = []
    for e in engines:
        rec = res.setdefault(e.name, {})
        log(f"{e.name}: setting up")
        try:
            e.setup(rec)
            ready.append(e)
        except Exception as exc:
            rec.setdefault("errors", {})["setup"] = f"{type(exc).__name__}: {exc}"
            log(f"{e.name} setup failed: {exc!r}")

    # -- the comparison: every engine per round, order rotated so none always goes first ----------
    batch_rounds: dict[str, list[dict[str, Any] | None]] = {e.name: [] for e in ready}
    single_rounds: dict[str, list[dict[str, Any] | None]] = {e.name: [] for e in ready}
    for r in range(args.rounds):
        order = ready[r % len(ready) :] + ready[: r % len(ready)] if ready else []
        for e in order:
            rec = res[e.name]
            if "batch" not in skip:
                log(f"{e.name}: batch (round {r + 1}/{args.rounds})")
                batch_rounds[e.name].append(
                    measure(
                        rec, f"batch_round{r + 1}", functools.partial(e.batch, round_requests(r), f"b{r}")
                    )
                )
            if "single" not in skip:
                log(f"{e.name}: single stream (round {r + 1}/{args.rounds})")
                single_rounds[e.name].append(
                    measure(rec, f"single_stream_round{r + 1}", functools.partial(e.single, round_single(r)))
                )
    for e in ready:
        keep_best(res[e.name], "batch", batch_rounds[e.name], "output_tok_per_s")
        keep_best(res[e.name], "single_stream", single_rounds[e.name], "decode_tok_per_s")

    # -- kvpilot: how much of the machine's matmul peak the best batch round reached -------------
    kv = next((e for e in ready if isinstance(e, KvpilotOffline)), None)
    if kv is not None and "peak" not in skip and "batch" in res["kvpilot"]:
        log("kvpilot: matmul peak")
        b = res["kvpilot"]["batch"]
        mean_tokens = max(1, round(flops["tokens_fed"] / max(1, b["steps"])))
        counts = sorted({16, 64, 128, 256, 512, 1024, 2048, mean_tokens})
        kv_dtype = engine_matmul_dtype(kv.engine)
        other = torch.float32 if kv_dtype != torch.float32 else torch.bfloat16
        secs = 0.3 if args.quick else 1.0
        rec = res["kvpilot"]
        with phase(rec, "matmul_peak"):
            peak = matmul_peak(dims, kv_dtype, counts, secs)
            rec["matmul_peak_other_dtype"] = matmul_peak(dims, other, counts, secs)
        achieved = flops["total_flops"] / b["wall_s"] / 1e9
        rec["matmul_peak"] = peak
        rec["mfu"] = {
            "model_gflops_per_s": round(achieved, 1),
            "mean_tokens_per_step": mean_tokens,
            "peak_gflops": peak["peak_gflops"],
            "fraction_of_peak": round(achieved / peak["peak_gflops"], 3),
            "fraction_of_same_step_size": round(
                achieved / peak["layer_matmuls_gflops_by_tokens_per_step"][str(mean_tokens)], 3
            ),
        }
    for e in ready:
        if e.name != "llamacpp":  # in-process engines go before the servers' online runs
            e.close()

    # -- kvpilot serve over HTTP: batch once, single stream, online ------------------------------
    if "kvpilot" in names and "serve" not in skip and not skip >= {"batch", "single", "online"}:
        srv = kvpilot_server(args, gguf_path)
        cfg = {
            "argv": srv.argv[1:],
            "transport": "kvpilot serve /v1/completions, openai client (same requests as llama-server)",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }
        serve = HttpServer("kvpilot_serve", srv, cfg, warm)
        rec = res.setdefault("kvpilot_serve", {})
        log("kvpilot serve: starting")
        try:
            serve.setup(rec)
        except Exception as exc:
            rec.setdefault("errors", {})["setup"] = f"{type(exc).__name__}: {exc}"
            log(f"kvpilot serve failed to start: {exc!r}")
        else:
            if "batch" not in skip and "serve-batch" not in skip:
                log("kvpilot serve: batch over HTTP")
                rec["batch"] = measure(rec, "batch", lambda: serve.batch(reqs, "serve"))
            if "single" not in skip:
                log("kvpilot serve: single stream over HTTP")
                rec["single_stream"] = measure(rec, "single_stream", lambda: serve.single(single))
            if "online" not in skip:
                log("kvpilot serve: online (Poisson) over HTTP")
                rec["online"] = measure(rec, "online", lambda: serve.online(online))
            serve.close()

    # -- llama-server online, then stop it ---------------------------------------------------------
    for e in ready:
        if e.name == "llamacpp":
            if "online" not in skip:
                log("llamacpp: online (Poisson) over HTTP")
                res["llamacpp"]["online"] = measure(
                    res["llamacpp"], "online", functools.partial(e.online, online)
                )
            e.close()

    doc["summary"] = summarize(res)
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(doc, indent=2)
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.output) if args.output else RESULTS_DIR / f"bench_runtime-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    log(f"wrote {out}")
    return 0


def run_hf_batch(model: Any, reqs: list[wl.Request], batch_size: int, pad_id: int) -> dict[str, Any]:
    generated = 0
    batches = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        n, dt = hf_generate_batch(model, batch, pad_id)
        generated += n
        batches.append(round(dt, 2))
    wall = time.perf_counter() - t0
    useful = sum(r.max_tokens for r in reqs)
    return {
        "wall_s": round(wall, 2),
        "output_tokens": useful,
        "generated_tokens_incl_padding_rows": generated,
        "output_tok_per_s": round(useful / wall, 1),
        "total_tok_per_s": round((useful + sum(r.prompt_len for r in reqs)) / wall, 1),
        "batch_wall_s": batches,
    }


def hf_single_stream(model: Any, req: wl.Request, pad_id: int) -> dict[str, Any]:
    streamer = _TimingStreamer()
    t0 = time.perf_counter()
    hf_generate_batch(model, [req], pad_id, streamer=streamer)
    return single_stream_figures(t0, streamer.times, len(streamer.times))


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    def fig(engine: str, part: str, key: str) -> float | None:
        v = (res.get(engine) or {}).get(part) or {}
        return v.get(key) if isinstance(v, dict) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    kv = fig("kvpilot", "batch", "output_tok_per_s")
    kv_http = fig("kvpilot_serve", "batch", "output_tok_per_s")
    hf = fig("hf", "batch", "output_tok_per_s")
    lc = fig("llamacpp", "batch", "output_tok_per_s")
    s: dict[str, Any] = {
        "batch_output_tok_per_s": {
            "kvpilot_offline": kv,
            "kvpilot_serve_http": kv_http,
            "hf_generate": hf,
            "llamacpp_server_http": lc,
        },
        "kvpilot_vs_hf_throughput": ratio(kv, hf),
        "kvpilot_vs_llamacpp_throughput": ratio(kv, lc),
        "kvpilot_serve_vs_llamacpp_throughput": ratio(kv_http, lc),
        "kvpilot_matmul_peak_fraction": fig("kvpilot", "mfu", "fraction_of_peak"),
        "single_stream_decode_tok_per_s": {
            "kvpilot_offline": fig("kvpilot", "single_stream", "decode_tok_per_s"),
            "kvpilot_serve_http": fig("kvpilot_serve", "single_stream", "decode_tok_per_s"),
            "hf_generate": fig("hf", "single_stream", "decode_tok_per_s"),
            "llamacpp_server_http": fig("llamacpp", "single_stream", "decode_tok_per_s"),
        },
        "online": {},
        "targets": TARGETS,
    }
    for e in ("kvpilot_serve", "llamacpp"):
        on = (res.get(e) or {}).get("online")
        if isinstance(on, dict) and "ttft_ms" in on:
            s["online"][e] = {
                "ttft_ms_p50_p99": [on["ttft_ms"]["p50"], on["ttft_ms"]["p99"]],
                "itl_ms_p50_p99": [on["itl_ms"]["p50"], on["itl_ms"]["p99"]],
                "tpot_ms_p50": on["tpot_ms"]["p50"],
                "output_tok_per_s": on["output_tok_per_s"],
            }
    met: dict[str, bool | None] = {}
    for key, t in TARGETS.items():
        v = s.get(key)
        met[key] = None if v is None else v >= t.get("min", t.get("aim", 0))
    s["targets_met"] = met
    return s


if __name__ == "__main__":
    raise SystemExit(main())
