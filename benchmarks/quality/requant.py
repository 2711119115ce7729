#!/usr/bin/env python
"""What loading a Q4_K_M-style file costs: its Q6_K / Q5_0 tensors requantized to int8 per 32 weights.

The kernels hold Q8_0, Q4_0, Q4_1 and Q4_K blocks as they are; every other quantized type (Q6_K,
which Q4_K_M files use for the LM head, attn_v and half the ffn_down; Q5_K, Q5_0, ...) is dequantized
at load and rounded to int8 with one float16 scale per 32 weights (runtime/load/gguf_blocks.py). This
measures that rounding on the builtin SmolLM2, in one run:

- per weight: the requantized value against gguf's dequantization of the Q6_K blocks, in Q6_K steps
  (d * sc of the weight's 16-weight sub-block), and its RMS against the RMS error of Q6_K itself;
- a Q4_K_M-style file (`write_mixed_file`: the builtin file with every ffn_down in Q6_K and the odd
  layers' attn_v in Q5_0, so their fused q/k/v mixes 4-bit and 5-bit pieces) through the default
  path (no flags) against the float32 model of the same file (`--quantization none --dtype float32`):
  teacher-forced next-token agreement and identical greedy answers (quality/dtype.py's measures),
  and the same for `--quantization none` (the weights dequantized to the model dtype: what such a
  file ran by default before the requantization).

(SmolLM2's other matrices have 576 inputs, not a multiple of Q6_K's 256-weight super-block.)

    python benchmarks/runtime_quality.py requant
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
from gguf.constants import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

Q6_K = GGMLQuantizationType.Q6_K
Q5_0 = GGMLQuantizationType.Q5_0


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [rows, K] (K % 256 == 0) -> Q6_K bytes [rows, K / 256 * 210] (ql, qh, scales, d).

    A plain quantizer: per 16-weight sub-block scale = max |w| / 31, stored as an int8 multiple
    of the super-block's d = max scale / 127; codes round(w / (d * sc)) + 32 in 0..63 (llama.cpp
    searches for better scales; the layout is the same)."""
    rows, k = w.shape
    sub = w.reshape(rows, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31.0  # [rows, nb, 16]
    d = (scale.max(-1) / 127.0).astype(np.float16)
    d32 = d.astype(np.float32)[..., None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 127)
    step = (d32 * sc)[..., None]
    q = np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(rows, k // 256, 2, 4, 32)
    ql = np.concatenate(
        [(q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4), (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)],
        axis=-1,
    )  # [rows, nb, 2 halves, 64]
    qh = (
        (q[..., 0, :] >> 4)
        | ((q[..., 1, :] >> 4) << 2)
        | ((q[..., 2, :] >> 4) << 4)
        | ((q[..., 3, :] >> 4) << 6)
    )
    blocks = np.concatenate(
        [
            ql.reshape(rows, k // 256, 128),
            qh.reshape(rows, k // 256, 64),
            sc.astype(np.int8).view(np.uint8),
            d.view(np.uint8).reshape(rows, k // 256, 2),
        ],
        axis=-1,
    )
    return blocks.reshape(rows, -1)


def q6_k_steps(raw: np.ndarray, k: int) -> np.ndarray:
    """Each weight's Q6_K step (d * sc of its sub-block), [rows, K]."""
    b = raw.reshape(raw.shape[0], k // 256, 210)
    d = b[..., 208:210].copy().view(np.float16).astype(np.float32)  # [rows, nb, 1]
    sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [rows, nb, 16]
    return np.repeat(np.abs(d * sc).reshape(raw.shape[0], -1), 16, axis=-1)


def write_mixed_file(src: Path, dst: Path) -> dict[str, str]:
    """`src` (a GGUF) rewritten with every ffn_down (inputs a multiple of 256) in Q6_K and the odd
    layers' attn_v in Q5_0, from their dequantized values; metadata and other tensors as they are.
    Returns tensor name -> the type written."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    written: dict[str, str] = {}
    for t in reader.tensors:
        data: np.ndarray = t.data
        kind = t.tensor_type
        parts = t.name.split(".")
        k = int(t.shape[0])  # GGUF lists the input dimension first
        target = None
        if parts[-2:] == ["ffn_down", "weight"] and k % 256 == 0:
            target = Q6_K
        elif parts[-2:] == ["attn_v", "weight"] and int(parts[1]) % 2 == 1:
            target = Q5_0
        if target is not None:
            w = dequantize(np.asarray(data), kind).reshape(-1, k)
            data = quantize_q6_k(w) if target == Q6_K else quantize(w, target)
            kind = target
        writer.add_tensor(t.name, np.asarray(data), raw_dtype=kind)
        written[t.name] = kind.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def weight_errors(model_path: Path) -> dict[str, float]:
    """Q6_K -> int8 rounding on the model's ffn_down weights, in Q6_K steps and RMS terms."""
    from gguf.quants import dequantize

    from kvpilot.runtime.load import gguf_blocks
    from kvpilot.runtime.load.gguf_reader import GGUFFile

    steps_off, diffs, q_errs, weights = [], [], [], []
    with GGUFFile(model_path) as f:
        for name, info in f.tensors.items():
            if not name.endswith("ffn_down.weight"):
                continue
            k = int(info.shape[-1])
            w = f.load(name).reshape(-1, k)  # the stored weights (here: Q4_1) stand for the original
            raw = quantize_q6_k(w)
            exact = dequantize(raw, Q6_K).reshape(w.shape)
            ours = gguf_blocks.requantize_int8(raw, Q6_K, k).dequantize().numpy()
            step = q6_k_steps(raw, k)
            diff = ours - exact
            steps_off.append(np.abs(diff)[step > 0] / step[step > 0])
            diffs.append(diff.ravel())
            q_errs.append((exact - w).ravel())
            weights.append(w.ravel())
    rms = lambda x: float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))  # noqa: E731
    diff_all, q_all, w_all = np.concatenate(diffs), np.concatenate(q_errs), np.concatenate(weights)
    return {
        "weights": int(w_all.size),
        "max_diff_in_q6_k_steps": float(np.concatenate(steps_off).max()),
        "mean_diff_in_q6_k_steps": float(np.concatenate(steps_off).mean()),
        "rms_diff_over_rms_q6_k_error": rms(diff_all) / rms(q_all),
        "rms_diff_over_rms_weight": rms(diff_all) / rms(w_all),
    }


def main() -> int:
    from harness import cpu_model

    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path
    from quality import dtype as dtype_quality
    from tests.runtime.quality import agreement, same_answers

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="", help="comma list of kernel levels (default: the native one)")
    args = ap.parse_args()
    src = resolve_model_path(DEFAULT_MODEL)
    result: dict[str, Any] = {"q6_k_to_int8": weight_errors(src)}
    with tempfile.TemporaryDirectory() as tmp:
        mixed = Path(tmp) / "mixed.gguf"
        types = write_mixed_file(src, mixed)
        result["file"] = {t: sum(1 for v in types.values() if v == t) for t in sorted(set(types.values()))}
        ref = dtype_quality.spawn("kvpilot:float32+quantization=none", Path(tmp) / "ref.json", model=mixed)
        names = ["kvpilot:auto" + (f"@{level}" if level else "") for level in args.levels.split(",")]
        for name in [*names, "kvpilot:auto+quantization=none"]:  # the last: such a file's default before
            ours = dtype_quality.spawn(name, Path(tmp) / "ours.json", model=mixed)
            result[name] = {
                "teacher_forced_agreement": agreement(ours["choices"], ref["choices"]),
                "same_answers": same_answers(ours["answers"], ref["answers"]),
                "of_answers": len(ref["answers"]),
                "quantization": ours["quantization"],
                "qmatmul_activations": ours["qmatmul_activations"],
            }
    print(
        json.dumps(
            {"benchmark": "requant_precision", "machine": {"cpu": cpu_model()}, "results": result},
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
