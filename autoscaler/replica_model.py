"""Replica performance from first principles: a roofline per (GPU, model, dtype, tensor-parallel size).

One continuous-batching step of a paged-KV engine (vLLM, SGLang, kvpilot's runtime) reads every weight
once, reads the KV of every sequence in the batch (in proportion to its context) and does the FLOPs of
the tokens it computes: 2 x active parameters per token for the matmuls, plus attention, which for a
prefill chunk of n tokens after c cached ones is 4 x layers x heads x head_dim x n x (c + n/2) (the
quadratic term: QK^T and PV, a multiply-add each). A step takes

    step_s = overhead + max(memory_s, compute_s)
    memory_s  = (weight bytes read + KV bytes per token x context tokens read) / (bandwidth x eff_bw)
    compute_s = (2 x active params x tokens + attention FLOPs) / (peak FLOP/s x eff_flops)

with bandwidth and FLOP/s summed over the tensor-parallel GPUs. For a mixture of experts the weights
read are the shared ones plus the experts the step's tokens touch: of E experts with k per token,
T tokens touch E x (1 - (1 - k/E)^T) of them on average (uniform routing).

The KV pool is memory arithmetic, as vLLM sizes it:
    pool_tokens = (HBM x tp x gpu_memory_utilization - weight bytes - activation reserve x tp)
                  / (2 x layers x kv_heads x head_dim x KV dtype bytes)

Every figure below names where it comes from; the efficiency factors are the assumed part (the share
of the datasheet peak that serving kernels reach), the same for every model on a GPU.
`calibration_for()` turns a (GPU, model, dtype, tp) into the simulator's Calibration; names such as
`h100/llama-3.1-8b`, `h200/mixtral-8x7b/fp8` or `a100/llama-3.1-70b/tp4` select one
(`resolve_calibration`), and `list_calibrations()` lists the pairs that fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpilot.autoscaler.calibration import Calibration

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes: float
    bandwidth_bytes_s: float
    bf16_flops: float  # dense (no structured sparsity)
    fp8_flops: float | None  # None: no fp8 tensor cores
    bandwidth_efficiency: float  # share of peak bandwidth a decode step reaches
    flops_efficiency: float  # share of peak FLOP/s a prefill step reaches (MFU)
    source: str


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    params: float  # all parameters (weights stored)
    active_params: float  # parameters a token goes through (= params for a dense model)
    experts: int = 0  # mixture of experts: experts per layer
    experts_per_token: int = 0
    source: str = ""

    @property
    def expert_params(self) -> float:
        """Parameters of one expert summed over layers (0 for a dense model)."""
        if not self.experts:
            return 0.0
        return (self.params - self.active_params) / (self.experts - self.experts_per_token)

    @property
    def shared_params(self) -> float:
        """Parameters every token reads: all of them for a dense model, the non-expert ones for a MoE."""
        return self.params - self.experts * self.expert_params


# Datasheet figures: NVIDIA H100 / H200 / A100 / L40S / L4 product datasheets (SXM form factors where
# there are two), dense tensor-core throughput (the "with sparsity" figures are halved).
# Efficiency: decode kernels (vLLM / FlashInfer paged attention, cuBLAS GEMV-like GEMMs) reach about
# 75-85% of HBM bandwidth on Hopper and Ampere; prefill GEMMs reach ~50-65% MFU in serving engines
# (vLLM and SGLang benchmark write-ups report 40-60% MFU for prefill-heavy runs). GDDR6 cards (L40S, L4)
# get a little less of their bandwidth.
GPUS: dict[str, Gpu] = {
    "h100": Gpu(
        "H100 SXM 80GB",
        80 * GB,
        3.35e12,
        989e12,
        1979e12,
        0.80,
        0.55,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16, "
        "1,979 TFLOP/s fp8 dense",
    ),
    "h200": Gpu(
        "H200 SXM 141GB",
        141 * GB,
        4.8e12,
        989e12,
        1979e12,
        0.80,
        0.55,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, same tensor cores as H100",
    ),
    "a100": Gpu(
        "A100 SXM 80GB",
        80 * GB,
        2.039e12,
        312e12,
        None,
        0.80,
        0.60,
        "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s, 312 TFLOP/s bf16; no fp8",
    ),
    "l40s": Gpu(
        "L40S 48GB",
        48 * GB,
        864e9,
        362e12,
        733e12,
        0.75,
        0.55,
        "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362 TFLOP/s bf16 and 733 TFLOP/s fp8 dense "
        "(733 / 1,466 with sparsity)",
    ),
    "l4": Gpu(
        "L4 24GB",
        24 * GB,
        300e9,
        121e12,
        242e12,
        0.75,
        0.55,
        "NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, 121 TFLOP/s bf16 and 242 TFLOP/s fp8 dense "
        "(242 / 485 with sparsity)",
    ),
}

# Shapes from each model's config.json on the Hugging Face Hub (num_hidden_layers, hidden_size,
# num_attention_heads, num_key_value_heads, head_dim) and parameter counts from the model cards.
MODELS: dict[str, ModelShape] = {
    "llama-3.1-8b": ModelShape(
        "Llama-3.1-8B", 32, 4096, 32, 8, 128, 8.03e9, 8.03e9,
        source="meta-llama/Llama-3.1-8B config.json; 8.03B parameters (model card)",
    ),
    "llama-3.1-70b": ModelShape(
        "Llama-3.1-70B", 80, 8192, 64, 8, 128, 70.6e9, 70.6e9,
        source="meta-llama/Llama-3.1-70B config.json; 70.6B parameters (model card)",
    ),
    "qwen2.5-32b": ModelShape(
        "Qwen2.5-32B", 64, 5120, 40, 8, 128, 32.5e9, 32.5e9,
        source="Qwen/Qwen2.5-32B config.json; 32.5B parameters (model card)",
    ),
    "mixtral-8x7b": ModelShape(
        "Mixtral-8x7B", 32, 4096, 32, 8, 128, 46.7e9, 12.9e9, experts=8, experts_per_token=2,
        source="mistralai/Mixtral-8x7B-v0.1 config.json; 46.7B parameters, 12.9B active per token "
        "(2 of 8 experts; Mistral AI announcement)",
    ),
    "smollm2-135m": ModelShape(
        "SmolLM2-135M", 30, 576, 9, 3, 64, 134.5e6, 134.5e6,
        source="HuggingFaceTB/SmolLM2-135M config.json; 134.5M parameters",
    ),
}  # fmt: skip

DTYPE_BYTES = {"bf16": 2, "fp8": 1}
# Per-step cost that is neither memory nor compute: the scheduler, sampling and kernel launches under
# CUDA graphs (~1-2 ms per step in vLLM's profiles), plus two all-reduces per layer under tensor
# parallelism (~8 us each over NVLink for decode-sized messages).
STEP_OVERHEAD_S = 0.0015
ALLREDUCE_S = 8e-6
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
ACTIVATION_RESERVE_BYTES = 2 * GIB  # per GPU: activations of the largest batch, CUDA graphs, workspace
MIN_POOL_TOKENS = 32_768  # a pair that holds less KV than this does not "fit"
# Engine limits the simulated replica runs with (vLLM V1's defaults for serving on these GPUs).
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 8192
BLOCK_SIZE = 16
DEFAULT_STARTUP_S = 60.0  # assumed: image cached, weights from a local volume; pass --startup-s


class UnknownCalibration(ValueError):
    """A calibration name that names no GPU, model or dtype; the message lists the known ones."""


def kv_bytes_per_token(model: ModelShape, kv_dtype: str = "bf16") -> int:
    """K and V of every layer for one token."""
    return 2 * model.layers * model.kv_heads * model.head_dim * DTYPE_BYTES[kv_dtype]


def weight_bytes(model: ModelShape, dtype: str = "bf16") -> float:
    return model.params * DTYPE_BYTES[dtype]


def kv_pool_tokens(
    gpu: Gpu,
    model: ModelShape,
    dtype: str = "bf16",
    tp: int = 1,
    *,
    kv_dtype: str = "bf16",
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes: float = ACTIVATION_RESERVE_BYTES,
) -> int:
    """Tokens of KV the replica holds (0 when the weights do not fit)."""
    free = gpu.hbm_bytes * tp * gpu_memory_utilization - weight_bytes(model, dtype)
    free -= activation_reserve_bytes * tp
    return max(0, int(free // kv_bytes_per_token(model, kv_dtype)))


def peak_flops(gpu: Gpu, dtype: str) -> float:
    if dtype == "fp8":
        if gpu.fp8_flops is None:
            raise UnknownCalibration(f"{gpu.name} has no fp8 tensor cores; use bf16")
        return gpu.fp8_flops
    return gpu.bf16_flops


def experts_touched(model: ModelShape, tokens: int) -> float:
    """Expected experts per layer that `tokens` tokens route to (uniform routing)."""
    if not model.experts or tokens <= 0:
        return 0.0
    return model.experts * (1.0 - (1.0 - model.experts_per_token / model.experts) ** tokens)


def calibration_for(
    gpu: Gpu,
    model: ModelShape,
    dtype: str = "bf16",
    tp: int = 1,
    *,
    kv_dtype: str = "bf16",
    startup_s: float = DEFAULT_STARTUP_S,
    name: str = "",
) -> Calibration:
    """The simulator's Calibration for this replica: roofline coefficients and the KV pool."""
    if dtype not in DTYPE_BYTES or kv_dtype not in DTYPE_BYTES:
        raise UnknownCalibration(f"unknown dtype; known: {', '.join(DTYPE_BYTES)}")
    if tp < 1:
        raise UnknownCalibration("tensor-parallel size must be >= 1")
    pool = kv_pool_tokens(gpu, model, dtype, tp, kv_dtype=kv_dtype)
    if pool < BLOCK_SIZE:
        raise UnknownCalibration(
            f"{model.name} ({dtype}) does not fit on {tp} x {gpu.name}: "
            f"{weight_bytes(model, dtype) / GB:.0f} GB of weights; raise the tensor-parallel size (/tpN)"
        )
    bw = gpu.bandwidth_bytes_s * tp * gpu.bandwidth_efficiency
    flops = peak_flops(gpu, dtype) * tp * gpu.flops_efficiency
    wb = DTYPE_BYTES[dtype]
    return Calibration(
        step_overhead_s=STEP_OVERHEAD_S + (2 * model.layers * ALLREDUCE_S if tp > 1 else 0.0),
        decode_s_per_seq=0.0,
        prefill_s_per_token=0.0,
        weight_read_s=model.shared_params * wb / bw,
        expert_read_s=model.expert_params * wb / bw,
        num_experts=model.experts,
        experts_per_token=model.experts_per_token,
        kv_read_s_per_token=kv_bytes_per_token(model, kv_dtype) / bw,
        compute_s_per_token=2.0 * model.active_params / flops,
        attn_s_per_token_pair=4.0 * model.layers * model.heads * model.head_dim / flops,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        block_size=BLOCK_SIZE,
        num_kv_blocks=pool // BLOCK_SIZE,
        startup_s=startup_s,
        kv_bytes_per_token=float(kv_bytes_per_token(model, kv_dtype)),
        source=(
            f"roofline {name or model.name + ' on ' + gpu.name}: {model.name} {dtype} (KV {kv_dtype}), "
            f"tp={tp} x {gpu.name}; bandwidth x {gpu.bandwidth_efficiency}, FLOP/s x "
            f"{gpu.flops_efficiency}; KV pool {pool} tokens; startup_s assumed unless measured"
        ),
    )


