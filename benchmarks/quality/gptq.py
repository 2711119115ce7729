#!/usr/bin/env python
"""GPTQ and AWQ checkpoints of SmolLM2 at full size: load time, weight memory, quality, decode speed.

The builtin SmolLM2 GGUF is read by transformers (float32), its linear layers quantized with a plain
min/max quantizer (no calibration: the GPTQ/AWQ search changes values, not the format) and packed in
each format (runtime/load/quant_pack.py, as tests/runtime/test_gptq_awq.py packs them), and written as Hugging Face
directories next to the 16-bit one. Each directory is then served by kvpilot with `--quantization`
unset (the checkpoint's own), beside the 16-bit directory plain and with `--quantization int4`, and
measured like benchmarks/quality/weights.py: perplexity on the stdlib docstrings, the bytes the linear
weights take, single-stream greedy decode tokens/s, and the seconds load_model took. Prints JSON.

    python benchmarks/runtime_quality.py gptq [--dtype bfloat16] [--threads 2] [--workdir /tmp/gptq-smollm2]
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
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import harness

from kvpilot.kernels import isa
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.load.loader import builtin_model_path, load_model
from kvpilot.runtime.load.quant_formats import parse_quantization_config
from kvpilot.runtime.load.quant_pack import PROJECTIONS, quantize_layer
from quality.kv_cache import perplexity, stdlib_docstrings
from quality.weights import decode_tok_s, linear_bytes

# name -> quantization_config (act_order: groups formed in decreasing column-norm order)
FORMATS: dict[str, dict[str, Any]] = {
    "gptq-4bit-g32-sym": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "sym": True,
        "desc_act": False,
    },
    "gptq-4bit-g32-asym-act-order": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "sym": False,
        "desc_act": True,
    },
    "gptq-8bit-per-channel-sym": {
        "quant_method": "gptq",
        "bits": 8,
        "group_size": -1,
        "sym": True,
        "desc_act": False,
    },
    "awq-4bit-g32": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    },
}


def quantize(w: torch.Tensor, qc: dict[str, Any], importance: torch.Tensor) -> dict[str, torch.Tensor]:
    """Min/max quantization of W [N, K] in qc's format -> the layer's checkpoint tensors; with
    desc_act, groups follow decreasing `importance` of the input features (GPTQ: the Hessian
    diagonal, which layers sharing an input share)."""
    cq = parse_quantization_config(qc)
    order = torch.argsort(importance, descending=True, stable=True) if cq.desc_act else None
    return quantize_layer(w, cq, order)[0]


def input_importance(state: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """A stand-in for the Hessian diagonal without calibration data: the norm weight in front of
    q/k/v (input_layernorm) and gate/up (post_attention_layernorm), else the layer's column norms."""
    layer, _, proj = module.rpartition(".")
    block = layer.rpartition(".")[0]  # model.layers.N
    if proj in ("q_proj", "k_proj", "v_proj"):
        return state[f"{block}.input_layernorm.weight"].abs()
    if proj in ("gate_proj", "up_proj"):
        return state[f"{block}.post_attention_layernorm.weight"].abs()
    return state[f"{module}.weight"].norm(dim=0)


def write_checkpoints(workdir: Path) -> dict[str, Path]:
    import transformers as tf

    gguf = builtin_model_path("smollm2-135m-instruct")
    hf = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # written by hand: transformers refuses to save a model it loaded from a GGUF
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    config = {k: v for k, v in hf.config.to_dict().items() if k != "quantization_config"}
    config["architectures"] = ["LlamaForCausalLM"]
    dirs: dict[str, Path] = {}
    for name, qc in {"16-bit": None, **FORMATS}.items():
        out = workdir / name
        out.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for key, w in state.items():
            module = key.removesuffix(".weight")
            if qc is not None and key.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
                importance = input_importance(state, module)
                tensors.update(
                    {f"{module}.{k}": v.contiguous() for k, v in quantize(w, qc, importance).items()}
                )
            else:
                tensors[key] = w.contiguous()
        save_file(tensors, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config | ({"quantization_config": qc} if qc else {})))
        tokenizer.save_pretrained(out)
        dirs[name] = out
    return dirs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens scored for perplexity")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--workdir", default="/tmp/gptq-smollm2")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dirs = write_checkpoints(Path(args.workdir))
    text = stdlib_docstrings()
    runs = [("16-bit", None), ("16-bit", "int4"), *((name, None) for name in FORMATS)]
    rows: list[dict[str, Any]] = []
    base: float | None = None
    for name, method in runs:
        cfg = EngineConfig(
            model=str(dirs[name]),
            dtype=args.dtype,  # type: ignore[arg-type]
            quantization=method,  # type: ignore[arg-type]
            kv_cache_memory=256 * 2**20,
            threads=args.threads,
        )
        t0 = time.perf_counter()
        loaded = load_model(cfg, "cpu")
        load_s = time.perf_counter() - t0
        engine = engine_from_loaded(loaded, cfg)
        ids = engine.tokenizer.encode(text)
        ppl = perplexity(engine, ids[: args.tokens], args.window)
        base = base or ppl
        row = {
            "checkpoint": name,
            "quantization": method or ("none" if name == "16-bit" else "checkpoint's own"),
            "load_seconds": round(load_s, 2),
            "linear_weight_mib": round(linear_bytes(engine) / 2**20, 1),
            "perplexity": round(ppl, 4),
            "perplexity_change_pct": round(100 * (ppl / base - 1), 3),
            "decode_tok_s": round(decode_tok_s(engine, ids[:64], args.decode_tokens), 2),
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        del engine, loaded
    print(
        json.dumps(
            {
                "benchmark": "gptq_checkpoint",
                "machine": {
                    "cpu": harness.cpu_model(),
                    "kernel_isa": isa.selected(),
                    "threads": args.threads,
                },
                "settings": vars(args) | {"model": "SmolLM2-135M-Instruct (builtin Q4_1 GGUF, dequantized)"},
                "results": rows,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
