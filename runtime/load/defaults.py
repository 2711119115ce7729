"""The default path: what runs when neither `--quantization` nor `--qmatmul-activations` is given.

Issue 26 ("the default is the fast path"): `kvpilot serve` picks the fastest configuration whose
quality cost is measured and small, says which at start-up, and an explicit flag always wins.

`choose_default` (pure) decides from what the checkpoint stores and where it runs:

- a GGUF file whose every linear weight and LM head (or the embedding tied to it) is stored in a
  quantized type, a dense model, on a CPU whose kernels have the tiled layout (avx512, avx2), one
  device, no LoRA: `--quantization auto`, the file's own blocks multiplied as stored: Q8_0, Q4_0,
  Q4_1 and Q4_K exactly (Q4_K's float16 scale conversion adds +0.007% perplexity); the other types
  (Q6_K, Q5_K, Q5_0, ...: what a Q4_K_M or Q5_K_M file mixes in) requantized to int8 per 32 weights
  at load (runtime/load/gguf_blocks.py; RMS 0.28x Q6_K's own error, measured by
  `benchmarks/runtime_quality.py requant` and held to the same bar by tests/runtime/test_default_quality.py).
  The activations (`--qmatmul-activations`):
  * where the CPU has AVX512-BF16 and the file holds 4-bit blocks (Q4_0, Q4_1, Q4_K), `bf16`: each
    activation rounded to bfloat16, the weights' values exact, summed in float32
    (kvpilot_qmatmul_tiled_bf16's vdpbf16ps: 1.5-2.2x the float32 kernel at every row count on the 4-bit
    blocks, 1.15-1.46x on the 8-bit ones, such as the builtin file's tied LM head, from 3 rows). Its cost
    on the builtin file: agreement 0.994 with float32 and 14/16 greedy answers (transformers' bf16:
    0.961, 11);
  * everywhere else (every AVX2-only CPU; AVX-512 without AVX512-BF16, such as the Skylake to Ice Lake
    Xeons; a file without 4-bit blocks), `int16`: each block of 32 activations rounded to 16 bits
    with one float scale (an element's error at most 1/65534 of its block's largest, against 1/512 of
    itself for bfloat16), the weights' values exact, products by vpmaddwd (kvpilot_qmatmul_tiled_i16:
    at avx2, 1.6-2.0x the float32 kernel at one row, 1.2-1.9x at 5-256 rows, on SmolLM2's shapes on
    an AMD EPYC Zen 3, the single stream's decode step 1.37x; at avx512 its 512-bit kernel, `vpdpwssd`
    with AVX512-VNNI, 1.2-2.0x the 512-bit float32 kernel at 1-256 rows with neither BF16 nor VNNI,
    and 1.2-2.3x the bf16 kernel on 8-bit blocks at 1-5 rows, on an AMD EPYC Zen 4:
    docs/benchmarks.md, "The int16 kernel at 512 bits").
  `float` (kvpilot_qmatmul_tiled_float: the activations unrounded, the float32 model of the dequantized
  file up to the order of the sums) stays on request: slower than either at every row count;
- anything else: the weights dequantized to the model dtype at load (`--quantization none`, the
  default before), as measured (docs/runtime.md, "Precision").

int8 activations (`--quantization auto` alone) are faster still but rank 0.952 of the float32 model's
next tokens (transformers' bf16: 0.960; the default must reach at least that: tests/runtime/
test_default_quality.py), so they stay opt-in. Measured speeds: docs/benchmarks.md, "The default path".

`resolve_default` applies the choice to an EngineConfig (explicit settings kept); the engine build
logs it (`describe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kvpilot.kernels.switches import Activations

if TYPE_CHECKING:
    import torch

    from kvpilot.runtime.config import EngineConfig

# GGUF tensor names (the part before `.weight`) of the linear layers and of the LM head / embedding
LINEAR_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
HEAD_TENSORS = ("output", "token_embd")
EXACT_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q4_K"})  # gguf_blocks.DIRECT_BITS: held as stored
FOUR_BIT_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})  # held as int4: what the bf16 kernel multiplies
TILED_LEVELS = ("avx512", "avx2")  # kernels/qlinear.py tiled_format


@dataclass(frozen=True)
class CheckpointFacts:
    """What the default depends on in a checkpoint (read by `gguf_facts`)."""

    gguf: bool
    linear_types: frozenset[str] = frozenset()  # storage types of the linear weights
    head_type: str | None = None  # the LM head's (`output`), else the tied embedding's
    moe: bool = False  # expert tensors present


@dataclass(frozen=True)
class DefaultPath:
    quantization: Literal["auto", "none"]
    qmatmul_activations: Activations
    why: str


def choose_default(
    facts: CheckpointFacts,
    *,
    device_type: str,
    kernel_level: str,
    cpu_kernels: bool,
    tensor_parallel_size: int,
    lora: bool,
    cpu_bf16: bool = False,
) -> DefaultPath:
    """Pure: the default path for this checkpoint and machine (module docstring). `cpu_bf16`: the
    kernels at `kernel_level` have AVX512-BF16 (kernels/qlinear.py bf16_tiles)."""
    from kvpilot.runtime.load.gguf_blocks import is_quantized

    def dequantized(why: str) -> DefaultPath:
        return DefaultPath("none", "int8", why)

    if not facts.gguf:
        return dequantized("not a GGUF file (a GPTQ/AWQ directory loads its own quantization)")
    if device_type != "cpu":
        return dequantized(f"on {device_type} the dequantized weights are the measured path")
    if not cpu_kernels or kernel_level not in TILED_LEVELS:
        return dequantized(f"no tiled CPU kernels at the {kernel_level} level (or --no-cpu-kernels)")
    if tensor_parallel_size > 1 or lora or facts.moe:
        return dequantized("tensor parallelism, LoRA or a Mixture-of-Experts model: not measured there")
    stored = sorted(facts.linear_types | ({facts.head_type} if facts.head_type else set()))
    if not facts.linear_types or not all(is_quantized(t) for t in stored):
        return dequantized(f"weights stored as {', '.join(stored) or 'nothing'}, not all in quantized blocks")
    exact = [t for t in stored if t in EXACT_TYPES]
    requantized = [t for t in stored if t not in EXACT_TYPES]
    held = f"the file's own {'/'.join(exact)} blocks" if exact else "the file's quantized weights"
    if requantized:
        held += f" ({'/'.join(requantized)} requantized to int8 per 32 weights)"
    if kernel_level == "avx512" and cpu_bf16 and FOUR_BIT_TYPES & facts.linear_types:
        return DefaultPath(
            "auto",
            "bf16",
            f"{held} times activations rounded to bfloat16 (the weights' values exact, summed in float32; "
            "vdpbf16ps on the 4-bit blocks, and on the 8-bit ones from 3 rows), read from memory quantized",
        )
    return DefaultPath(
        "auto",
        "int16",
        f"{held} times activations rounded to 16 bits per block of 32 (the weights' values exact; "
        f"{'vpdpwssd/vpmaddwd at 512 bits' if kernel_level == 'avx512' else 'vpmaddwd'}), read from memory quantized",
    )


def gguf_facts(path: Path) -> CheckpointFacts:
    """The storage types of a model file's linear weights and LM head (a directory: not a GGUF)."""
    if not path.is_file():
        return CheckpointFacts(gguf=False)
    from kvpilot.runtime.load.gguf_reader import GGUFFile

    linear: set[str] = set()
    heads: dict[str, str] = {}
    moe = False
    with GGUFFile(path) as f:
        for name, info in f.tensors.items():
            parts = name.split(".")
            if len(parts) < 2 or parts[-1] != "weight":
                continue
            if "_exps" in parts[-2]:
                moe = True
            if parts[-2] in LINEAR_TENSORS:
                linear.add(info.type_name)
            elif len(parts) == 2 and parts[0] in HEAD_TENSORS:
                heads[parts[0]] = info.type_name
    head = heads.get("output", heads.get("token_embd"))
    return CheckpointFacts(gguf=True, linear_types=frozenset(linear), head_type=head, moe=moe)


