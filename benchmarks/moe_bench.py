#!/usr/bin/env python
"""kvpilot vs Hugging Face transformers `generate` on a random-weight Mixture-of-Experts model with
OLMoE-1B-7B's layer shapes (hidden 2048, 16 heads, 64 experts of width 1024, top-8, vocabulary
50304) and fewer layers, so that two copies fit this machine. Both engines get the same weights
(transformers' random init, copied into kvpilot through its checkpoint names), the same batch of
prompts and the same number of new tokens; greedy, EOS ignored.

Prints one JSON document: the machine, the configuration, and
* `generate`: output tokens/s of each engine for the whole batch (prefill + decode, wall clock;
  kvpilot without prefix caching, so no call reuses an earlier call's prompt KV),
  best of `--rounds` rounds run alternately (kvpilot, HF, kvpilot, ...) so that load from other
  work on a shared machine hits both; one kvpilot engine per `--quantization` storage (none, int8,
  int4: experts and linear layers quantized as the runtime's flag does; transformers stays in
  --dtype, so those ratios compare different precisions), with `quantization_quality` saying what
  the quantization cost in log-probability; `--split`: decode tok/s apart from the prefill. HF
  runs with each experts implementation it offers here (`eager` loop, `grouped_mm`) and the faster
  one is the baseline; the ratio kvpilot / HF.
* `roofline`: the decode step's floor on this machine: bytes of weights one step must read (the
  experts a batch of B sequences is expected to touch, E * (1 - (1 - k / E)^B) per layer, plus
  attention, router and LM head; at the expert storage of each engine), over the copy bandwidth
  measured here (read + write of a 512 MiB tensor, best of 5), and what a >= 3x ratio would need;
  `compute`: the step's FLOPs over a bf16 matmul rate probed once (an estimate, not a floor: the
  probe's small shape under-reads what the engines get, see docs/benchmarks.md).
* `--backend-layer` (alone): one Mixtral-shaped MoE layer on each backend the device has
  (`grouped` loop, torch `grouped_mm`, the Triton grouped GEMM), checked against the reference,
  ms per call and expert-weight GB/s (scripts/gpu_check.sh).
* `moe_layer`: milliseconds of one MoE block at T tokens: each kvpilot engine's experts
  (`FusedMoE.forward`: on CPU the fused C call up to cpu_moe.max_rows_per_expert rows per expert,
  every row count for bf16 with AVX512-BF16, else `moe_grouped`; quantized or not), a `torch._grouped_mm` variant, and transformers' experts.
* `--prefill-profile` (alone): where one prefill goes in each engine (per-module thread CPU time,
  one thread, fresh prompts every call; kvpilot's engine steps and tokens per step).
* `--cpu-kernel` (alone): one OLMoE-shaped layer, the fused CPU call (kernels/cpu_moe.py) at each ISA
  level vs the per-expert torch loop, one thread, thread CPU time (robust to a shared machine); with
  --threads > 1 (default: every core) also both at that many threads, wall clock.

Usage:
    python benchmarks/moe_bench.py                        # 2 layers, batch 32
    python benchmarks/moe_bench.py --layers 1 --quantization none,int8,int4 --split   # quantized experts
    python benchmarks/moe_bench.py --layers 1 --batch 8 --new-tokens 8 --rounds 1   # smoke run
    python benchmarks/moe_bench.py --backend-layer --device cuda --out moe_backends.json   # GPU
    python benchmarks/moe_bench.py --cpu-kernel --layer-tokens 1,32,128,256 --rounds 3   # fused CPU call
    python benchmarks/moe_bench.py --prefill-profile --layers 1 --rounds 3   # where a prefill goes
    TRITON_INTERPRET=1 python benchmarks/moe_bench.py --backend-layer --tiny   # its CPU smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see runtime_vs_peers.py)

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import copy_bandwidth
from peers.measure import cpu_probe, machine_info
from workload import best_seconds

from kvpilot.runtime.engine.build import engine_from_loaded

OLMOE_1B_7B = dict(
    vocab_size=50304,
    hidden_size=2048,
    intermediate_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=False,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def build_hf(layers: int, dtype: torch.dtype, seed: int) -> Any:
    import transformers as tf

    cfg = tf.OlmoeConfig(**OLMOE_1B_7B, num_hidden_layers=layers, pad_token_id=1, eos_token_id=None)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = tf.OlmoeForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # explicit random weights (norms stay 1)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = None
    return model


def checkpoint_tensors(hf: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' in-memory OLMoE (experts fused as [E, 2I, H] / [E, H, I]) under checkpoint names."""
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", t[e, :inter]
                yield f"{prefix}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def build_kvpilot(hf: Any, dtype: torch.dtype, args: argparse.Namespace) -> Any:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.load.hf_checkpoint import hf_arch_config
    from kvpilot.runtime.load.loader import LoadedModel, build_model
    from kvpilot.runtime.load.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf.config.architectures = ["OlmoeForCausalLM"]
        hf.config.save_pretrained(tmp)  # config.json only: the weights come from memory
        vocab = {f"t{i}": i for i in range(hf.config.vocab_size)}
        HFTokenizer(models.WordLevel(vocab, unk_token="t0")).save(f"{tmp}/tokenizer.json")
        Path(tmp, "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
        arch = hf_arch_config(Path(tmp))
        tokenizer = Tokenizer.from_hf_dir(tmp)
        model = build_model(arch, torch.device("cpu"), dtype)
        model.load_weights(checkpoint_tensors(hf))
    cfg = EngineConfig(
        model="olmoe-shaped",
        device="cpu",
        dtype=str(dtype).removeprefix("torch."),  # type: ignore[arg-type]
        threads=args.threads,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens,
        kv_cache_memory=int(args.kv_gib * 2**30),
        # every call re-sends the same prompts; with prefix caching a later call would find their
        # first blocks cached and compute half the prompt tokens, a saving transformers' generate
        # has no counterpart for, so each prefill here computes all of them
        enable_prefix_caching=False,
    )
    loaded = LoadedModel(
        model.eval(), tokenizer, arch, "olmoe-shaped", 4096, Path("."), torch.device("cpu"), dtype
    )
    return engine_from_loaded(loaded, cfg)


def run_kvpilot(engine: Any, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(s.output_token_ids) == new for s in seqs)
    return dt, [list(s.output_token_ids) for s in seqs]


def run_hf(hf: Any, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)  # equal lengths: no padding
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return dt, out[:, ids.shape[1] :].tolist()


def moe_layer_times(hf: Any, engines: dict[str, Any], tokens: list[int], seconds: float) -> dict[str, Any]:
    """ms per MoE block forward (router excluded: same for all) at T tokens, first layer's weights:
    each kvpilot engine's experts (`FusedMoE.forward`, with the path it took; where that was the
    fused CPU call, also the per-expert torch loop it replaces), a `torch._grouped_mm` variant of
    the unquantized one, and transformers' experts forward."""
    from kvpilot.runtime.models.moe import route

    blocks = {name: e.runner.model.model.layers[0].mlp for name, e in engines.items()}
    hf_experts = hf.model.layers[0].mlp.experts
    router = hf.model.layers[0].mlp.gate
    k = hf.config.num_experts_per_tok
    w13t = hf_experts.gate_up_proj.transpose(1, 2).contiguous()  # [E, H, 2I]
    w2t = hf_experts.down_proj.transpose(1, 2).contiguous()  # [E, I, H]

    def grouped_mm(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, flat = x.shape[0], ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=w13t.shape[0]), 0).to(torch.int32)
        h = torch._grouped_mm(x.index_select(0, order // k), w13t, offs=offs)
        inter = h.shape[1] // 2
        o = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w2t, offs=offs)
        un = torch.empty_like(o)
        un[order] = o
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), un.view(t, k, -1)).squeeze(1)

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    for t in tokens:
        x = (torch.randn(t, w13t.shape[1], generator=g) * 0.5).to(w13t.dtype)
        weights, ids = route(F.linear(x, router.weight), k, hf.config.norm_topk_prob)
        row: dict[str, Any] = {}
        for name, block in blocks.items():
            fn = partial(block.experts, x, weights, ids)
            row[f"{name}_ms"] = round(1e3 * best_seconds(fn, seconds, 3), 1)
            row[f"{name}_path"] = block.experts.last_path
            if block.experts.last_path == "cpu_fused":  # the per-expert torch loop it replaces
                block.experts.use_cpu_kernel = False
                row[f"{name}_torch_loop_ms"] = round(1e3 * best_seconds(fn, seconds, 3), 1)
                block.experts.use_cpu_kernel = True
        try:
            with torch.inference_mode():
                ref = hf_experts(x, ids, weights.to(x.dtype))
            torch.testing.assert_close(grouped_mm(x, weights, ids), ref, rtol=2e-2, atol=2e-2)
            row["torch_grouped_mm_ms"] = round(
                1e3 * best_seconds(partial(grouped_mm, x, weights, ids), seconds, 3), 1
            )
        except (RuntimeError, AssertionError) as e:
            row["torch_grouped_mm_ms"] = f"unavailable: {str(e).splitlines()[0][:120]}"
        for impl in ("eager", "grouped_mm"):
            hf.set_experts_implementation(impl)
            with torch.inference_mode():
                row[f"hf_{impl}_ms"] = round(
                    1e3 * best_seconds(partial(hf_experts, x, ids, weights.to(x.dtype)), seconds, 3), 1
                )
        out[f"T={t}"] = row
    return out


