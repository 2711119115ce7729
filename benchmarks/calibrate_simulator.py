"""Measure the kvpilot runtime and fit the fleet simulator's replica model to it; then check the fit by
replaying Poisson arrivals through the real engine and through the simulator.

    python benchmarks/calibrate_simulator.py [--model roofline|linear] [--threads 1] [--max-num-seqs 32]
        [--kv-cache-memory 256MiB] [--out FILE] [--validate-seconds 90] [--validate-with serve|engine]

1. Step times of the real engine (`build_engine(EngineConfig(...))`, SmolLM2 on CPU or --device cuda, prefix
   caching off, EOS ignored): decode-only steps at batch sizes 1..max_num_seqs (context 256; the
   largest batch is prefilled once and aborted down to each smaller size), prefill steps of 64..2048
   tokens, and steps mixing 8 decodes with a prefill. A least-squares fit (relative error) gives the
   simulator's step model:
   - `--model roofline` (default; benchmarks/calibration/smollm2-cpu-roofline.json): the roofline's
     terms with attention's quadratic one, `step = overhead + per_seq x decoding + per_token x prefill
     + per_pair x attention (query, key) pairs` (a decoding sequence's pairs are its context, a
     prefill chunk's n x (cached + (n + 1) / 2)); on a CPU one core does the reads and the FLOPs, so
     the terms add (Calibration.attn_s_per_token_pair with no memory term: max(0, compute) = compute);
   - `--model linear` (benchmarks/calibration/smollm2-cpu.json): without the pairs term.
2. num_kv_blocks, block_size and kv_bytes_per_token (the KV geometry: what a P/D pull moves per token) from
   the engine; startup_s = `kvpilot serve` start to /ready 200
   (median of 3; a real pod adds scheduling and image pull on top).
3. Validation: open-loop Poisson arrivals at two rates in real time through a real `kvpilot serve`
   (streaming /v1/completions with token-id prompts and ignore_eos, the same engine settings;
   `--validate-with engine` replays through the in-process engine instead), TTFT per request and
   output tokens/s over the replay; the same requests through the simulator (one replica, the fitted
   calibration); TTFT percentiles, throughput and the simulator's error side by side.

Writes the calibration JSON (kvpilot.autoscaler.calibration.Calibration fields) and prints one JSON
document with every measurement, the fit's residuals and the machine (load average included: the
machine may be shared, and a busy moment shows as slower steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # a shared machine: never spin (runtime_vs_peers.py)

import numpy as np

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import StaticPolicy
from kvpilot.autoscaler.simulator import simulate
from kvpilot.autoscaler.trace import TraceRequest
from kvpilot.runtime.engine.build import build_engine

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = {
    "roofline": HERE / "calibration" / "smollm2-cpu-roofline.json",
    "linear": HERE / "calibration" / "smollm2-cpu.json",
}
CONTEXT = 256  # decode points are taken at this context length (attention cost grows with it; the
# simulator's step model has no context term, see the docs)


def _engine(args: argparse.Namespace) -> Any:
    from kvpilot.runtime.config import EngineConfig

    cfg = EngineConfig(
        device=args.device,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=False,
        seed=0,
    )
    return build_engine(cfg)


def _params(max_tokens: int) -> Any:
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Ids:
    """Deterministic prompt token ids (content does not change a step's cost)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def __call__(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(100, self.vocab - 100, size=n)]


def _clear(engine: Any) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.requests.clear()


_counter = [0]


def _rid() -> str:
    _counter[0] += 1
    return f"cal-{_counter[0]}"


def _timed_step(engine: Any) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure_decode(engine: Any, ids: Ids, batches: list[int], context: int, steps: int) -> dict[int, float]:
    """Decode-only step time at each batch size: prefill the largest batch once, then abort
    sequences down to each smaller size (one prefill pass in all; contexts grow by a few tokens)."""
    largest = max(batches)
    rids = [_rid() for _ in range(largest)]
    for rid in rids:
        engine.add_request(rid, ids(context), _params(10 * steps * len(batches) + 16))
    seqs = [engine.requests[r].seq for r in rids]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    engine.step()  # first pure decode step (warm)
    out: dict[int, float] = {}
    for b in sorted(batches, reverse=True):
        while len(rids) > b:
            engine.abort(rids.pop())
        out[b] = statistics.median(_timed_step(engine) for _ in range(steps))
        log(f"decode batch {b}: {out[b] * 1000:.1f} ms/step")
    _clear(engine)
    return out


def measure_mixed(
    engine: Any, ids: Ids, decoding: int, prefills: list[int], context: int
) -> dict[int, float]:
    """Steps with `decoding` sequences decoding plus one new prompt of each size."""
    rids = [_rid() for _ in range(decoding)]
    for rid in rids:
        engine.add_request(rid, ids(context), _params(256))
    seqs = [engine.requests[r].seq for r in rids]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        engine.step()
    engine.step()
    out: dict[int, float] = {}
    for p in prefills:
        rid = _rid()
        engine.add_request(rid, ids(p), _params(1))
        out[p] = _timed_step(engine)
        engine.abort(rid)
        log(f"decode {decoding} + prefill {p}: {out[p] * 1000:.1f} ms")
    _clear(engine)
    return out


def measure_prefill(engine: Any, ids: Ids, tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        rid = _rid()
        engine.add_request(rid, ids(tokens), _params(1))
        times.append(_timed_step(engine))
        _clear(engine)
    log(f"prefill {tokens}: {statistics.median(times) * 1000:.1f} ms")
    return statistics.median(times)


def attn_pairs(decoding: int, prefill: int, context: int) -> float:
    """Attention (query, key) pairs of a step: each decoding sequence's context, and a fresh prefill
    chunk's n (n + 1) / 2 (the step-time model's attn_pairs, as slo.py and the simulator count them)."""
    return decoding * context + prefill * (prefill + 1) / 2.0


def fit(points: list[tuple[int, int, float]], model: str) -> tuple[tuple[float, ...], list[float]]:
    """Least squares of step time on (1, decoding, prefill tokens[, attention pairs]) with relative
    residuals (weights 1/t): the coefficients (overhead, per seq, per token[, per pair]) and residuals."""
    cols = (
        (lambda d, p: [1.0, d, p, attn_pairs(d, p, CONTEXT)])
        if model == "roofline"
        else (lambda d, p: [1.0, d, p])
    )
    a = np.array([cols(d, p) for d, p, _ in points])
    t = np.array([s for _, _, s in points])
    w = 1.0 / t  # relative error: small steps matter as much as big ones
    coef, *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    coef = np.maximum(coef, 0.0)
    pred = a @ coef
    return tuple(float(c) for c in coef), [float(x) for x in (pred - t) / t]


def measure_startup(args: argparse.Namespace, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = time.monotonic()
        argv = [
            sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--device", args.device, "--threads", str(args.threads),
            "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", str(args.kv_cache_memory),
        ]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.1)
                if time.monotonic() - t0 > 300:
                    raise RuntimeError("kvpilot serve did not become ready in 300 s")
            out.append(time.monotonic() - t0)
        finally:
            proc.terminate()
            proc.wait(30)
    return out


def serve_argv(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--device", args.device, "--threads", str(args.threads),
        "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", str(args.kv_cache_memory),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--no-enable-prefix-caching",
        "--max-queue-len", "100000",
    ]  # fmt: skip


def start_serve(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], int]:
    """A real `kvpilot serve` with the measured engine's settings, once /ready answers 200."""
    from kvpilot.net import free_port

    port = free_port()
    proc = subprocess.Popen(serve_argv(args, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            proc.kill()
            raise RuntimeError("kvpilot serve did not become ready in 300 s")


def replay_http(port: int, ids: Ids, reqs: list[TraceRequest]) -> list[tuple[float, float]]:
    """Open-loop, real time, through the server: each request is a streaming /v1/completions POST
    (token-id prompt, max_tokens = its output, ignore_eos) sent at its arrival time from its own
    thread; (TTFT, finish) per request, seconds from its arrival."""
    import threading

    prompts = [ids(r.prompt_tokens) for r in reqs]
    results: list[tuple[float, float] | None] = [None] * len(reqs)
    t0 = time.monotonic() + 0.5

    def one(i: int) -> None:
        r = reqs[i]
        time.sleep(max(0.0, t0 + r.t - time.monotonic()))
        arrival = time.monotonic()
        body = json.dumps(
            {"prompt": prompts[i], "max_tokens": r.output_tokens, "ignore_eos": True, "stream": True,
             "temperature": 0.0}
        ).encode()  # fmt: skip
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        first = None
        with urllib.request.urlopen(req, timeout=3600) as resp:
            for line in resp:
                if first is None and line.startswith(b"data: {"):
                    first = time.monotonic() - arrival
        if first is None:
            raise RuntimeError(f"request {i}: no streamed token")
        results[i] = (first, time.monotonic() - arrival)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(reqs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if any(x is None for x in results):
        raise RuntimeError("a replayed request failed")
    return [x for x in results if x is not None]


def poisson_requests(rate: float, seconds: float, seed: int) -> list[TraceRequest]:
    """Chat-like but short enough for one CPU replica: log-normal prompt (median 128) and output (48)."""
    rng = np.random.default_rng(seed)
    t, out = 0.0, list[TraceRequest]()
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= seconds:
            return out
        prompt = int(np.clip(rng.lognormal(np.log(128), 0.7), 16, 1024))
        output = int(np.clip(rng.lognormal(np.log(48), 0.6), 4, 256))
        out.append(TraceRequest(round(t, 3), prompt, output))


def replay(engine: Any, ids: Ids, reqs: list[TraceRequest]) -> tuple[list[float], float]:
    """Open-loop, real time: each request is added at its arrival time; TTFT per request (s) and the
    makespan (first arrival to last finish, s)."""
    prompts = [ids(r.prompt_tokens) for r in reqs]
    t0 = time.monotonic()
    i = 0
    started: list[tuple[Any, float]] = []  # (sequence, arrival): the engine forgets finished requests
    while i < len(reqs) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(reqs) and reqs[i].t <= now:
            rid = _rid()
            engine.add_request(rid, prompts[i], _params(reqs[i].output_tokens), arrival_time=t0 + reqs[i].t)
            started.append((engine.requests[rid].seq, t0 + reqs[i].t))
            i += 1
        if engine.has_unfinished():
            engine.step()
        elif i < len(reqs):
            time.sleep(max(0.0, reqs[i].t - (time.monotonic() - t0)))
    makespan = time.monotonic() - t0 - reqs[0].t
    ttft = [float(seq.first_token_time) - arrival for seq, arrival in started]
    _clear(engine)
    return ttft, makespan


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(np.ceil(q * len(s))) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    return {k: round(pct(values, q), 3) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))} | {
        "mean": round(statistics.fmean(values), 3)
    }


def shown_path(path: Path) -> str:
    """A path for the printed record: relative to the repository when inside it, so a measurements
    file saved in the repository names no machine's folders."""
    resolved = path.resolve()
    return str(resolved.relative_to(HERE.parent)) if resolved.is_relative_to(HERE.parent) else str(path)


def main() -> None:
    from kvpilot.runtime.cli import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("256MiB"))
    parser.add_argument("--model", choices=("roofline", "linear"), default="roofline")
    parser.add_argument("--out", help="calibration file to write (default: by --model, see above)")
    parser.add_argument("--validate-with", choices=("serve", "engine"), default="serve")
    parser.add_argument("--rates", default="0.5,0.85", help="validation rates, fractions of capacity")
    parser.add_argument("--validate-seconds", type=float, default=90.0)
    parser.add_argument("--startup-runs", type=int, default=3)
    args = parser.parse_args()

    load0 = os.getloadavg()
    engine = _engine(args)
    ids = Ids(49152)  # SmolLM2's vocabulary
    measure_decode(engine, ids, [2], 32, 2)  # warm up (kernel build, allocator)
    log(f"engine up: {engine.runner.num_blocks} KV blocks")

    points: list[tuple[int, int, float]] = []
    decode = measure_decode(engine, ids, sorted({1, 2, 4, 8, 16, args.max_num_seqs}), CONTEXT, steps=6)
    points += [(b, 0, t) for b, t in decode.items()]
    prefill = {
        p: measure_prefill(engine, ids, p, repeats=2)
        for p in (64, 256, 1024, 2048)
        if p <= args.max_num_batched_tokens
    }
    points += [(0, p, t) for p, t in prefill.items()]
    mixed = {f"8+{p}": t for p, t in measure_mixed(engine, ids, 8, [256, 1024], CONTEXT).items()}
    points += [(8, int(k.split("+")[1]), t) for k, t in mixed.items()]
    coef, residuals = fit(points, args.model)
    overhead, per_seq, per_token = coef[:3]
    per_pair = coef[3] if args.model == "roofline" else 0.0
    num_blocks = int(engine.runner.num_blocks)
    block_size = int(engine.block_manager.block_size)
    load1 = os.getloadavg()

    startup = measure_startup(args, args.startup_runs)
    log(f"startup: {startup}")
    cal = Calibration(
        step_overhead_s=round(overhead, 6),
        decode_s_per_seq=round(per_seq, 7),
        prefill_s_per_token=round(per_token, 8),
        attn_s_per_token_pair=per_pair,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        # the engine's KV geometry (K and V of every layer, storage dtype): what a P/D pull moves per token
        kv_bytes_per_token=float(engine.runner.geometry.bytes_per_token),
        startup_s=round(statistics.median(startup), 1),
        source=(
            f"measured by benchmarks/calibrate_simulator.py ({args.model} model): kvpilot runtime, "
            f"SmolLM2-135M (builtin) on "
            f"{args.device}, {args.threads} thread(s), {platform.processor() or platform.machine()}, "
            f"load average {load0[0]:.1f}, {time.strftime('%Y-%m-%d')}"
        ),
    )

    validation = []
    # Requests/s one replica sustains at the replay's mix (128-token prompts, 48-token outputs), from
    # the fitted model: a prompt's prefill plus its share of full-batch decode steps.
    b = args.max_num_seqs
    capacity = 1.0 / (
        cal.step_seconds(0, 128, 128, attn_pairs(0, 128, 0)) - cal.step_overhead_s
        + cal.step_seconds(b, 0, b * 150, attn_pairs(b, 0, 150)) / b * 48
    )  # fmt: skip
    server = start_serve(args) if args.validate_with == "serve" else None
    try:
        for frac in (float(x) for x in args.rates.split(",")):
            rate = round(frac * capacity, 3)
            reqs = poisson_requests(rate, args.validate_seconds, seed=int(frac * 100))
            log(f"validation at {rate} req/s: {len(reqs)} requests over {args.validate_seconds:g} s")
            load = os.getloadavg()
            if server is not None:
                timed = replay_http(server[1], ids, reqs)
                real = [ttft for ttft, _ in timed]
                makespan = max(r.t + done for r, (_, done) in zip(reqs, timed, strict=True)) - reqs[0].t
            else:
                real, makespan = replay(engine, ids, reqs)
            out_tokens = sum(r.output_tokens for r in reqs)
            sim = simulate(
                reqs, StaticPolicy(1), replace(cal, startup_s=0.0, max_queue_len=100_000),
                slo_ttft_s=2.0, warmup_s=0.0, sync_interval_s=3600.0,
            )  # fmt: skip
            sim_d = sim.to_dict()
            real_tput = out_tokens / makespan
            sim_tput = out_tokens / (sim.last_finish_s - reqs[0].t)
            real_p50 = pct(real, 0.5)
            validation.append(
                {
                    "rate_rps": rate,
                    "fraction_of_estimated_capacity": frac,
                    "requests": len(reqs),
                    "replayed_through": "kvpilot serve" if server is not None else "in-process engine",
                    "load_average_1m_at_start": round(load[0], 2),
                    "real_ttft_s": summary(real),
                    "simulated_ttft_s": {
                        "p50": sim_d["ttft_p50_s"],
                        "p95": sim_d["ttft_p95_s"],
                        "p99": sim_d["ttft_p99_s"],
                    },
                    "ttft_p50_error": round((sim_d["ttft_p50_s"] - real_p50) / real_p50, 3),
                    "real_output_tokens_s": round(real_tput, 2),
                    "simulated_output_tokens_s": round(sim_tput, 2),
                    "throughput_error": round((sim_tput - real_tput) / real_tput, 3),
                    "real_slo_2s": round(sum(1 for x in real if x <= 2.0) / len(real), 4),
                    "simulated_slo_2s": sim_d["slo_attainment"],
                }
            )
            log(f"validation: {validation[-1]}")
    finally:
        if server is not None:
            server[0].terminate()
            server[0].wait(60)

    out_path = Path(args.out or DEFAULT_OUT[args.model])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(cal.to_dict(), indent=2) + "\n")
    print(
        json.dumps(
            {
                "calibration": cal.to_dict(),
                "written_to": shown_path(out_path),
                "fit": {
                    "points": [{"decoding": d, "prefill": p, "step_s": round(s, 5)} for d, p, s in points],
                    "relative_residuals": [round(r, 3) for r in residuals],
                },
                "decode_step_s_by_batch": {str(k): round(v, 5) for k, v in decode.items()},
                "prefill_step_s_by_tokens": {str(k): round(v, 5) for k, v in prefill.items()},
                "startup_s_runs": [round(x, 2) for x in startup],
                "validation": validation,
                "machine": {
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "load_average_before": [round(x, 2) for x in load0],
                    "load_average_after_steps": [round(x, 2) for x in load1],
                    "load_average_end": [round(x, 2) for x in os.getloadavg()],
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
