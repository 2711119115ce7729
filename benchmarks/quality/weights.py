#!/usr/bin/env python
"""Weight-only quantization (`--quantization`): quality, weight memory and single-stream decode speed.

For each configuration (model dtype x quantization x LM head) in one run, SmolLM2 by default:
- perplexity on the docstrings of Python's standard library (quality/kv_cache.py's text and harness),
  and its change against the first configuration;
- bytes the linear layers' weights take (quantized: packed weights + scales + mins);
- single-stream greedy decode tokens/s (one 64-token prompt, --decode-tokens new tokens, EOS ignored;
  the prefill is timed separately and taken out).
Prints one JSON document with the CPU (model name, the ISA level the kernels use, its flags).
`--lm-head quantized,float`: with `float`, a quantized configuration also runs the way it did before
the LM head was quantized and GGUF blocks were kept (load_model(keep_gguf_blocks=False,
quantize_head=False): every tensor dequantized at load, linear layers quantized, the LM head and
embedding left in the model dtype).

    python benchmarks/runtime_quality.py weights --dtype bfloat16 --methods none,int8,int4
    python benchmarks/runtime_quality.py weights --dtype bfloat16 --methods none,int8,int4 --lm-head float,quantized
    KVPILOT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/runtime_quality.py weights --dtype float32,bfloat16 --methods none --tokens 0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see runtime_vs_peers.py

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import harness

from kvpilot.kernels import isa, qlinear, switches
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.load.loader import load_model
from kvpilot.runtime.load.quantization import linear_layers
from quality.kv_cache import perplexity, stdlib_docstrings


def linear_bytes(engine: LLMEngine) -> int:
    total = 0
    for _, m in linear_layers(engine.runner.model):
        if m.qweight is not None:
            total += m.qweight.nbytes
        elif m.weight is not None:
            total += m.weight.numel() * m.weight.element_size()
    return total


def decode_tok_s(engine: LLMEngine, prompt: list[int], n: int) -> float:
    def run(k: int) -> float:
        t0 = time.perf_counter()
        engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True))
        return time.perf_counter() - t0

    run(4)  # warm-up
    best = min(run(n) - run(1) for _ in range(2))
    return (n - 1) / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", help="comma list of model dtypes")
    ap.add_argument("--methods", default="none,int8,int4", help="comma list: none, int8, int4")
    ap.add_argument("--group-size", type=int, default=32, help="int4 group size")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens scored for perplexity (0: skip)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument(
        "--score-chunk",
        type=int,
        default=qlinear.SMALL_M,
        help="prefill chunk when scoring (default qlinear.SMALL_M: every matmul takes the decode kernel, "
        "int8 activations included; 128+ measures the dequantizing prefill path)",
    )
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lm-head", default="quantized", help="comma list: quantized, float (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    text = stdlib_docstrings()
    rows: list[dict[str, Any]] = []
    base: float | None = None
    runs = [
        (dtype, method, head)
        for dtype in args.dtype.split(",")
        for method in args.methods.split(",")
        for head in (["float"] if method == "none" else args.lm_head.split(","))
    ]
    for dtype, method, head in runs:
        cfg = EngineConfig(
            model=args.model,
            dtype=dtype,  # type: ignore[arg-type]
            quantization=None if method == "none" else method,  # type: ignore[arg-type]
            quantization_group_size=args.group_size,  # type: ignore[arg-type]
            kv_cache_memory=256 * 2**20,
            threads=args.threads,
        )
        quantized_head = head == "quantized"
        loaded = load_model(cfg, "cpu", dtype, keep_gguf_blocks=quantized_head, quantize_head=quantized_head)
        engine = engine_from_loaded(loaded, cfg)
        ids = engine.tokenizer.encode(text)
        row: dict[str, Any] = {
            "dtype": dtype,
            "quantization": method,
            "group_size": args.group_size if method == "int4" else None,
            "lm_head": "int8" if loaded.model.lm_head.qweight is not None else dtype,  # type: ignore[union-attr]
            "linear_weight_mib": round(linear_bytes(engine) / 2**20, 1),
        }
        if args.tokens:
            t0 = time.perf_counter()
            ppl = perplexity(engine, ids[: args.tokens], args.window, args.score_chunk)
            row["perplexity"] = round(ppl, 4)
            row["perplexity_seconds"] = round(time.perf_counter() - t0, 1)
            if base is None:
                base = ppl
            row["perplexity_change_pct"] = round(100 * (ppl / base - 1), 3)
        row["decode_tok_s"] = round(decode_tok_s(engine, ids[:64], args.decode_tokens), 2)
        row["load_avg"] = [round(x, 2) for x in os.getloadavg()]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        del engine, loaded
    flags = sorted(f for f in isa.cpu_features() if f.startswith(("avx", "amx", "fma", "f16c")))
    print(
        json.dumps(
            {
                "benchmark": "weight_quant",
                "machine": {
                    "cpu": harness.cpu_model(),
                    "flags": flags,
                    "kernel_isa": isa.selected(),
                    "qmatmul_activations": switches.current().qmatmul_activations,
                    "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", "default"),
                    "threads": args.threads,
                    "torch": torch.__version__,
                },
                "settings": vars(args) | {"text": "stdlib docstrings (quality/kv_cache.py)"},
                "results": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