def expected_active_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Pure: how many distinct experts B sequences touch in one decode step, each choosing k of E
    (uniform routing: a random-weight router is close to it)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_step_bytes(
    model: dict[str, Any],
    layers: int,
    batch: int,
    context: int,
    expert_bytes_per_weight: float,
    dense_bytes_per_weight: float = 2.0,
) -> dict[str, float]:
    """Pure: bytes one decode step of `batch` sequences at `context` tokens reads, by part. Experts
    at `expert_bytes_per_weight` (2 bf16, ~1.03 int8 per channel, ~0.56 int4 group 32 with float16
    scale and min), attention and router at `dense_bytes_per_weight`, LM head and KV cache in bf16."""
    h, inter, e, k = (
        model["hidden_size"],
        model["intermediate_size"],
        model["num_experts"],
        model["num_experts_per_tok"],
    )
    active = expected_active_experts(e, k, batch)
    kv_width = h * model["num_key_value_heads"] // model["num_attention_heads"]
    parts = {
        "experts": layers * active * 3 * h * inter * expert_bytes_per_weight,
        "attention": layers * (2 * h * h + 2 * h * kv_width) * dense_bytes_per_weight,
        "router": layers * e * h * 2.0,
        "lm_head": model["vocab_size"] * h * 2.0,
        "kv_cache": layers * batch * context * 2 * kv_width * 2.0,
    }
    return parts | {"total": sum(parts.values()), "active_experts_per_layer": active}