def resolve_default(
    cfg: EngineConfig, device: torch.device, *, kernel_level: str, cpu_kernels: bool
) -> tuple[EngineConfig, DefaultPath | None]:
    """`cfg` with `quantization` and `qmatmul_activations` set: as given where given, else the
    default path's; and the default path when it decided (None: --quantization was given)."""
    from kvpilot.kernels import isa
    from kvpilot.runtime.load.loader import resolve_model_path

    if cfg.quantization is not None:
        return cfg.model_copy(update={"qmatmul_activations": cfg.qmatmul_activations or "int8"}), None
    choice = choose_default(
        gguf_facts(resolve_model_path(cfg.model)),
        device_type=device.type,
        kernel_level=kernel_level,
        cpu_kernels=cpu_kernels,
        tensor_parallel_size=cfg.tensor_parallel_size,
        lora=cfg.enable_lora,
        cpu_bf16=isa.bf16_dot(kernel_level),
    )
    activations = cfg.qmatmul_activations or choice.qmatmul_activations
    return cfg.model_copy(
        update={"quantization": choice.quantization, "qmatmul_activations": activations}
    ), choice


def describe(choice: DefaultPath, activations: str) -> str:
    """The start-up log line of a default path (`activations`: the switch in force, which an
    environment override may have changed)."""
    flags = f"--quantization {choice.quantization}"
    if choice.quantization != "none":
        flags += f" --qmatmul-activations {activations}"
    return f"default path (no --quantization given): {flags}: {choice.why}"
