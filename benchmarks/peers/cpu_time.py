#!/usr/bin/env python
"""kvpilot's batch in one thread, timed in thread CPU time: the configurations compared on a shared machine.

Wall-clock throughput on a loaded 2-core machine measures the other tenants as much as the engine
(with OpenMP threads, a preempted thread stalls every barrier). This runs the batch of
runtime_vs_peers.py's workload (benchmarks/workload.py, seed 0) through one in-process engine per
`--quantization` value with `threads=1`, so all the work is on the calling thread, and reports
output tokens per second of that thread's CPU time (time.thread_time), plus the wall time for
reference; `--hf-dtype float32` adds transformers' generate the same way. Set the AVX2 caps to measure as on an AVX2-only CPU:

    KVPILOT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/runtime_vs_peers.py cpu-time --num-requests 16 --quantization none,int4,int8

Prints one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import workload as wl

from kvpilot.runtime.engine.build import build_engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-range", default="32,256", help="prompt lengths, inclusive")
    ap.add_argument("--output-range", default="32,64", help="output lengths, inclusive")
    ap.add_argument(
        "--quantization",
        default="none,int4,int8",
        help="comma list: none, int8, int4, auto, each optionally +float, +int16, +bf16 or +int8 "
        "(--qmatmul-activations); `default`: EngineConfig's defaults (no --quantization, no "
        "--qmatmul-activations)",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument(
        "--hf-dtype",
        default="",
        help="comma list (float32, bfloat16): also transformers' generate in these dtypes, one thread, "
        "static batches of --max-num-seqs with left padding (runtime_vs_peers.py's adapter)",
    )
    args = ap.parse_args()

    import torch

    from kvpilot.kernels import isa
    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    gguf = wl.smollm2_gguf()
    lo_p, hi_p = map(int, args.prompt_range.split(","))
    lo_o, hi_o = map(int, args.output_range.split(","))
    reqs = wl.make_requests(args.num_requests, (lo_p, hi_p), (lo_o, hi_o), 0, wl.corpus_token_ids(str(gguf)))
    for q in args.quantization.split(","):
        method, _, acts = q.partition("+")
        settings: dict[str, object] = {}
        if method != "default":
            settings["quantization"] = method
        if acts:
            settings["qmatmul_activations"] = acts
        cfg = EngineConfig(
            model=str(gguf),
            device="cpu",
            dtype=args.dtype,
            threads=1,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=2048,
            kv_cache_memory=2**30,
            **settings,  # type: ignore[arg-type]
        )
        engine = build_engine(cfg)
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.generate([reqs[0].prompt_ids[:32]], greedy)  # warm-up: kernels built and loaded
        for r in reqs:
            engine.add_request(
                f"{q}-{r.index}",
                r.prompt_ids,
                SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
            )
        c0, w0 = time.thread_time(), time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
        out = sum(r.max_tokens for r in reqs)
        row = {
            "quantization": q,
            "dtype": str(next(engine.runner.model.parameters()).dtype),
            "kernel_isa": isa.selected(),
            "aten_isa": torch.backends.cpu.get_cpu_capability(),
            "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
            "requests": len(reqs),
            "output_tokens": out,
            "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
            "thread_cpu_s": round(cpu, 2),
            "wall_s": round(wall, 2),
            "output_tok_per_cpu_s": round(out / cpu, 2),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(row), flush=True)
        del engine
    for name in filter(None, args.hf_dtype.split(",")):
        from peers.engine_hf import load_hf, run_hf_batch

        torch.set_num_threads(1)
        model = load_hf(gguf, getattr(torch, name))
        run_hf_batch(model, [wl.Request(0, reqs[0].prompt_ids[:32], 4)], 1, 2)  # warm-up
        c0 = time.thread_time()
        res = run_hf_batch(model, reqs, args.max_num_seqs, 2)
        cpu = time.thread_time() - c0
        out = res["output_tokens"]
        hf_row = {
            "engine": "transformers",
            "dtype": name,
            "aten_isa": torch.backends.cpu.get_cpu_capability(),
            "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
            "requests": len(reqs),
            "output_tokens": out,
            "thread_cpu_s": round(cpu, 2),
            "wall_s": res["wall_s"],
            "output_tok_per_cpu_s": round(out / cpu, 2),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(hf_row), flush=True)
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