def step_flop(model: dict[str, Any], layers: int, tokens: int, logit_rows: int | None = None) -> float:
    """Pure: matmul FLOP of one forward over `tokens` tokens (each through its k experts and the
    attention projections; attention scores left out: small at these contexts) plus the LM head on
    `logit_rows` of them (default all; a prefill needs only each sequence's last token, and both
    engines compute only those: kvpilot's sampled rows, transformers' `logits_to_keep`)."""
    h, inter, k = model["hidden_size"], model["intermediate_size"], model["num_experts_per_tok"]
    kv_width = h * model["num_key_value_heads"] // model["num_attention_heads"]
    per_token = layers * (k * 3 * h * inter + 2 * h * h + 2 * h * kv_width + model["num_experts"] * h)
    rows = tokens if logit_rows is None else logit_rows
    return 2.0 * (tokens * per_token + rows * model["vocab_size"] * h)


def last_layer_saving_flop(model: dict[str, Any], tokens: int, logit_rows: int) -> float:
    """Pure: matmul FLOP kvpilot leaves out of a forward over `tokens` tokens where only
    `logit_rows` are sampled: its last layer runs o_proj, the router and the experts on those rows
    only (CausalLM.forward's logit_rows); transformers runs them on every row."""
    h, inter, k = model["hidden_size"], model["intermediate_size"], model["num_experts_per_tok"]
    return 2.0 * (tokens - logit_rows) * (k * 3 * h * inter + h * h + model["num_experts"] * h)


def bf16_matmul_rate(rows: int, seconds: float = 1.0) -> float:
    """FLOP/s of a bf16 [rows x 2048] @ [2048 x 2048] F.linear right now (the attention shape at the
    batch; the experts' matmuls of ~4 rows each do worse)."""
    x = torch.randn(rows, 2048).to(torch.bfloat16)
    w = torch.randn(2048, 2048).to(torch.bfloat16)
    return 2.0 * rows * 2048 * 2048 / best_seconds(partial(F.linear, x, w), seconds, 5)


