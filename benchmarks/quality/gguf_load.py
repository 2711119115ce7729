#!/usr/bin/env python
"""Loading a quantized GGUF: peak memory and time, the file's blocks kept against dequantized.

Each configuration loads the model in a fresh process (so the peak resident set size is its own):
`--quantization` none/auto/int8/int4, with the GGUF's Q8_0/Q4_x blocks loaded as they are
(`blocks`, the default path) or every tensor dequantized to the model dtype at load and quantized
afterwards (`dequantize`, the path before: load_model(keep_gguf_blocks=False)). Reported per
configuration (best load time, and the lowest and highest peak over --repeat rounds: glibc's
allocator makes it vary from run to run): load seconds (load_model,
the tokenizer and the C kernels' first use excluded), peak RSS during the load above the RSS
before it, RSS after (and after glibc's malloc_trim hands back freed heap memory), and the bytes the linear layers and the LM head take. Prints JSON.

    python benchmarks/runtime_quality.py gguf-load --dtype bfloat16 --repeat 3
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = [("none", True), ("auto", False), ("auto", True), ("int8", False), ("int8", True)]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(model: str, dtype: str, method: str, blocks: bool, threads: int) -> dict[str, Any]:
    import torch

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.load.loader import load_model
    from kvpilot.runtime.load.quantization import linear_layers

    torch.set_num_threads(threads)
    cfg = EngineConfig(model=model, quantization=None if method == "none" else method)  # type: ignore[arg-type]
    before = rss_mib()
    t0 = time.perf_counter()
    loaded = load_model(cfg, "cpu", dtype, keep_gguf_blocks=blocks)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    model_: Any = loaded.model
    linear = sum(
        m.qweight.nbytes if m.qweight is not None else m.weight.numel() * m.weight.element_size()
        for _, m in linear_layers(model_)
    )
    head = model_.lm_head
    head_bytes = head.qweight.nbytes if head.qweight is not None else head.weight.numel() * 2
    after = rss_mib()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap memory glibc still holds goes back
    return {
        "quantization": method,
        "gguf": "blocks" if blocks else "dequantize",
        "load_s": round(seconds, 3),
        "peak_rss_above_start_mib": round(peak - before, 1),
        "peak_rss_mib": round(peak, 1),
        "rss_after_mib": round(after, 1),
        "rss_after_malloc_trim_mib": round(rss_mib(), 1),
        "rss_at_start_mib": round(before, 1),
        "linear_weights_mib": round(linear / 2**20, 1),
        "lm_head_mib": round(head_bytes / 2**20, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        method, blocks = args.child.split(":")
        print(json.dumps(child(args.model, args.dtype, method, blocks == "blocks", args.threads)))
        return 0
    best: dict[tuple[str, bool], dict[str, Any]] = {}
    for _ in range(args.repeat):
        for method, blocks in CONFIGS:
            spec = f"{method}:{'blocks' if blocks else 'dequantize'}"
            out = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--dtype", args.dtype,
                 "--threads", str(args.threads), "--child", spec],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            row = json.loads(out.stdout.strip().splitlines()[-1])
            key = (method, blocks)
            if key not in best:
                best[key] = row | {"peak_rss_above_start_mib_min": row["peak_rss_above_start_mib"]}
            else:  # glibc's allocator makes the peak vary between runs: keep the range
                b = best[key]
                b["load_s"] = min(b["load_s"], row["load_s"])
                b["peak_rss_above_start_mib_min"] = min(
                    b["peak_rss_above_start_mib_min"], row["peak_rss_above_start_mib"]
                )
                for k in (
                    "peak_rss_above_start_mib",
                    "peak_rss_mib",
                    "rss_after_mib",
                    "rss_after_malloc_trim_mib",
                ):
                    b[k] = max(b[k], row[k])
            print(json.dumps(row), file=sys.stderr)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
    from harness import cpu_model

    print(
        json.dumps(
            {
                "benchmark": "gguf_load",
                "machine": {"cpu": cpu_model(), "threads": args.threads, "load_avg": os.getloadavg()},
                "settings": vars(args),
                "results": list(best.values()),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
