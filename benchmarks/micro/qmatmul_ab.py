#!/usr/bin/env python
"""The tiled quantized matmul (kvpilot_qmatmul_tiled, the CPU kernel of every `--quantization`
linear layer and LM head after load) of this tree against another version of its C source, in
alternation: a before/after that load from other work disturbs alike.

For each weight shape (default: OLMoE's / a 2048-wide model's LM head 50304 x 2048, SmolLM2's head
49152 x 576, a fused QKV 6144 x 2048 and a small 1536 x 576) and format (int8 per channel, int4
group 32, both tiled as at load) and each row count M (1: single stream, 5: a speculative
verification, 32: a batch), it times one call of each build, round by round (`--rounds`), one
thread by default with the thread's CPU time, or `--threads N` with wall time, and checks that
both builds give identical outputs. A weight larger than the last-level cache streams from memory
on every call, as a decode step's weights do; the small shapes stay cached between calls, which a
real model's layers do not.

    git show REV:kernels/csrc/qmatmul_cpu.c > /tmp/before_qmatmul_cpu.c
    python benchmarks/kernels_bench.py qmatmul-ab --against /tmp/before_qmatmul_cpu.c [--threads 2] [--rounds 5]
    python benchmarks/kernels_bench.py qmatmul-ab --against /tmp/before_qmatmul_cpu.c --activations float
    python benchmarks/kernels_bench.py qmatmul-ab --against /tmp/before_qmatmul_cpu.c --activations bf16 \
        --shapes 16384x2048,2048x8192,128256x2048 --rows 1,5,12,40,64,256     # Llama-3.2-1B's
    python benchmarks/kernels_bench.py qmatmul-ab --against /tmp/before_qmatmul_cpu.c --activations int16 \
        --dtype float32 --rows 1,4,16,64     # the avx2 level's default path

`--contend BUSY_MS,IDLE_MS` runs a co-tenant during the timings: another process that spins BUSY_MS
and sleeps IDLE_MS in turn (an HTTP server's event loop, a neighbour container, a CPU quota's
throttling), so that the OS preempts the call's threads now and then; the figures are then wall time
and the median of the rounds (what a preemption costs is the point, not the best round):

    python benchmarks/kernels_bench.py qmatmul-ab --against /tmp/before_qmatmul_cpu.c --activations bf16 \
        --threads 2 --contend 2,4 --rounds 15 --shapes 1536x576,3072x576,576x1536 --rows 1,16,64,1024

Set KVPILOT_CPU_ISA=avx2 for the avx2 level on an AVX-512 CPU. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from kvpilot.kernels import isa, qlinear
from micro.qmoe import other_build, time_calls

SHAPES = "50304x2048,49152x576,6144x2048,1536x576"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="another qmatmul_cpu.c (the 'before')")
    ap.add_argument("--shapes", default=SHAPES, help="comma list of NxK weight shapes")
    ap.add_argument("--rows", default="1,5,32", help="comma list of activation row counts M")
    ap.add_argument("--methods", default="int8,int4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--activations",
        default="int8",
        choices=["int8", "float", "bf16", "int16"],
        help="the tiled kernel of this activation mode: kvpilot_qmatmul_tiled (int8), "
        "kvpilot_qmatmul_tiled_float (float), kvpilot_qmatmul_tiled_bf16 (bf16: the default path's on "
        "AVX512-BF16 CPUs) or kvpilot_qmatmul_tiled_i16 (int16: the default path's at the avx2 level); "
        "both builds must export it",
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the activations' dtype (float32: what kvpilot runs at the avx2 level)",
    )
    ap.add_argument(
        "--contend",
        default="",
        metavar="BUSY_MS,IDLE_MS",
        help="a co-tenant process spinning BUSY_MS and sleeping IDLE_MS in turn during the timings "
        "(wall time, median of the rounds)",
    )
    args = ap.parse_args()
    entry = {
        "int8": "kvpilot_qmatmul_tiled",
        "float": "kvpilot_qmatmul_tiled_float",
        "int16": "kvpilot_qmatmul_tiled_i16",
    }.get(args.activations, "kvpilot_qmatmul_tiled_bf16")
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        rows = [int(m) for m in args.rows.split(",")]
    except ValueError:
        ap.error(f"--shapes / --rows: expected NxK,... and M,...; got {args.shapes!r}, {args.rows!r}")
    if any(len(s) != 2 or s[0] % 16 for s in shapes):
        ap.error("--shapes: each NxK needs N a multiple of 16 (the tiled layout)")
    if not args.against.is_file():
        ap.error(f"--against: no such file {args.against}")
    try:
        busy_ms, idle_ms = (float(v) for v in args.contend.split(",")) if args.contend else (0.0, 0.0)
    except ValueError:
        ap.error(f"--contend: expected BUSY_MS,IDLE_MS (two numbers), got {args.contend!r}")
    torch.set_num_threads(args.threads)
    before = other_build(args.against, Path(tempfile.mkdtemp()))
    tenant = co_tenant(busy_ms, idle_ms) if args.contend else None
    try:
        run_cases(args, shapes, rows, entry, before, tenant is not None)
    finally:
        if tenant is not None:
            tenant.kill()
            tenant.wait()
    print(
        json.dumps(
            {
                "level": isa.selected(),
                "threads": args.threads,
                "entry": entry,
                "dtype": args.dtype,
                "clock": "wall" if args.threads > 1 or args.contend else "thread CPU time",
                "statistic": "median" if args.contend else "best",
                "rounds": args.rounds,
                "contend_ms": [busy_ms, idle_ms] if args.contend else None,
            }
        )
    )
    return 0


def co_tenant(busy_ms: float, idle_ms: float) -> subprocess.Popen[bytes]:
    """A process that spins busy_ms and sleeps idle_ms in turn until killed."""
    code = (
        "import time\n"
        "while True:\n"
        "    t = time.perf_counter()\n"
        f"    while time.perf_counter() - t < {busy_ms / 1e3}: pass\n"
        f"    time.sleep({idle_ms / 1e3})\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def run_cases(
    args: argparse.Namespace,
    shapes: list[tuple[int, ...]],
    rows: list[int],
    entry: str,
    before: object,
    contended: bool,
) -> None:
    """Time each (shape, method, rows) case of both builds and print one JSON line each."""
    after = qlinear._library()
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        for method in args.methods.split(","):
            qw = qlinear.tile(qlinear.quantize(w, method, 0 if method == "int8" else 32))
            for m in rows:
                dtype = getattr(torch, args.dtype)
                x = torch.randn(m, k, generator=gen).to(dtype)
                outs = [torch.empty(m, n, dtype=dtype) for _ in range(2)]

                def call(lib: object, out: torch.Tensor, x: torch.Tensor = x, qw: object = qw) -> None:
                    rc = getattr(lib, entry)(*qlinear._kernel_args(x, out, None, qw))  # type: ignore[arg-type]
                    if rc != 0:
                        raise SystemExit(f"{entry} returned {rc}")

                secs = time_calls(
                    [partial(call, before, outs[0]), partial(call, after, outs[1])],
                    args.rounds,
                    wall=args.threads > 1 or contended,
                    budget_s=0.2,
                    median=contended,
                )
                if args.activations != "float" and not torch.equal(outs[0], outs[1]):
                    raise SystemExit(f"{n}x{k} {method} M={m}: the two builds' outputs differ")
                if args.activations == "float":  # the exact product either way, up to the order of the sums
                    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=1e-2, atol=1e-2)
                print(
                    json.dumps(
                        {
                            "shape": f"{n}x{k}",
                            "method": method,
                            "rows": m,
                            "before_ms": round(secs[0] * 1e3, 3),
                            "after_ms": round(secs[1] * 1e3, 3),
                            "speedup": round(secs[0] / secs[1], 2),
                            "weight_gb_s_after": round(qw.packed.numel() / secs[1] / 1e9, 1),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    raise SystemExit(main())
