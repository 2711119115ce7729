#!/usr/bin/env python
"""Paged attention on CPU in isolation: kvpilot's backends against dense torch SDPA, SmolLM2's heads or
another model's (--shape).

For a decode step (B sequences, one new token each, context L) and a prefill (one sequence of P
tokens, no cached prefix), times one layer's attention call of:
  * cpu-paged: kernels/cpu_attention.py's C kernel reading K/V through the block tables (its
    AVX-512 path where the CPU has it; cpu-paged-generic: the portable loop of the same kernel),
  * torch-ref: kernels/attention.py's reference backend (gather the blocks, then SDPA),
  * dense-sdpa: torch SDPA over contiguous K/V (no paging at all): what torch's own fused CPU
    kernels reach for the same math, a practical bound for the paged versions.
Prints JSON: ms per call, attention GFLOP/s and KV bytes read per second, and the roofline line of
the C kernel's figure: its fraction of this CPU's float32 FMA peak at the kernel's ISA level and
threads, measured in the same run (benchmarks/micro/fma_peak.c: the kernel's scores and P.V are
float32 FMAs whatever the cache stores, so the FMA issue rate is the ceiling it can be held to;
torch's float32 GEMM is no such ceiling on AMD CPUs, where it ran at ~100 GFLOP/s a thread against
~240 for the FMAs, AMD EPYC Zen 5, 2026-12-05).

    python benchmarks/kernels_bench.py attention [--dtype bfloat16] [--threads 2] [--isa avx2] [--kernel-only]
    python benchmarks/kernels_bench.py attention --kernel-only --fast-only --threads 1 --dtype float32 \
        --kv-dtype int8 --decode 1024,16384          # one decode step over an int8 cache (issue 26)
    python benchmarks/kernels_bench.py attention --kernel-only --fast-only --prefill 1024,4096,8192
    python benchmarks/kernels_bench.py attention --kernel-only --shape llama-8b --prefill 2048   # head_dim 128

--isa builds and uses the kernel for one ISA level (kernels/isa.py; the same as KVPILOT_CPU_ISA), so
the AVX2 path can be timed on an AVX-512 machine; --kernel-only skips the torch comparisons;
--fast-only skips the kernel's generic loop too (minutes a call at 8k tokens); --prefill times one
prompt of each length (no cached prefix, one call: the whole prompt's attention of one layer)
instead of the default decode and prefill cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see runtime_vs_peers.py

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import workload as wl
from peers import shapes as peer_shapes

BS = 16
# (query heads, KV heads, head_dim) of the models whose attention --shape times: SmolLM2-135M and the
# peer benchmarks' real shapes (peers/shapes.py: llama-1b, llama-3b, llama-8b)
SHAPES = {
    "smollm2-135m": (9, 3, 64),
    **{name: (s.heads, s.kv_heads, s.head_dim) for name, s in peer_shapes.SHAPES.items()},
}
HQ, HKV, D = SHAPES["smollm2-135m"]  # set by --shape


def best_ms(fn: Callable[[], Any], seconds: float = 1.0, repeats: int = 5) -> float:
    return wl.best_seconds(fn, seconds, repeats) * 1000


def fma_peak_gflops(threads: int) -> float:
    """Float32 FMA GFLOP/s of `threads` threads together at the kernels' ISA level (fma_peak.c, best of 3)."""
    import ctypes

    from kvpilot.kernels import cbuild, cpu_attention, isa

    flags = [*cpu_attention.CFLAGS, "-ffp-contract=fast", *isa.flags_for(isa.selected())]  # the kernel's own
    lib = ctypes.CDLL(str(cbuild.build(Path(__file__).with_name("fma_peak.c"), flags)))
    lib.kvpilot_fma_peak.restype = ctypes.c_double
    lib.kvpilot_fma_peak.argtypes = [ctypes.c_long, ctypes.c_int]
    return round(threads * max(lib.kvpilot_fma_peak(20_000_000, threads) for _ in range(3)), 1)


def make_case(
    qlens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
    tiled: bool,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, Any, Any]:
    """q in `dtype`; the cache in `dtype`, or in `kv_dtype` (int8 / float8, with scales: kernels/quant.py)."""
    from kvpilot.kernels import quant
    from kvpilot.kernels.attention import AttentionMetadata, KVCacheLayer
    from kvpilot.kernels.cpu_attention import head_major_v_cache, transposed_k_cache

    nblocks = [(s + BS - 1) // BS for s in seq_lens]
    total = sum(nblocks)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    tables, start = [], 0
    width = max(nblocks)
    for nb in nblocks:
        row = perm[start : start + nb].tolist()
        tables.append(row + [0] * (width - nb))
        start += nb
    scales: list[torch.Tensor | None] = [None, None]
    kv: list[torch.Tensor] = []
    for i in range(2):
        x = torch.randn(total, BS, HKV, D)
        store = kv_dtype if kv_dtype is not None else dtype
        if kv_dtype is not None:
            x, scales[i] = quant.quantize(x, kv_dtype)
        if tiled:  # the layout the engine allocates for the CPU kernel (1-byte codes copied as bytes)
            make = transposed_k_cache if i == 0 else head_major_v_cache
            t = make(total, BS, HKV, D, dtype=torch.uint8 if kv_dtype is not None else store)
            t.copy_(x.view(torch.uint8) if kv_dtype is not None else x.to(store))
            kv.append(t.view(store))
        else:
            kv.append(x.to(store) if kv_dtype is None else x)
    k, v = kv
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
    )
    q = torch.randn(qsl[-1], HQ, D).to(dtype)
    return q, KVCacheLayer(k, v, scales[0], scales[1]), meta


