"""How fast are kvpilot's CPU kernels in isolation, against torch and against another version of
their C source? One subcommand per kernel; each prints JSON with the machine.

    python benchmarks/kernels_bench.py attention --kernel-only       # paged attention per ISA level
    python benchmarks/kernels_bench.py qmatmul --rows 1,5,32,128     # quantized matmul vs torch bf16
    python benchmarks/kernels_bench.py qmatmul-ab --against OLD.c    # tiled qmatmul: this tree vs OLD.c
    python benchmarks/kernels_bench.py qmoe --against OLD.c          # fused quantized MoE experts call
    python benchmarks/kernels_bench.py act-order --threads 1         # GPTQ act-order gather, conversion

The MoE engine against transformers is benchmarks/moe_bench.py.
"""

from __future__ import annotations

from harness import dispatch

COMMANDS = {
    "attention": "micro.attention",
    "qmatmul": "micro.qmatmul",
    "qmatmul-ab": "micro.qmatmul_ab",
    "qmoe": "micro.qmoe",
    "act-order": "micro.act_order",
}

if __name__ == "__main__":
    dispatch(__doc__ or "", COMMANDS)
