"""The measuring half of runtime_vs_peers.py: the machine (harness.machine() and torch), the model's shape and
FLOPs, the matmul peak of this CPU, phases that record the machine's state around each measurement,
percentiles, and the `BenchEngine` interface every engine adapter implements.

Import it after OMP_WAIT_POLICY is set (runtime_vs_peers.py does that first): it imports torch.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
import torch
import workload as wl

HERE = harness.HERE  # benchmarks/
BUILD_DIR = HERE / ".build"


# ---------------------------------------------------------------------------------------------
# Machine, model shape, FLOPs


def machine_info() -> dict[str, Any]:
    """harness.machine() plus what the runtime figures depend on: torch, its threads, the packages."""
    info = harness.machine()
    info.update(
        {
            "kvpilot_git": info["git_commit"],
            "torch": torch.__version__,
            "torch_parallel": torch.__config__.parallel_info().splitlines()[-1].strip(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "mkldnn_bf16": bool(getattr(torch.backends.mkldnn, "is_available", lambda: False)()),
        }
    )
    for pkg in ("transformers", "gguf", "openai", "kvpilot"):
        try:
            import importlib.metadata as md

            info[pkg] = md.version(pkg)
        except Exception:
            info[pkg] = None
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "runtime", "kernels"],
            cwd=harness.ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        info["kvpilot_runtime_uncommitted_changes"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        info["kvpilot_runtime_uncommitted_changes"] = None
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


READ_SOURCE = Path(__file__).with_name("read_bandwidth.c")
READ_PREFETCH_BYTES = (0, 4096, 16384)  # the probe's prefetch distances: the best is the ceiling


def read_bandwidth(threads: int, nbytes: int = 1 << 30, rounds: int = 5) -> dict[str, Any]:
    """Bytes/s a read-only stream over `nbytes` reaches on `threads` threads (read_bandwidth.c: each
    thread its contiguous share, 64 bytes a step; the best of `rounds` passes at each prefetch distance
    of READ_PREFETCH_BYTES). A batch-1 decode step's ceiling: it reads its weights and writes nothing
    of their size, which a copy's read + write rate overstates on a CPU whose few cores bound the
    misses in flight. Built with the runtime's own C toolchain and ISA flags (kernels/cbuild.py)."""
    import ctypes

    from kvpilot.kernels import cbuild, isa

    flags = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", *isa.flags_for(isa.selected())]
    lib = ctypes.CDLL(str(cbuild.build(READ_SOURCE, flags)))
    fn = lib.kvpilot_bench_read
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_double
    n = nbytes // (64 * threads) * 64 * threads
    buf = torch.ones(n, dtype=torch.uint8)  # written: every page is mapped before the timing
    sink = ctypes.c_uint64(0)
    by_prefetch = {
        str(pf): round(n / fn(buf.data_ptr(), n, threads, pf, rounds, ctypes.byref(sink)) / 1e9, 2)
        for pf in READ_PREFETCH_BYTES
    }
    if sink.value != n // 8 * 0x0101010101010101 % 2**64:  # the sum of the words read, mod 2^64
        raise RuntimeError(f"read_bandwidth.c read {sink.value:#x}, not the buffer's sum")
    del buf
    return {
        "threads": threads,
        "bytes": n,
        "gb_s_by_prefetch_bytes": by_prefetch,
        "read_gb_s": max(by_prefetch.values()),
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


# ---------------------------------------------------------------------------------------------
# Engines under test and how their parts are measured


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


def set_up(engines: list[BenchEngine], records: dict[str, Any]) -> list[BenchEngine]:
    """Each engine's setup() with its record in records[name]; the ones that came up (a failure is
    recorded under errors.setup and the others go on)."""
    ready: list[BenchEngine] = []
    for e in engines:
        rec = records.setdefault(e.name, {})
        log(f"{e.name}: setting up")
        try:
            e.setup(rec)
            ready.append(e)
        except Exception as exc:
            rec.setdefault("errors", {})["setup"] = f"{type(exc).__name__}: {exc}"
            log(f"{e.name} setup failed: {exc!r}")
    return ready


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
