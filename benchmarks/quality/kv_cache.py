"""KV-cache storage quality and capacity (bfloat16, int8, fp8), against the float32 cache, in one run.

- Perplexity on real English text this machine already has: the docstrings of Python's standard
  library (first N tokens), scored through the paged KV cache in chunks; and each scored token's
  log-probability change against the unquantized cache (mean, 99th percentile, max).
- Greedy agreement over 128-token continuations of prompts taken from the same text.
- Capacity: tokens that fit in the same KV memory budget.

Prints one JSON document. Example:
    python benchmarks/runtime_quality.py kv-cache --tokens 4096 --prompts 16
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams

STDLIB_MODULES = [
    "argparse",
    "collections/__init__",
    "dataclasses",
    "functools",
    "json/__init__",
    "pathlib",
    "subprocess",
    "textwrap",
    "typing",
    "logging/__init__",
    "datetime",
    "difflib",
    "shutil",
]


def stdlib_docstrings() -> str:
    """Module, class and function docstrings of well-documented stdlib modules, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    for name in STDLIB_MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    parts.append(doc.strip())
    return "\n\n".join(parts)


def token_nll(engine: LLMEngine, ids: list[int], window: int, chunk_size: int = 128) -> list[float]:
    """Each token's NLL over `window`-token pieces, each scored in prefill chunks of `chunk_size`."""
    nll: list[float] = []
    for start in range(0, len(ids) - 1, window):
        piece = ids[start : start + window + 1]
        if len(piece) < 2:
            break
        nll.extend((-engine.score(piece, chunk_size=chunk_size)).tolist())
    return nll


def perplexity(engine: LLMEngine, ids: list[int], window: int, chunk_size: int = 128) -> float:
    """exp(mean NLL) over `window`-token pieces, each scored in prefill chunks of `chunk_size`."""
    nll = token_nll(engine, ids, window, chunk_size)
    return math.exp(sum(nll) / len(nll))


def logprob_drift(base: list[float], other: list[float]) -> dict[str, float]:
    """Per scored token, |log p(quantized cache) - log p(unquantized)|: mean, 99th percentile, max."""
    diffs = sorted(abs(a - b) for a, b in zip(base, other, strict=True))
    return {
        "mean_abs_logprob_change": sum(diffs) / len(diffs),
        "p99_abs_logprob_change": diffs[min(len(diffs) - 1, int(0.99 * len(diffs)))],
        "max_abs_logprob_change": diffs[-1],
    }


def continuations(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [s.output_token_ids for s in engine.generate(prompts, params)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Share of identical tokens position by position, and mean length of the identical prefix."""
    same = total = 0
    prefix: list[int] = []
    for x, y in zip(a, b, strict=True):
        same += sum(int(i == j) for i, j in zip(x, y, strict=True))
        total += len(x)
        k = next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), len(x))
        prefix.append(k)
    return {"token_agreement": same / total, "mean_identical_prefix": sum(prefix) / len(prefix)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--dtype", default="float32", help="model dtype (default float32: isolates KV quantization error)"
    )
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text to score")
    ap.add_argument("--window", type=int, default=512, help="context window per scored piece")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--kv-cache-memory", type=int, default=256 * 2**20)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument(
        "--kinds",
        default="float32,bfloat16,int8,fp8",
        help="--kv-cache-dtype values, comma list; the first is the reference (float32: the unrounded cache)",
    )
    args = ap.parse_args(argv)

    text = stdlib_docstrings()
    results: dict[str, Any] = {}
    base_nll: list[float] | None = None
    base_cont: list[list[int]] | None = None
    for kind in args.kinds.split(","):
        cfg = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_dtype=kind,  # type: ignore[arg-type]
            kv_cache_memory=args.kv_cache_memory,
            threads=args.threads,
        )
        engine = build_engine(cfg)
        ids = engine.tokenizer.encode(text)[: args.tokens]
        step = max(1, len(ids) // (args.prompts + 1))
        prompts = [ids[i * step : i * step + 64] for i in range(args.prompts)]
        t0 = time.perf_counter()
        nll = token_nll(engine, ids, args.window)
        ppl = math.exp(sum(nll) / len(nll))
        cont = continuations(engine, prompts, args.continuation)
        capacity = engine.kv_capacity_tokens
        entry: dict[str, Any] = {
            "kv_storage_dtype": str(engine.runner.geometry.dtype),
            "perplexity": round(ppl, 4),
            "kv_capacity_tokens": capacity,
            "bytes_per_token": engine.runner.geometry.bytes_per_token,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if base_nll is None:  # the first kind is the reference
            base_nll, base_cont = nll, cont
        else:
            assert base_nll is not None and base_cont is not None
            base_ppl = math.exp(sum(base_nll) / len(base_nll))
            entry["perplexity_change_pct"] = round(100 * (ppl / base_ppl - 1), 3)
            entry.update({k: round(v, 4) for k, v in logprob_drift(base_nll, nll).items()})
            geo16 = dataclasses.replace(engine.runner.geometry, dtype=torch.bfloat16)
            tokens16 = geo16.num_blocks_for(args.kv_cache_memory) * geo16.block_size
            entry["capacity_vs_16bit"] = round(capacity / tokens16, 3)
            entry.update({k: round(v, 4) for k, v in agreement(base_cont, cont).items()})
        results[kind] = entry
        del engine
    print(
        json.dumps(
            {
                "benchmark": "kv_quant_quality",
                "machine": {
                    "cpu": platform.processor() or platform.machine(),
                    "cores": os.cpu_count(),
                    "python": sys.version.split()[0],
                    "torch": torch.__version__,
                },
                "settings": vars(args)
                | {
                    "text": f"docstrings of {len(STDLIB_MODULES)} stdlib modules",
                    "scored_tokens": args.tokens,
                },
                "results": results,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