def figures(ms: float, pairs: int, kv_bytes: int) -> dict[str, float]:
    return {
        "ms": round(ms, 3),
        "gflops": round(4 * HQ * D * pairs / (ms / 1000) / 1e9, 1),
        "kv_gb_per_s": round(kv_bytes / (ms / 1000) / 1e9, 2),
    }


def run_case(
    name: str,
    qlens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
    kernel_only: bool = False,
    fast_only: bool = False,
    kv_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    from kvpilot.kernels import cpu_attention
    from kvpilot.kernels.attention import TorchReferenceBackend

    scale = D**-0.5
    # (query, key) pairs under the causal mask, and K/V bytes each query token reads
    pairs = sum(sum(s - q + j + 1 for j in range(q)) for q, s in zip(qlens, seq_lens, strict=True))
    elem = (kv_dtype or dtype).itemsize + (2 / D if kv_dtype is not None else 0)  # + a float16 scale a head
    kv_bytes = int(2 * HKV * D * elem * pairs)
    out: dict[str, Any] = {
        "case": name,
        "seqs": len(qlens),
        "new_tokens": sum(qlens),
        "max_ctx": max(seq_lens),
    }
    with torch.inference_mode():
        if cpu_attention.available():
            q, cache, meta = make_case(qlens, seq_lens, dtype, tiled=True, kv_dtype=kv_dtype)
            out["cpu-paged"] = figures(
                best_ms(lambda: cpu_attention.paged_attention(q, cache, meta, scale)), pairs, kv_bytes
            )
            out["cpu-paged"]["vectorized_path"] = cpu_attention.fast_path(HQ, cache)
        if cpu_attention.available() and not fast_only:
            out["cpu-paged-generic"] = figures(
                best_ms(lambda: cpu_attention.paged_attention(q, cache, meta, scale, generic=True)),
                pairs,
                kv_bytes,
            )
        if kernel_only:
            return out
        q, cache, meta = make_case(qlens, seq_lens, dtype, tiled=False, kv_dtype=kv_dtype)
        ref = TorchReferenceBackend()
        fn = ref._decode if meta.decode_only else ref._varlen
        out["torch-ref"] = figures(best_ms(lambda: fn(q, cache, meta, scale)), pairs, kv_bytes)
        # dense: contiguous per-sequence K/V, one SDPA call over the batch (same lengths only)
        if len(set(seq_lens)) == 1 and len(set(qlens)) == 1:
            b, s, ql = len(seq_lens), seq_lens[0], qlens[0]
            qq = torch.randn(b, HQ, ql, D).to(dtype)
            kk = torch.randn(b, HKV, s, D).to(dtype)
            vv = torch.randn(b, HKV, s, D).to(dtype)
            causal = ql == s

            def dense() -> torch.Tensor:
                return F.scaled_dot_product_attention(
                    qq, kk, vv, is_causal=causal, scale=scale, enable_gqa=True
                )

            out["dense-sdpa"] = figures(best_ms(dense), pairs, kv_bytes)
            kr = kk.repeat_interleave(HQ // HKV, 1)
            vr = vv.repeat_interleave(HQ // HKV, 1)

            def dense_rep() -> torch.Tensor:
                return F.scaled_dot_product_attention(qq, kr, vr, is_causal=causal, scale=scale)

            out["dense-sdpa-kv-repeated"] = figures(best_ms(dense_rep), pairs, kv_bytes)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument(
        "--kv-dtype",
        choices=["int8", "float8_e4m3fn"],
        help="a quantized cache (float16 scales per token and head) under --dtype queries",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="smollm2-135m", help="the model's attention heads"
    )
    p.add_argument("--isa", choices=["avx512", "avx2", "generic"], help="force the kernel's ISA level")
    p.add_argument("--kernel-only", action="store_true", help="time only the C kernel's two paths")
    p.add_argument("--fast-only", action="store_true", help="skip the C kernel's generic loop")
    p.add_argument(
        "--prefill",
        type=lambda text: [int(x) for x in text.split(",")],
        help="comma-separated prompt lengths: time a prefill of each instead of the default cases",
    )
    p.add_argument(
        "--decode",
        type=lambda text: [int(x) for x in text.split(",")],
        help="comma-separated context lengths: time one sequence's decode step at each (issue 26)",
    )
    args = p.parse_args()
    global HQ, HKV, D
    HQ, HKV, D = SHAPES[args.shape]
    if args.isa:
        os.environ["KVPILOT_CPU_ISA"] = args.isa
    from kvpilot.kernels import isa

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kv_dtype = getattr(torch, args.kv_dtype) if args.kv_dtype else None
    cases = (
        [(f"prefill P={n}", [n], [n]) for n in args.prefill]
        if args.prefill
        else [(f"decode B=1 ctx={n}", [1], [n]) for n in args.decode]
        if args.decode
        else [
            ("decode B=128 ctx=512", [1] * 128, [512] * 128),
            ("decode B=32 ctx=1024", [1] * 32, [1024] * 32),
            ("prefill P=512", [512], [512]),
            ("prefill 4 x P=256", [256] * 4, [256] * 4),
        ]
    )
    peak = fma_peak_gflops(args.threads)
    results = [
        run_case(name, ql, sl, dtype, args.kernel_only, args.fast_only, kv_dtype) for name, ql, sl in cases
    ]
    for r in results:
        if "cpu-paged" in r:
            r["cpu-paged"]["fraction_of_fma_peak"] = round(r["cpu-paged"]["gflops"] / peak, 3)
    doc = {
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype or args.dtype,
        "threads": args.threads,
        "isa": isa.selected(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "shape": args.shape,
        "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BS},
        "fma_peak_gflops": peak,
        "results": results,
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
