"""How faithful is each precision and quantization to the full-precision model, and what does it cost
in memory and load time? One subcommand per measurement; each prints one JSON document with the
machine.

    python benchmarks/runtime_quality.py dtype                       # dtypes / kernel levels vs float32
    python benchmarks/runtime_quality.py kv-cache --tokens 4096      # int8 / fp8 KV cache: perplexity, capacity
    python benchmarks/runtime_quality.py weights --methods none,int8,int4   # weight-only quantization
    python benchmarks/runtime_quality.py q4k --tokens 2048           # Q4_K blocks with float16 scales
    python benchmarks/runtime_quality.py requant                     # Q6_K/Q5_0 (a Q4_K_M file) requantized to int8
    python benchmarks/runtime_quality.py gptq                        # GPTQ / AWQ checkpoints of SmolLM2
    python benchmarks/runtime_quality.py gguf-load --repeat 3        # loading a quantized GGUF: time, peak RSS
"""

from __future__ import annotations

from harness import dispatch

COMMANDS = {
    "dtype": "quality.dtype",
    "kv-cache": "quality.kv_cache",
    "weights": "quality.weights",
    "q4k": "quality.q4k",
    "requant": "quality.requant",
    "gptq": "quality.gptq",
    "gguf-load": "quality.gguf_load",
}

if __name__ == "__main__":
    dispatch(__doc__ or "", COMMANDS)
