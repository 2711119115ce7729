#!/usr/bin/env python
"""What GPTQ act-order (desc_act) costs here, and how long converting a layer at load takes.

An act-order GPTQ layer runs as x[..., perm] @ W[:, perm]^T (runtime/load/quant_formats.py): the
quantized matmul is the same, plus one gather of the layer's input. For the linear layers of one
decoder layer of SmolLM2-135M (group 32) and of a Llama-2-7B-sized model (group 128), this times the
matmul with and without that gather at 1, 8 and 64 rows (1 row: the C kernel; 64: dequantize +
torch), and the gathers alone (the two matmul timings differ by machine noise more than by the gather) and the conversion of one layer's qweight/qzeros/scales/g_idx into a QuantizedWeight.
Prints one JSON document with the CPU.

    python benchmarks/kernels_bench.py act-order [--repeat 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import harness
import torch

from kvpilot.kernels import isa, qlinear
from kvpilot.runtime.load import quant_formats
from kvpilot.runtime.load.quant_formats import CheckpointQuantization

# name -> (GPTQ group size, [(out, in)] of the fused layers of one decoder layer: qkv, o, gate_up, down);
# SmolLM2's width 576 takes groups of 32 or 64, not 128
SHAPES = {
    "smollm2-135m": (32, [(960, 576), (576, 576), (3072, 576), (576, 1536)]),
    "llama-2-7b": (128, [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]),
}


def gptq_tensors(n: int, k: int, group: int, seed: int) -> dict[str, torch.Tensor]:
    """Random 4-bit GPTQ tensors of an act-order layer (random g_idx order, v2 zeros)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(k, generator=g)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    return {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=g),
        "qzeros": torch.randint(-(2**31), 2**31 - 1, (k // group, n // 8), dtype=torch.int32, generator=g),
        "scales": (torch.rand(k // group, n, generator=g) / 100).half(),
        "g_idx": g_idx,
    }


def timed(fn: Any, repeat: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,8,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for model, (group, shapes) in SHAPES.items():
        cq = CheckpointQuantization("gptq", 4, group, True, True, "gptq_v2")
        layers = []
        for i, (n, k) in enumerate(shapes):
            tensors = gptq_tensors(n, k, group, i)
            start = time.perf_counter()
            qw, perm = quant_formats.convert_gptq(f"{model}.{i}", tensors, cq)
            convert_s = time.perf_counter() - start
            assert perm is not None
            layers.append((qw, perm, convert_s))
        per_rows = {}
        for rows in map(int, args.rows.split(",")):
            repeat = (
                max(5, args.repeat // rows) if model == "smollm2-135m" else max(3, args.repeat // (10 * rows))
            )
            plain = gather = alone = 0.0
            for qw, perm, _ in layers:
                x = torch.randn(rows, qw.in_features)
                plain += timed(lambda x=x, qw=qw: qlinear.matmul(x, qw), repeat)
                gather += timed(lambda x=x, qw=qw, p=perm: qlinear.matmul(x.index_select(-1, p), qw), repeat)
                alone += timed(lambda x=x, p=perm: x.index_select(-1, p), 1000)
            per_rows[str(rows)] = {
                "decoder_layer_ms": round(plain * 1e3, 4),
                "with_act_order_gather_ms": round(gather * 1e3, 4),
                "gathers_alone_ms": round(alone * 1e3, 4),
                "gathers_alone_pct": round(100 * alone / plain, 3),
            }
        results[model] = {
            "group_size": group,
            "by_rows": per_rows,
            "convert_decoder_layer_s": round(sum(c for *_, c in layers), 4),
        }
    print(
        json.dumps(
            {
                "cpu": harness.cpu_model(),
                "isa": isa.selected(),
                "threads": args.threads,
                "format": "GPTQ 4-bit act-order -> int4 of the same group + input gather",
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
