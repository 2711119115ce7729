"""Compile every Triton kernel variant the runtime launches for real GPU targets, without a GPU.

Triton's interpreter (the CPU tests) checks what the kernels compute, not that they compile: this
compiles each variant to a cubin with Triton's own ptxas for sm_90 (H100/H200) and, except fp8, sm_80
(A100). Run as a script without TRITON_INTERPRET (tests/kernels/test_triton_compile.py does); prints
one line per variant and exits 1 if any fails.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"

from kvpilot.kernels import triton_attention, triton_moe, triton_qlinear  # noqa: E402


def params(kernel: Any) -> list[str]:
    return list(inspect.signature(kernel.fn).parameters)


def compile_one(kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target)
    assert compiled.asm.get("cubin"), "no cubin"


def attention_variants() -> list[tuple[str, dict[str, str], dict[str, Any], list[int]]]:
    out = []
    kernel = triton_attention._paged_attention_kernel
    cases = [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "i8"), ("fp16", "i8")]
    cases += [("bf16", "fp8"), ("fp32", "fp8")]
    for qdt, kvdt in cases:
        quant = kvdt in ("i8", "fp8")
        stored = "u8" if kvdt == "fp8" else kvdt
        for group, d in ((4, 128), (3, 96)):  # a power-of-two group, and a padded one
            for split in (False, True):
                block_q, g_pad, block_m = triton_attention.tile_shape(group, 1 if split else 64)
                const = {
                    "SPLIT": split,
                    "QUANT": quant,
                    "FP8": kvdt == "fp8",
                    "PRECISION": "ieee" if qdt == "fp32" else "tf32",
                    "DOT_F32": False,
                    "BLOCK_Q": block_q,
                    "G_PAD": g_pad,
                    "BLOCK_M": block_m,
                    "BLOCK_N": triton_attention.BLOCK_N,
                    "BLOCK_D": triton_attention._next_pow2(d),
                }
                ptrs = {"out_ptr": qdt, "q_ptr": qdt, "k_ptr": stored, "v_ptr": stored}
                ptrs |= {"part_m_ptr": "fp32", "part_l_ptr": "fp32", "part_acc_ptr": "fp32"}
                ptrs |= {"ks_ptr": "fp16" if quant else stored, "vs_ptr": "fp16" if quant else stored}
                ptrs |= {"qsl_ptr": "i32", "seq_lens_ptr": "i32", "bt_ptr": "i32"}
                sig = {
                    n: "*" + ptrs[n]
                    if n in ptrs
                    else "fp32"
                    if n == "scale"
                    else "constexpr"
                    if n in const
                    else "i32"
                    for n in params(kernel)
                }
                archs = [90] if kvdt == "fp8" else [90, 80]
                out.append(
                    (f"attention q={qdt} kv={kvdt} group={group} d={d} split={split}", sig, const, archs)
                )
    return out


def qlinear_variants() -> list[tuple[str, dict[str, str], dict[str, Any], list[int]]]:
    """The quantized matmul: int8 and int4 codes, each activation dtype, decode and prefill tiles."""
    out = []
    kernel = triton_qlinear._qmatmul_kernel
    for bits in (8, 4):
        for dt in ("bf16", "fp16", "fp32"):
            for m in (1, 256):
                block_m, block_n, _ = triton_qlinear.tile_shape(m)
                const = {
                    "BITS": bits,
                    "HAS_BIAS": m == 1,
                    "PRECISION": "ieee" if dt == "fp32" else "tf32",
                    "DOT_F32": False,
                    "BLOCK_M": block_m,
                    "BLOCK_N": block_n,
                    "BLOCK_K": 32,
                }
                ptrs = {"x_ptr": dt, "bias_ptr": dt, "out_ptr": dt, "w_ptr": "i8" if bits == 8 else "u8"}
                ptrs |= {"scale_ptr": "fp16", "min_ptr": "fp16"}
                sig = {
                    n: "*" + ptrs[n] if n in ptrs else "constexpr" if n in const else "i32"
                    for n in params(kernel)
                }
                out.append((f"qlinear int{bits} x={dt} rows={m}", sig, const, [90, 80]))
    return out


def main() -> int:
    failures = 0
    jobs = attention_variants() + qlinear_variants()
    store = triton_attention._store_kv_kernel
    for dt in ("bf16", "fp16", "fp32", "i8", "u8"):
        sig = {
            n: "*" + dt
            if n in ("src_ptr", "dst_ptr")
            else "*i64"
            if n == "slot_ptr"
            else "constexpr"
            if n == "BLOCK"
            else "i32"
            for n in params(store)
        }
        jobs.append((f"store {dt}", sig, {"BLOCK": 256}, [90, 80]))
    gemm = triton_moe._grouped_gemm_kernel
    for dt in ("bf16", "fp16", "fp32"):
        const = {"PRECISION": "ieee" if dt == "fp32" else "tf32", "DOT_F32": False}
        const |= {"BLOCK_M": triton_moe.BLOCK_M, "BLOCK_N": triton_moe.BLOCK_N, "BLOCK_K": triton_moe.BLOCK_K}
        sig = {
            n: "*" + dt
            if n in ("x_ptr", "w_ptr", "out_ptr")
            else "*i64"
            if n == "offsets_ptr"
            else "constexpr"
            if n in const
            else "i32"
            for n in params(gemm)
        }
        jobs.append((f"grouped gemm {dt}", sig, const, [90, 80]))
    for name, sig, const, archs in jobs:
        kernel = (
            store
            if name.startswith("store")
            else gemm
            if name.startswith("grouped")
            else triton_qlinear._qmatmul_kernel
            if name.startswith("qlinear")
            else triton_attention._paged_attention_kernel
        )
        for arch in archs:
            try:
                compile_one(kernel, sig, const, arch)
                print(f"ok   sm_{arch} {name}")
            except Exception as exc:  # report every failing variant, not just the first
                failures += 1
                print(f"FAIL sm_{arch} {name}: {type(exc).__name__}: {str(exc)[:500]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