def roofline(
    args: argparse.Namespace, bandwidth: float, hf_tok_s: float, quant_bytes: dict[str, float]
) -> dict[str, Any]:
    """The decode floor at bf16 experts (and at the quantized storage when --quantization is given)
    against what transformers reached: how far 3x is from what bandwidth allows."""
    context = args.prompt_len + args.new_tokens // 2  # mean context over the decode steps
    out: dict[str, Any] = {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "mean_context": context}
    storages = {"bf16": 2.0} | quant_bytes
    for label, per_weight in storages.items():
        dense = 2.0 if label == "bf16" else per_weight
        parts = decode_step_bytes(OLMOE_1B_7B, args.layers, args.batch, context, per_weight, dense)
        step_s = parts["total"] / bandwidth
        ceiling = args.batch / step_s
        out[f"experts_{label}"] = {
            "bytes_per_step_mb": {
                k: round(v / 1e6, 1) for k, v in parts.items() if k != "active_experts_per_layer"
            },
            "active_experts_per_layer": round(parts["active_experts_per_layer"], 1),
            "floor_ms_per_step": round(1e3 * step_s, 1),
            "ceiling_decode_tok_s": round(ceiling, 1),
        }
    bf16 = out["experts_bf16"]
    rate = bf16_matmul_rate(args.batch)
    decode_flop = step_flop(OLMOE_1B_7B, args.layers, args.batch)
    prefill_flop = step_flop(OLMOE_1B_7B, args.layers, args.batch * args.prompt_len, args.batch)
    ours = prefill_flop - last_layer_saving_flop(OLMOE_1B_7B, args.batch * args.prompt_len, args.batch)
    decode_s = (args.new_tokens - 1) * max(decode_flop / rate, bf16["floor_ms_per_step"] / 1e3)
    out["compute"] = {
        "bf16_matmul_gflop_s": round(rate / 1e9, 1),
        "decode_step_gflop": round(decode_flop / 1e9, 1),
        "decode_floor_ms_per_step": round(1e3 * decode_flop / rate, 1),
        "prefill_gflop": round(prefill_flop / 1e9, 1),
        "prefill_floor_s": round(prefill_flop / rate, 2),
        # the whole generate: one prefill (compute bound) + new_tokens - 1 decode steps, each at the
        # larger of its byte and FLOP floors
        "generate_floor_s": round(prefill_flop / rate + decode_s, 2),
        # kvpilot's prefill: the last layer past attention on the sampled rows only
        "kvpilot_prefill_gflop": round(ours / 1e9, 1),
        "kvpilot_generate_floor_s": round(ours / rate + decode_s, 2),
    }
    # transformers' generate rate (prefill included: a lower bound on its decode rate)
    out["hf_tok_s_fraction_of_bf16_ceiling"] = round(hf_tok_s / bf16["ceiling_decode_tok_s"], 3)
    out["max_ratio_vs_hf_at_bf16"] = round(bf16["ceiling_decode_tok_s"] / hf_tok_s, 2)
    need = 3 * hf_tok_s  # tok/s a 3x needs -> bytes per step the step may read at the measured bandwidth
    out["bytes_per_step_for_3x_mb"] = round(args.batch / need * bandwidth / 1e6, 1)
    return out


MIXTRAL_LAYER = dict(num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336)
TINY_LAYER = dict(num_experts=4, top_k=2, hidden_size=64, intermediate_size=96)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def backend_layer_times(
    device: torch.device, dtype: torch.dtype, shape: dict[str, int], tokens: list[int], repeats: int
) -> dict[str, Any]:
    """One MoE layer (`FusedMoE`, random weights) on each backend that runs on `device`: checked
    against `moe_reference` (max error relative to its largest output), then ms per call (best of
    `repeats`, synchronized) and the GB/s of expert weights that implies (the experts a batch
    touches, each read once). `grouped_mm` needs bfloat16 on CUDA; `triton` a GPU, or the
    interpreter (TRITON_INTERPRET=1) on the CPU."""
    from kvpilot.kernels import triton_moe
    from kvpilot.runtime.models.moe import FusedMoE, moe_reference, route

    e, k, h, inter = shape["num_experts"], shape["top_k"], shape["hidden_size"], shape["intermediate_size"]
    g = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):  # the empty parameters straight on the device
        layer = FusedMoE(e, h, inter)
    layer.w13.data = (torch.randn(e, 2 * inter, h, generator=g, device=device) / h**0.5).to(dtype)
    layer.w2.data = (torch.randn(e, h, inter, generator=g, device=device) / inter**0.5).to(dtype)
    backends = ["grouped"]
    if device.type == "cuda" and dtype == torch.bfloat16 and hasattr(F, "grouped_mm"):
        backends.append("grouped_mm")
    if triton_moe.available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        backends.append("triton")
    out: dict[str, Any] = {"shape": shape, "dtype": str(dtype), "backends": backends}
    for t in tokens:
        x = torch.randn(t, h, generator=g, device=device).to(dtype)
        weights, ids = route(torch.randn(t, e, generator=g, device=device), k, renormalize=True)
        ref = moe_reference(x.float(), layer.w13.float(), layer.w2.float(), weights, ids)
        active = int(torch.unique(ids).numel())
        expert_bytes = active * 3 * h * inter * layer.w13.element_size()
        row: dict[str, Any] = {"active_experts": active}
        for name in backends:
            layer.backend = name
            got = layer(x, weights, ids).float()
            best = float("inf")
            for _ in range(repeats):
                _sync(device)
                t0 = time.perf_counter()
                layer(x, weights, ids)
                _sync(device)
                best = min(best, time.perf_counter() - t0)
            row[name] = {
                "max_rel_err": round(float((got - ref).abs().max() / ref.abs().max()), 5),
                "ms": round(1e3 * best, 3),
                "expert_gb_s": round(expert_bytes / best / 1e9, 1),
            }
        out[f"T={t}"] = row
    return out


