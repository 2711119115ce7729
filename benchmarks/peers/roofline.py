"""runtime_vs_peers.py's roofline lines: how close each engine's figures come to what the machine allows.

* Single stream (batch 1), bandwidth: a decode step must read every weight a token passes through once
  (as the engine stores them: its own format, the LM head included, the embedding table left out
  because a step reads one row of it; with tied embeddings the table is the LM head and counts) and the
  KV of its context. bytes per step x decode tokens/s over the copy bandwidth measured in the same run
  (gpu_bench.copy_bandwidth on the CPU device, read + write bytes) is the fraction of the bandwidth the
  engine turns into decode steps; over the read-only bandwidth measured on the engines' threads
  (measure.read_bandwidth), the fraction of the ceiling a step that only reads has. On a CPU with few
  cores the two differ by up to 2x (a 2-core Zen 4 VM: copy 51-61 GB/s read + write, read-only
  30-34 GB/s): the copy's figure is not one a decode step can reach there.
* Batch, compute: the model FLOPs of the batch (measure.model_flops: no padding, no recomputation) over
  its wall time, against the matmul peak measured in the same run (measure.matmul_peak, the best of the
  model's own matmul shapes in the engine's dtype and the other one).

The functions here are pure (numbers in, numbers out) except `gguf_tensor_bytes` (reads a file's
tensor table) and `module_weight_bytes` (walks a loaded torch module).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# GGUF tensor names: the embedding table, and the LM head (absent when tied to the embedding)
GGUF_EMBEDDING = "token_embd.weight"
GGUF_LM_HEAD = "output.weight"
# llama-server's KV cache type unless -ctk/-ctv say otherwise: f16
LLAMACPP_KV_ELEMENT_BYTES = 2


def gguf_decode_weight_bytes(tensor_bytes: Mapping[str, int]) -> int:
    """Pure: the bytes of a GGUF's tensors one decode step reads in full: all of them but the embedding
    table, which counts only when there is no separate LM head (tied: the table is the LM head)."""
    tied = GGUF_LM_HEAD not in tensor_bytes
    return sum(n for name, n in tensor_bytes.items() if name != GGUF_EMBEDDING or tied)


def gguf_tensor_bytes(path: str | Path) -> dict[str, int]:
    """name -> bytes as stored, of every tensor of a GGUF file."""
    import gguf

    return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_bytes: float) -> float:
    """Pure: K and V of one token in every layer."""
    return 2.0 * layers * kv_heads * head_dim * element_bytes


def mean_decode_context(prompt_tokens: int, output_tokens: int) -> float:
    """Pure: the mean context a decode step attends over, from the first decode step (prompt + 1
    token) to the last (prompt + output - 1)."""
    return prompt_tokens + output_tokens / 2.0


def bandwidth_line(
    weight_bytes: float,
    kv_per_token: float,
    context: float,
    decode_tok_per_s: float,
    bandwidth: float,
    read_bandwidth: float | None = None,
) -> dict[str, Any]:
    """Pure: the batch-1 roofline of one engine's single-stream figure, against the copy bandwidth and,
    where measured, the read-only one."""
    step = weight_bytes + kv_per_token * context
    achieved = step * decode_tok_per_s
    read = (
        {
            "read_ceiling_decode_tok_per_s": round(read_bandwidth / step, 1),
            "fraction_of_read_bandwidth": round(achieved / read_bandwidth, 3),
        }
        if read_bandwidth
        else {}
    )
    return {
        "weight_mb_per_step": round(weight_bytes / 1e6, 1),
        "kv_mb_per_step": round(kv_per_token * context / 1e6, 2),
        "mean_context": context,
        "bytes_per_step_mb": round(step / 1e6, 1),
        "decode_tok_per_s": decode_tok_per_s,
        "achieved_gb_s": round(achieved / 1e9, 2),
        "ceiling_decode_tok_per_s": round(bandwidth / step, 1),
        "fraction_of_copy_bandwidth": round(achieved / bandwidth, 3),
        **read,
    }


def compute_line(model_flops: float, wall_s: float, peak_gflops: float) -> dict[str, Any]:
    """Pure: the batch's model FLOP/s against the measured matmul peak."""
    achieved = model_flops / wall_s / 1e9
    return {
        "model_gflops_per_s": round(achieved, 1),
        "peak_gflops": peak_gflops,
        "fraction_of_matmul_peak": round(achieved / peak_gflops, 3),
    }


def module_weight_bytes(model: Any, embedding_names: tuple[str, ...] = ("embed_tokens",)) -> int:
    """The bytes of a loaded torch module's weights that a decode step reads in full: parameters,
    buffers, plain tensor attributes and quantized weights (kernels/qlinear.QuantizedWeight: packed
    ints, scales, mins; `.nbytes`), each tensor once (a tied LM head shares the embedding's), leaving
    out the embedding table unless a module outside it (the LM head) holds the same tensor, and the
    rotary tables (a step reads one row of them)."""
    seen: dict[tuple[int, int], bool] = {}  # (data pointer, bytes) -> read by a non-embedding module

    def add(t: Any, embedding: bool) -> None:
        key = (t.data_ptr(), t.numel() * t.element_size())
        seen[key] = seen.get(key, False) or not embedding

    for mname, mod in model.named_modules():
        embedding = any(e in mname for e in embedding_names)
        for name, value in vars(mod).items():
            if name in ("_parameters", "_buffers"):
                items = [(n, t) for n, t in value.items() if t is not None]
            else:
                items = [(name, value)]
            for n, v in items:
                if any(k in n for k in ("rotary", "cos_sin", "inv_freq")):
                    continue
                if hasattr(v, "packed") and hasattr(v, "scales"):  # a QuantizedWeight
                    for part in (v.packed, v.scales, getattr(v, "mins", None)):
                        if part is not None:
                            add(part, embedding)
                elif hasattr(v, "data_ptr") and hasattr(v, "element_size"):  # a tensor
                    add(v, embedding)
    return sum(n for (_, n), read in seen.items() if read)