def default_tp(gpu: Gpu, model: ModelShape, dtype: str = "bf16") -> int | None:
    """Smallest power-of-two tensor-parallel size (<= 8) that leaves MIN_POOL_TOKENS of KV."""
    for tp in (1, 2, 4, 8):
        if kv_pool_tokens(gpu, model, dtype, tp) >= MIN_POOL_TOKENS:
            return tp
    return None


def _known() -> str:
    return (
        f"GPUs: {', '.join(GPUS)}; models: {', '.join(MODELS)}; dtypes: {', '.join(DTYPE_BYTES)} "
        "(NAME = GPU/MODEL[/DTYPE][/tpN], e.g. h100/llama-3.1-8b, h100/llama-3.1-70b/fp8/tp2; "
        "--list-calibrations prints them)"
    )


def calibration_by_name(name: str, startup_s: float = DEFAULT_STARTUP_S) -> Calibration:
    """GPU/MODEL[/DTYPE][/tpN] -> Calibration; unknown parts raise UnknownCalibration listing the known."""
    parts = [p.strip().lower() for p in name.split("/")]
    if len(parts) < 2 or len(parts) > 4:
        raise UnknownCalibration(f"calibration {name!r} is not GPU/MODEL[/DTYPE][/tpN]; {_known()}")
    gpu_name, model_name, rest = parts[0], parts[1], parts[2:]
    if gpu_name not in GPUS:
        raise UnknownCalibration(f"unknown GPU {parts[0]!r}; {_known()}")
    if model_name not in MODELS:
        raise UnknownCalibration(f"unknown model {parts[1]!r}; {_known()}")
    dtype, tp = "bf16", None
    for p in rest:
        if p in DTYPE_BYTES:
            dtype = p
        elif p.startswith("tp") and p[2:].isdigit() and int(p[2:]) >= 1:
            tp = int(p[2:])
        else:
            raise UnknownCalibration(f"calibration {name!r}: {p!r} is neither a dtype nor tpN; {_known()}")
    gpu, model = GPUS[gpu_name], MODELS[model_name]
    peak_flops(gpu, dtype)  # refuses fp8 where there is none
    if tp is None:
        tp = default_tp(gpu, model, dtype)
        if tp is None:
            raise UnknownCalibration(f"{model.name} ({dtype}) does not fit on 8 x {gpu.name}")
    return calibration_for(gpu, model, dtype, tp, startup_s=startup_s, name=name)


