#!/usr/bin/env python
"""What Q4_K -> QuantizedWeight costs: float16 scales and mins instead of float32 products.

A Q4_K sub-block's scale is d * sc (float16 d times a 6-bit integer) and its min dmin * m; gguf
and llama.cpp form them in float32, kvpilot's int4 format stores them as float16
(runtime/load/gguf_blocks.py). This quantizes SmolLM2's down projections (the only linear weights whose
input size, 1536, is a multiple of Q4_K's 256-weight super-block; 576 is not) to Q4_K with a plain
min/max quantizer, then compares, in one run:
- per weight: the difference between gguf's dequantization and kvpilot's, in quantization steps
  (d * sc of its sub-block), and its RMS against the RMS error of Q4_K itself;
- perplexity (quality/kv_cache.py's text) of the float32 model with those down projections as
  gguf's exact values, and as kvpilot's converted blocks (everything else the same).
Prints JSON.

    python benchmarks/runtime_quality.py q4k --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from harness import cpu_model

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.load import gguf_blocks
from kvpilot.runtime.load.loader import load_model
from quality.kv_cache import perplexity, stdlib_docstrings

Q4_K = GGMLQuantizationType.Q4_K


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q4_K bytes [rows, K / 256 * 144]: per 32-weight
    sub-block scale = (max - min) / 15 and min = min(0, min), both as 6-bit multiples of the
    super-block's d and dmin (llama.cpp searches for better ones; this is the plain version)."""
    rows, k = w.shape
    sub = w.reshape(rows, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (-lo.min(-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63)
    m = np.clip(np.round(np.divide(-lo, dmin32, out=np.zeros_like(lo), where=dmin32 > 0)), 0, 63)
    step, base = d32 * sc, -(dmin32 * m)
    q = np.clip(np.round(np.divide(sub - base[..., None], step[..., None], out=np.zeros_like(sub),
                                   where=step[..., None] > 0)), 0, 15).astype(np.uint8)  # fmt: skip
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    packed = np.empty((rows, k // 256, 12), dtype=np.uint8)
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    qs = q.reshape(rows, k // 256, 4, 2, 32)  # sub-blocks 2i and 2i + 1 share 32 bytes
    nibbles = qs[..., 0, :] | (qs[..., 1, :] << 4)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2), packed,
         nibbles.reshape(rows, k // 256, 128)], axis=-1,
    )  # fmt: skip
    return blocks.reshape(rows, -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens scored for perplexity (0: skip)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(model=args.model, dtype="float32", kv_cache_memory=256 * 2**20, threads=args.threads)
    loaded = load_model(cfg, "cpu", torch.float32)
    model: Any = loaded.model
    downs = [layer.mlp.down_proj for layer in model.model.layers]
    steps_off, diffs, q_errs, weights, converted = [], [], [], [], []
    for mod in downs:
        w = mod.weight.detach().numpy()
        raw = quantize_q4_k(w)
        exact = dequantize(raw, Q4_K).reshape(w.shape)
        qw = gguf_blocks.to_qweight(raw, Q4_K, w.shape[1])
        ours = qw.dequantize(torch.float32).numpy()
        b = raw.reshape(w.shape[0], -1, 144)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        sc, _ = gguf_blocks.q4_k_scales_mins(b[..., 4:16])
        step = np.repeat((d * sc).reshape(w.shape[0], -1), 32, axis=-1)
        diff = ours - exact
        steps_off.append(np.abs(diff)[step > 0] / step[step > 0])
        diffs.append(diff.ravel())
        q_errs.append((exact - w).ravel())
        weights.append(w.ravel())
        mod.weight.data.copy_(torch.from_numpy(exact))  # model A: gguf's exact values, in float32
        converted.append(qw)
    diff_all, q_all, w_all = np.concatenate(diffs), np.concatenate(q_errs), np.concatenate(weights)
    rms = lambda x: float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))  # noqa: E731
    result: dict[str, Any] = {
        "weights": int(w_all.size),
        "max_diff_in_steps": float(np.concatenate(steps_off).max()),
        "rms_diff_over_rms_q4_k_error": rms(diff_all) / rms(q_all),
        "rms_diff_over_rms_weight": rms(diff_all) / rms(w_all),
        "rms_q4_k_error_over_rms_weight": rms(q_all) / rms(w_all),
    }
    if args.tokens:
        ids = loaded.tokenizer.encode(stdlib_docstrings())[: args.tokens]
        result["perplexity_gguf_float32_scales"] = perplexity(
            engine_from_loaded(loaded, cfg), ids, args.window
        )
        for mod, qw in zip(downs, converted, strict=True):  # model B: kvpilot's blocks
            mod.qweight, mod.weight = qw, None
        result["perplexity_kvpilot_float16_scales"] = perplexity(
            engine_from_loaded(loaded, cfg), ids, args.window
        )
        result["perplexity_change_pct"] = 100 * (
            result["perplexity_kvpilot_float16_scales"] / result["perplexity_gguf_float32_scales"] - 1
        )
    print(
        json.dumps(
            {
                "benchmark": "q4k_precision",
                "machine": {"cpu": cpu_model(), "threads": args.threads},
                "settings": vars(args) | {"layers": "mlp.down_proj x 30 (Q4_K), the rest float32"},
                "results": result,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
