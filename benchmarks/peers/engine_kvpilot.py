"""runtime_vs_peers.py's adapters for kvpilot: the in-process `LLMEngine` (add_request + step) and
`kvpilot serve` as a subprocess driven over HTTP (runtime_loadgen.HttpServer)."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import workload as wl
from features.speculative import spec_figures

from kvpilot.net import free_port
from kvpilot.runtime.engine.build import build_engine
from peers.loadgen import Server
from peers.measure import BUILD_DIR, BenchEngine, dist, single_stream_figures
from peers.roofline import module_weight_bytes


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
        **kvpilot_speculative_config(args),
        # --kvpilot-kv-cache-dtype (runtime_vs_peers.py and long_context.py; unset: the default cache)
        **({"kv_cache_dtype": kv} if (kv := getattr(args, "kvpilot_kv_cache_dtype", None)) else {}),
    }


def kvpilot_speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's speculative fields from --kvpilot-speculative-* (none when speculation is off)."""
    method = args.kvpilot_speculative_method
    if method is None:
        return {}
    out: dict[str, Any] = {"speculative_method": method, "num_speculative_tokens": args.kvpilot_spec_k}
    if method == "draft":
        out["speculative_model"] = args.kvpilot_speculative_model
    return out


def load_kvpilot(args: argparse.Namespace, gguf_path: Path) -> Any:
    from kvpilot.runtime.config import EngineConfig

    return build_engine(EngineConfig(**kvpilot_config(args, gguf_path)))


def kvpilot_params(max_tokens: int) -> Any:
    from kvpilot.runtime.engine.sampling_params import SamplingParams

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
    rid = f"single-{time.monotonic_ns()}"
    s0 = engine.stats()
    engine.add_request(rid, req.prompt_ids, kvpilot_params(req.max_tokens))
    seq = engine.requests[rid].seq
    times: list[float] = []
    first_count = 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        n = len(seq.output_token_ids)
        engine.step()
        if len(seq.output_token_ids) > n:
            times.append(time.perf_counter())
            first_count = first_count or len(seq.output_token_ids)
    total = len(seq.output_token_ids)
    out = single_stream_figures(t0, times, total)
    if len(times) >= 2:  # a speculative step emits several tokens: count tokens, not steps
        out["decode_tok_per_s"] = round((total - first_count) / (times[-1] - times[0]), 1)
    s1 = engine.stats()
    out["steps"] = s1.num_steps - s0.num_steps
    out.update(spec_figures(s0, s1))  # acceptance (speculation on only)
    return out


def engine_matmul_dtype(engine: Any) -> torch.dtype:
    """The dtype of the engine's matmul arithmetic (whose peak its batch is held to): bfloat16 under
    --qmatmul-activations bf16 (the default path on AVX512-BF16 CPUs: activations rounded, vdpbf16ps),
    else its parameters' dtype."""
    return torch.bfloat16 if engine.cfg.qmatmul_activations == "bf16" else engine_dtype(engine)


def engine_dtype(engine: Any) -> torch.dtype:
    """The dtype of the engine's float parameters (its activations')."""
    for p in engine.runner.model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class KvpilotOffline(BenchEngine):
    name = "kvpilot"

    def __init__(self, args: argparse.Namespace, gguf_path: Path, warm_prompt: list[int]) -> None:
        self.args, self.gguf_path, self.warm_prompt = args, gguf_path, warm_prompt
        self.engine: Any = None

    def setup(self, record: dict[str, Any]) -> None:
        self.engine = load_kvpilot(self.args, self.gguf_path)
        record["config"] = {
            **kvpilot_config(self.args, self.gguf_path),
            "resolved_dtype": str(engine_dtype(self.engine)).removeprefix("torch."),
            "matmul_dtype": str(engine_matmul_dtype(self.engine)).removeprefix("torch."),
            "attention_backend": getattr(self.engine.runner.backend, "name", None),
            "transport": "in-process LLMEngine (add_request + step)",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }
        record["decode_read"] = {  # peers/roofline.py: what a decode step reads, as kvpilot stores it
            "weight_bytes": module_weight_bytes(self.engine.runner.model),
            "kv_bytes_per_token": self.engine.runner.geometry.bytes_per_token,
        }
        self.engine.generate([self.warm_prompt[:32]], kvpilot_params(8))  # warm up

    def batch(self, reqs: list[wl.Request], tag: str) -> dict[str, Any]:
        return run_kvpilot_batch(self.engine, reqs, tag)

    def single(self, req: wl.Request) -> dict[str, Any]:
        return kvpilot_single_stream(self.engine, req)

    def close(self) -> None:
        self.engine = None
        gc.collect()


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
        *(["--speculative-method", cfg["speculative_method"]] if "speculative_method" in cfg else []),
        *(
            ["--num-speculative-tokens", str(cfg["num_speculative_tokens"])]
            if "speculative_method" in cfg
            else []
        ),
        *(["--speculative-model", cfg["speculative_model"]] if "speculative_model" in cfg else []),
        "--max-model-len",
        "2048",
        "--log-level",
        "warning",
    ]
    return Server("kvpilot-serve", argv, port, "/ready", BUILD_DIR / "logs" / "kvpilot-serve.log")