def list_calibrations() -> list[dict[str, object]]:
    """Every GPU/model pair (bf16, and fp8 where the GPU has it) at its default tensor-parallel size."""
    out: list[dict[str, object]] = []
    for g_key, gpu in GPUS.items():
        for m_key, model in MODELS.items():
            for dtype in ("bf16", "fp8"):
                if dtype == "fp8" and gpu.fp8_flops is None:
                    continue
                tp = default_tp(gpu, model, dtype)
                if tp is None:
                    continue
                name = f"{g_key}/{m_key}" + ("/fp8" if dtype == "fp8" else "")
                out.append(
                    {
                        "name": name,
                        "gpu": gpu.name,
                        "model": model.name,
                        "dtype": dtype,
                        "tp": tp,
                        "kv_pool_tokens": kv_pool_tokens(gpu, model, dtype, tp),
                    }
                )
    return out


def resolve_calibration(value: str, startup_s: float | None = None) -> Calibration:
    """--calibration: an existing JSON file, else a GPU/MODEL name. startup_s overrides either."""
    from dataclasses import replace

    path = Path(value)
    if value.endswith(".json") or path.is_file():
        try:
            cal = Calibration.from_file(path)  # a ValueError names the file
        except OSError as exc:
            raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    else:
        cal = calibration_by_name(value)
    return cal if startup_s is None else replace(cal, startup_s=startup_s)