BYTES_PER_WEIGHT = {"none": 2.0, "int8": 1.0 + 2 / 1024}  # int8: a float16 scale per row of >= 1024


def _finite_or(x: float, word: str) -> float | str:
    return x if x != float("inf") else word


def cpu_kernel_times(
    dtypes: list[torch.dtype], tokens: list[int], levels: list[str], repeats: int, threads: int = 1
) -> dict[str, Any]:
    """One OLMoE-shaped MoE layer (random weights, a random router's top-8) on the CPU, one thread:
    the fused C call (kernels/cpu_moe.py, at each ISA level in `levels`) against the per-expert torch
    loop (`moe_grouped`), in the same process. Milliseconds of *thread CPU time*
    (time.thread_time, best of `repeats`): on a shared machine wall time counts other work, CPU time
    of one thread does not (memory contention still shows). `rows_per_expert` = T * k / E, the
    quantity cpu_moe.max_rows_per_expert bounds. With `threads` > 1 also the wall milliseconds of
    the loop and of the fused call (first level) at that many threads, best of `repeats`: what the
    per-call thread barriers of the loop's 2 x (active experts) parallel matmuls cost, which one
    thread's CPU time cannot show (on a shared machine the wall figures carry the load too)."""
    from kvpilot.kernels import cpu_moe, isa
    from kvpilot.runtime.models.moe import moe_grouped, route

    e, k, h, inter = (
        OLMOE_1B_7B[n] for n in ("num_experts", "num_experts_per_tok", "hidden_size", "intermediate_size")
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)

    def cpu_ms(fn: Any, clock: Any = time.thread_time) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            fn()
            best = min(best, clock() - t0)
        return round(1e3 * best, 1)

    def wall_ms(fn: Any) -> float:
        torch.set_num_threads(threads)
        try:
            return cpu_ms(fn, time.perf_counter)
        finally:
            torch.set_num_threads(1)

    out: dict[str, Any] = {
        "timer": f"time.thread_time, 1 thread, best of {repeats}",
        "max_rows_per_expert": {
            str(d).removeprefix("torch."): _finite_or(cpu_moe.max_rows_per_expert(d, levels[0]), "unlimited")
            for d in dtypes
        },
        "bf16_dot": {lvl: cpu_moe.bf16_dot(lvl) for lvl in levels},
        "runnable_levels": isa.runnable(),
    }
    g = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.02).to(dtype)
        w2 = (torch.randn(e, h, inter, generator=g) * 0.02).to(dtype)
        rows: dict[str, Any] = {}
        for t in tokens:
            x = torch.randn(t, h, generator=g).to(dtype)
            weights, ids = route(torch.randn(t, e, generator=g), k, False)
            loop = moe_grouped(x, w13, w2, weights, ids)
            row: dict[str, Any] = {
                "rows_per_expert": t * k / e,
                "torch_loop_ms": cpu_ms(partial(moe_grouped, x, w13, w2, weights, ids)),
            }
            for lvl in levels:
                fused = cpu_moe.fused_experts(x, w13, w2, weights, ids, level=lvl)
                row[f"fused_{lvl}_rel_diff"] = float(
                    f"{float((fused.float() - loop.float()).norm() / loop.float().norm()):.2g}"
                )
                row[f"fused_{lvl}_ms"] = cpu_ms(
                    partial(cpu_moe.fused_experts, x, w13, w2, weights, ids, level=lvl)
                )
            row["speedup"] = round(row["torch_loop_ms"] / row[f"fused_{levels[0]}_ms"], 2)
            if threads > 1:
                loop_wall = wall_ms(partial(moe_grouped, x, w13, w2, weights, ids))
                fused_wall = wall_ms(
                    partial(cpu_moe.fused_experts, x, w13, w2, weights, ids, level=levels[0])
                )
                row[f"wall_{threads}_threads"] = {
                    "torch_loop_ms": loop_wall,
                    f"fused_{levels[0]}_ms": fused_wall,
                    "speedup": round(loop_wall / fused_wall, 2),
                }
            rows[f"T={t}"] = row
        out[str(dtype).removeprefix("torch.")] = rows
        del w13, w2
    torch.set_num_threads(before)
    return out


