#!/usr/bin/env python
"""The quantized Triton matmul (kernels/triton_qlinear.py) at decode row counts, on a GPU.

For each linear layer shape of a Llama-3.1-8B-shaped model (qkv, o, gate_up, down) and each method
(int4 group 32, int8 per channel: what `--quantization` makes), at M = 1 and 16 rows of bfloat16
activations, it times: torch's bfloat16 matmul on the dequantized weight (the unquantized path's
speed), the tile kernel (`qmatmul_tiles`, what decode took before the split-K kernel) and the split-K
decode kernel (`qgemv`) with its picked configuration (triton_qlinear.DECODE) and a few others. Each result is
checked against the dequantized matmul. Figures: microseconds per call (triton.testing.do_bench) and
the weight bytes read per second, so the quantized kernels compare with bfloat16 at its 4x / 2x the
bytes. `--tiny` runs small shapes under Triton's interpreter on the CPU (the test's smoke run).

    python benchmarks/micro/triton_qmatmul.py [--out FILE] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvpilot.kernels import qlinear, triton_qlinear
from kvpilot.kernels.triton_qlinear import DecodeConfig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TINY_SHAPES = {"o": (96, 256)}
CONFIGS = {  # the first is the dataclass's plain default; DECODE (per bit width) is timed as "picked"
    "n64_kb64": DecodeConfig(),
    "kb128": DecodeConfig(block_kb=128),
    "n32": DecodeConfig(block_n=32),
    "n128w8": DecodeConfig(block_n=128, num_warps=8),
    "stages2": DecodeConfig(num_stages=2),
    "programs528": DecodeConfig(target_programs=528),
    "kb128_p528": DecodeConfig(block_kb=128, target_programs=528),
}
METHODS: dict[str, Callable[[torch.Tensor], qlinear.QuantizedWeight]] = {
    "int4": lambda w: qlinear.quantize_int4(w, 32),
    "int8": qlinear.quantize_int8,
}


def time_us(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50)) * 1e3
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(
    method: str, n: int, k: int, m: int, device: torch.device, configs: dict[str, DecodeConfig]
) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn(n, k, device=device, generator=gen) * 0.02
    qw = METHODS[method](w)
    dense = qw.dequantize(torch.bfloat16)
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    want = F.linear(x.float(), dense.float())
    tol = 2e-2 * float(want.abs().max())
    row: dict[str, Any] = {"method": method, "n": n, "k": k, "m": m, "weight_bytes": qw.nbytes}
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "bf16_dense": lambda: F.linear(x, dense),
        "tiles": lambda: triton_qlinear.qmatmul_tiles(x, qw),
    }
    calls["splitk_picked"] = lambda: triton_qlinear.qgemv(x, qw)
    for name, cfg in configs.items():
        calls[f"splitk_{name}"] = lambda cfg=cfg: triton_qlinear.qgemv(x, qw, None, cfg)
    for name, fn in calls.items():
        err = float((fn().float() - want).abs().max())
        us = time_us(fn, device)
        nbytes = dense.numel() * 2 if name == "bf16_dense" else qw.nbytes
        row[name] = {"us": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1), "ok": err <= tol}
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (Triton's interpreter)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --tiny for the CPU smoke run)")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    configs = {"small": DecodeConfig(block_n=32, block_kb=32, target_programs=8)} if args.tiny else CONFIGS
    rows = [
        measure(method, n, k, m, device, configs)
        for method in METHODS
        for (n, k) in shapes.values()
        for m in (1, 16)
    ]
    layers = 1 if args.tiny else 32
    summary: dict[str, Any] = {}
    for method in METHODS:
        for m in (1, 16):
            picked = [r for r in rows if r["method"] == method and r["m"] == m]
            names = [key for key in picked[0] if isinstance(picked[0][key], dict)]
            summary[f"{method} m={m}"] = {  # a token's linear layers: the sum over shapes x layers, in ms
                name: round(sum(r[name]["us"] for r in picked) * layers / 1e3, 3) for name in names
            }
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
        "rows": rows,
        "per_token_ms": summary,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    for key, cells in summary.items():
        print(key + ": " + ", ".join(f"{name} {ms} ms" for name, ms in cells.items()))
    bad = [(r["method"], r["n"], r["k"], r["m"], name) for r in rows for name, c in r.items()
           if isinstance(c, dict) and not c["ok"]]  # fmt: skip
    if bad:
        print(f"WRONG RESULTS: {bad}")
    return result


if __name__ == "__main__":
    main()