def prefill_profile(args: argparse.Namespace, dtype: torch.dtype, methods: list[str]) -> dict[str, Any]:
    """Where a prefill goes (--prefill-profile): a 1-token generate of `batch` fresh prompts in each
    engine, one thread, per-module `time.thread_time` (min over `rounds` calls, engines alternating):
    kvpilot's engine steps and tokens per step, QKV / attention / o_proj / q-k norms + rope, router,
    experts, LM head and what lies outside the model (scheduling, batch preparation, sampler), one
    kvpilot engine per `--quantization` storage (quantized as at load); transformers' attention
    block, router, experts and LM head."""
    import collections

    from kvpilot.runtime.load.quantization import quantize_lm_head, quantize_model, tile_for_cpu

    torch.set_num_threads(1)
    args.threads = 1
    hf = build_hf(args.layers, dtype, args.seed)
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(obj: Any, attr: str, part: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[part] += time.thread_time() - t0

        setattr(obj, attr, wrapper)

    engines: dict[str, Any] = {}
    steps = {"n": 0, "tokens": 0}
    for m in methods:
        name = "kvpilot" if m == "none" else f"kvpilot_{m}"
        engine = engines[name] = build_kvpilot(hf, dtype, args)
        model = engine.runner.model
        if m != "none":
            quantize_model(model, m, args.quantization_group_size)
            quantize_lm_head(model)
            tile_for_cpu(model)
        for i, layer in enumerate(model.model.layers):
            att = layer.self_attn
            timed(att.qkv_proj, "forward", f"{name}.qkv_proj")
            timed(att.attn, "forward", f"{name}.attention")
            timed(att.o_proj, "forward", f"{name}.o_proj")
            for norm in (att.q_norm, att.k_norm):
                if norm is not None:
                    timed(norm, "forward", f"{name}.qk_norm_rope")
            if i == 0:  # one module shared by every layer
                timed(att.rotary_emb, "forward", f"{name}.qk_norm_rope")
            timed(layer.mlp.gate, "forward", f"{name}.router")
            timed(layer.mlp.experts, "forward", f"{name}.experts")
        timed(model, "forward", f"{name}.model")
        timed(model, "compute_logits", f"{name}.lm_head")
        execute = engine.runner.execute

        def counted(scheduled: Any, execute: Any = execute) -> Any:
            steps["n"] += 1
            steps["tokens"] += sum(s.num_new_tokens for s in scheduled)
            return execute(scheduled)

        engine.runner.execute = counted
    for layer in hf.model.layers:
        timed(layer.self_attn, "forward", "hf.attention_block")
        timed(layer.mlp.gate, "forward", "hf.router")
        timed(layer.mlp.experts, "forward", "hf.experts")
    timed(hf.model, "forward", "hf.model")
    timed(hf.lm_head, "forward", "hf.lm_head")
    hf.set_experts_implementation("grouped_mm")
    g = torch.Generator().manual_seed(args.seed + 1)

    def fresh() -> list[list[int]]:  # new prompts every call: nothing cached anywhere
        return torch.randint(
            3, OLMOE_1B_7B["vocab_size"], (args.batch, args.prompt_len), generator=g
        ).tolist()

    runs: list[tuple[str, Any, Any]] = [(n, run_kvpilot, e) for n, e in engines.items()]
    runs.append(("hf", run_hf, hf))
    for _, run, target in runs:
        run(target, fresh()[:2], 1)
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for prefix, run, target in runs:
            before = dict(spent)
            steps["n"] = steps["tokens"] = 0
            t0 = time.thread_time()
            run(target, fresh(), 1)
            spent[f"{prefix}.whole_1_token_generate"] += time.thread_time() - t0
            for k, v in spent.items():
                if k.startswith(prefix + "."):
                    best[k] = min(best.get(k, float("inf")), v - before.get(k, 0.0))
            if prefix != "hf":
                best[f"{prefix}.outside_model"] = (
                    best[f"{prefix}.whole_1_token_generate"]
                    - best[f"{prefix}.model"]
                    - best[f"{prefix}.lm_head"]
                )
                kv_steps = dict(steps)
    first = next(iter(engines.values())).runner.model.model.layers[0].mlp.experts
    return {
        "timer": f"time.thread_time, 1 thread, min of {args.rounds} alternating calls per part",
        "kvpilot_engine_steps": kv_steps["n"],
        "kvpilot_tokens_per_step": kv_steps["tokens"] // max(kv_steps["n"], 1),
        "kvpilot_experts_path": first.last_path,
        "hf_experts_implementation": "grouped_mm",
        "seconds": {k: round(v, 3) for k, v in sorted(best.items())},
    }


def bytes_per_weight(method: str, group: int) -> float:
    """Pure: stored bytes per expert weight (int4: half a byte + a float16 scale and min per group)."""
    return 0.5 + 4 / group if method == "int4" else BYTES_PER_WEIGHT[method]


def quantize_engine(engine: Any, method: str, group: int, sequences: list[list[int]]) -> dict[str, Any]:
    """Quantize the engine's model in place as --quantization does at load (experts and linear
    layers, then the LM head, then the CPU kernel's tiled layout) and measure what it costs: the
    log-probability the model gives `sequences` before and after."""
    from kvpilot.runtime.load.quantization import quantize_lm_head, quantize_model, tile_for_cpu

    before = [engine.score(s) for s in sequences]
    model = engine.runner.model
    report = quantize_model(model, method, group)
    quantize_lm_head(model)
    tile_for_cpu(model)
    after = [engine.score(s) for s in sequences]
    nll_b = -float(torch.cat(before).mean())
    nll_a = -float(torch.cat(after).mean())
    return {
        "weights_mb": {
            "before": round(report.bytes_before / 1e6, 1),
            "after": round(report.bytes_after / 1e6, 1),
        },
        "expert_layers": report.expert_layers,
        "nll_per_token_bf16": round(nll_b, 4),
        "nll_per_token_quantized": round(nll_a, 4),
        "perplexity_ratio": round(float(torch.exp(torch.tensor(nll_a - nll_b))), 4),
        "max_abs_logprob_diff": round(
            max(float((a - b).abs().max()) for a, b in zip(after, before, strict=True)), 4
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument(
        "--quantization",
        default="none",
        help="comma list of kvpilot weight storages to run, one engine each: none (the dtype), int8 "
        "(per channel), int4 (--quantization-group-size); experts and linear layers, as the runtime's "
        "--quantization; transformers always runs in --dtype",
    )
    ap.add_argument("--quantization-group-size", type=int, choices=[32, 64, 128], default=32)
    ap.add_argument(
        "--split", action="store_true", help="also time a 1-token generate per engine: decode tok/s apart"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-gib", type=float, default=0.5)
    ap.add_argument(
        "--layer-tokens", default="1,32,256", help="T values for the MoE layer timing ('' to skip)"
    )
    ap.add_argument("--layer-seconds", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--backend-layer",
        action="store_true",
        help="only time one MoE layer on each backend (Mixtral's layer shape; --tiny: a toy one) "
        "on --device, checked against the reference; scripts/gpu_check.sh runs it on CUDA",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="for --backend-layer")
    ap.add_argument("--tiny", action="store_true", help="for --backend-layer: a toy layer shape")
    ap.add_argument(
        "--cpu-kernel",
        action="store_true",
        help="only time one OLMoE-shaped MoE layer on the CPU, one thread, CPU time: the fused C call "
        "(kernels/cpu_moe.py) at each --levels ISA level vs the per-expert torch loop, at --layer-tokens, "
        "for --dtypes",
    )
    ap.add_argument("--dtypes", default="bfloat16,float32", help="for --cpu-kernel")
    ap.add_argument(
        "--levels", default="", help="for --cpu-kernel: ISA levels (default: the vector ones this CPU runs)"
    )
    ap.add_argument(
        "--prefill-profile",
        action="store_true",
        help="only profile one prefill per engine: per-module thread CPU time, one thread",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = ap.parse_args()
    methods = [m.strip() for m in args.quantization.split(",") if m.strip()]
    bad = [m for m in methods if m not in ("none", "int8", "int4")]
    if bad or not methods:
        ap.error(f"--quantization: expected a comma list of none, int8, int4; got {args.quantization!r}")
    if args.prefill_profile:
        result = {"machine": machine_info(), "config": vars(args)} | prefill_profile(
            args, getattr(torch, args.dtype), methods
        )
        text = json.dumps(result, indent=2, default=str)
        print(text)
        if args.out is not None:
            args.out.write_text(text + "\n")
        return
    if args.cpu_kernel:
        from kvpilot.kernels import isa

        vector = [v for v in isa.runnable() if v != "generic"] or ["generic"]
        levels = [v for v in args.levels.split(",") if v] or vector
        bad = [v for v in levels if v not in isa.runnable()]
        if bad:
            ap.error(f"--levels: {bad} not runnable here (this CPU runs {isa.runnable()})")
        dts = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        if not dts or any(d not in ("bfloat16", "float32") for d in dts):
            ap.error(f"--dtypes: expected a comma list of bfloat16, float32; got {args.dtypes!r}")
        result = {"machine": machine_info()} | cpu_kernel_times(
            [getattr(torch, d) for d in dts],
            [int(t) for t in args.layer_tokens.split(",")],
            levels,
            args.rounds,
            args.threads,
        )
        text = json.dumps(result, indent=2)
        print(text)
        if args.out is not None:
            args.out.write_text(text + "\n")
        return
    if args.backend_layer:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device")
        torch.set_num_threads(args.threads)
        shape = TINY_LAYER if args.tiny else MIXTRAL_LAYER
        result = {"machine": machine_info()} | backend_layer_times(
            device,
            getattr(torch, args.dtype),
            shape,
            [1, 32] if args.tiny else [1, 32, 128, 512],
            1 if args.tiny else 20,
        )
        if device.type == "cuda":
            result["gpu"] = torch.cuda.get_device_name(device)
        text = json.dumps(result, indent=2)
        print(text)
        if args.out is not None:
            args.out.write_text(text + "\n")
        return
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    record: dict[str, Any] = {
        "machine": machine_info(),
        "config": vars(args) | {"model": OLMOE_1B_7B, "kvpilot_prefix_caching": False},
    }
    t0 = time.perf_counter()
    hf = build_hf(args.layers, dtype, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, OLMOE_1B_7B["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    useful = args.batch * args.new_tokens
    # what quantization costs, measured on two of the prompts continued by transformers' greedy tokens
    _, hf_cont = run_hf(hf, prompts[:2], args.new_tokens)
    scored = [p + c for p, c in zip(prompts[:2], hf_cont, strict=True)]
    engines: dict[str, Any] = {}
    quality: dict[str, Any] = {}
    for m in methods:
        name = "kvpilot" if m == "none" else f"kvpilot_{m}"
        engines[name] = build_kvpilot(hf, dtype, args)
        if m != "none":
            quality[name] = quantize_engine(engines[name], m, args.quantization_group_size, scored)
    record["build_s"] = round(time.perf_counter() - t0, 1)
    if quality:
        record["quantization_quality"] = quality | {
            "note": "log-probabilities of 2 prompts + transformers' greedy continuation, the engine "
            f"before (--dtype {args.dtype}) and after quantizing; random weights: near-uniform "
            "next-token distributions, so the deficit is small in absolute terms"
        }

    # warm-up (one short request each)
    for engine in engines.values():
        run_kvpilot(engine, prompts[:2], 2)
    run_hf(hf, prompts[:2], 2)
    names = [*engines, "hf_eager", "hf_grouped_mm"]
    times: dict[str, list[float]] = {k: [] for k in names}
    prefill: dict[str, list[float]] = {k: [] for k in names}
    tokens: dict[str, list[list[int]]] = {}
    probes: list[float] = []
    for _ in range(args.rounds):
        probes.append(cpu_probe())
        for name in names:
            if name.startswith("hf_"):
                hf.set_experts_implementation(name.removeprefix("hf_"))
                fn = partial(run_hf, hf, prompts)
            else:
                fn = partial(run_kvpilot, engines[name], prompts)
            if args.split:
                prefill[name].append(fn(1)[0])
            dt, tokens[name] = fn(args.new_tokens)
            times[name].append(dt)
    best = {k: min(v) for k, v in times.items()}
    hf_best = min(("hf_eager", "hf_grouped_mm"), key=lambda k: best[k])

    def agree(a: list[list[int]], b: list[list[int]]) -> float:
        return round(sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) / len(a), 3)

    record["generate"] = {
        "output_tokens": useful,
        "wall_s": {k: [round(x, 2) for x in v] for k, v in times.items()},
        "output_tok_per_s": {k: round(useful / v, 1) for k, v in best.items()},
        "hf_baseline": hf_best,
        "vs_hf": {k: round(best[hf_best] / best[k], 2) for k in engines},
        "goal": ">= 3x at batch 32",
        # bf16 random weights: near-tied logits can pick different tokens; the first token of each
        # sequence comes from the same prompt in both engines
        "first_token_agreement_vs_hf": {k: agree(tokens[k], tokens[hf_best]) for k in engines},
        "cpu_probe_gflops": probes,
    }
    if args.split:
        # decode alone: (whole generate - a 1-token generate) over the new_tokens - 1 later steps;
        # best of each over the rounds
        decode = {k: args.batch * (args.new_tokens - 1) / max(best[k] - min(prefill[k]), 1e-9) for k in names}
        record["generate"]["prefill_s"] = {k: [round(x, 2) for x in v] for k, v in prefill.items()}
        record["generate"]["decode_tok_per_s"] = {k: round(v, 1) for k, v in decode.items()}
        record["generate"]["decode_vs_hf"] = {k: round(decode[k] / decode[hf_best], 2) for k in engines}
    hf_tok_s = useful / best[hf_best]
    quant = {m: bytes_per_weight(m, args.quantization_group_size) for m in methods if m != "none"}
    record["roofline"] = roofline(args, copy_bandwidth(torch.device("cpu"), 512 * 2**20), hf_tok_s, quant)
    if args.layer_tokens:
        record["moe_layer"] = moe_layer_times(
            hf, engines, [int(t) for t in args.layer_tokens.split(",")], args.layer_seconds
        )
    record["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(record, indent=2, default=str)  # default: --out's Path in the config
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
