#!/usr/bin/env python
"""Decode and prefill speed of the runtime on random-weight models of real shapes; prints/writes JSON.

Made for scripts/gpu_check.sh on one GPU (no network: the weights are random, built on the device
from a transformers-style config.json written here; the tokenizer is the builtin SmolLM2 one, whose
ids all exist in both vocabularies). Figures:

* decode tokens/s at each batch size (default 1, 32, 128): B sequences with a short prompt, then only
  decode steps are timed (every sequence has its first token before the clock starts);
* prefill tokens/s: prompts of --prefill-len tokens, one output token each, the whole run timed;
* at batch 1, the fraction of memory bandwidth reached: bytes a decode step must read (every weight
  but the embedding table, plus the KV context) / step time, over the device's copy bandwidth measured
  in this run and, for known GPUs, over the datasheet figure;
* `--compare-backends`: batch-32 decode with each CUDA attention path the machine has (Triton at block
  16, flash-attn at block 256 when installed), the measurement behind the runtime's default.

`--quantization int4|int8`: after the 16-bit figures, the 8B-shaped model's linear layers are quantized in
place (runtime/load/quantization.py) and decode is measured again at the first two batch sizes: tokens/s,
the ratio to the 16-bit run, and the bytes/s a batch-1 step reads (on CUDA the matmuls are the Triton
kernel kernels/triton_qlinear.py; on CPU the C kernel).

`--moe`: also a Mixtral-shaped model (8 experts, top-2; fewer layers) when the runtime registers
MixtralForCausalLM; recorded as skipped otherwise. `--device cpu --tiny` runs every phase on small
shapes (the test suite runs it).

    python benchmarks/gpu_bench.py --device cuda --out results/gpu_bench.json --moe --compare-backends \
        --quantization int4
    python benchmarks/gpu_bench.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.load.hf_checkpoint import hf_arch_config
from kvpilot.runtime.load.loader import LoadedModel, build_model, resolve_model_path
from kvpilot.runtime.load.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests)
import harness

# HBM bandwidth from the datasheets (bytes/s), matched against torch.cuda.get_device_name()
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "A100-SXM4-80GB": 2.039e12}

LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
MIXTRAL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 8,  # of Mixtral-8x7B's 32: the layer shapes, a quarter of the depth
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
TINY_OVERRIDES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}


def random_model(config: dict[str, Any], device: torch.device, dtype: torch.dtype, name: str) -> LoadedModel:
    """A model of `config`'s architecture with random weights, built on `device` (nothing downloaded)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        arch = hf_arch_config(Path(tmp))
    model = build_model(arch, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norms (and biases): 1, so activations stay in range
                p.fill_(1.0 if "norm" in pname else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    tokenizer = Tokenizer.from_gguf(resolve_model_path(DEFAULT_MODEL))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        arch=arch,
        model_name=name,
        max_model_len=int(config["max_position_embeddings"]),
        path=Path(name),
        device=device,
        dtype=dtype,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    hi = min(vocab, 49152)  # ids the SmolLM2 tokenizer also knows
    return [torch.randint(100, hi, (length,), generator=gen).tolist() for _ in range(n)]


def decode_rate(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    """Decode tokens/s of `batch` sequences: prefill first (untimed), then time the decode steps."""
    device = engine.runner.device
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    vocab = engine.runner.model.config.vocab_size if hasattr(engine.runner.model, "config") else 512
    for i, p in enumerate(prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", p, params)
    while any(t.seq.num_output_tokens == 0 for t in engine.requests.values() if not t.seq.is_finished):
        engine.step()
    sync(device)
    steps, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        before = engine.generation_tokens
        engine.step()
        tokens += engine.generation_tokens - before
        steps += 1
    sync(device)
    elapsed = time.perf_counter() - start
    engine.requests.clear()
    return {
        "batch": batch,
        "tokens_per_s": tokens / elapsed,
        "step_ms": 1000 * elapsed / max(1, steps),
        "steps": steps,
        "context_tokens_at_end": prompt_len + new_tokens,
    }


def prefill_rate(engine: LLMEngine, num: int, length: int) -> dict[str, float]:
    device = engine.runner.device
    vocab = engine.runner.model.config.vocab_size if hasattr(engine.runner.model, "config") else 512
    ps = prompts(num, length, vocab, seed=7)
    sync(device)
    start = time.perf_counter()
    engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    sync(device)
    elapsed = time.perf_counter() - start
    engine.requests.clear()
    return {"prompts": num, "prompt_len": length, "tokens_per_s": num * length / elapsed}


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s a device-to-device copy moves (read + write), best of 5."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def decode_bytes_per_step(loaded: LoadedModel, engine: LLMEngine, context: int) -> int:
    """What one batch-1 decode step must read: every weight except the embedding table (one row of it is
    read) and, in a mixture of experts, only the experts a token is routed to (top-k of each layer's
    experts), plus the KV of the context."""
    from kvpilot.runtime.models.moe import FusedMoE

    arch = loaded.arch
    routed = arch.num_experts_per_tok / arch.num_experts if arch.num_experts else 1.0
    experts = {id(p) for m in loaded.model.modules() if isinstance(m, FusedMoE) for p in m.parameters()}
    total = 0.0
    for name, p in loaded.model.named_parameters():
        if "embed_tokens" in name and not arch.tie_word_embeddings:
            continue
        total += p.numel() * p.element_size() * (routed if id(p) in experts else 1.0)
    return int(total) + int(context * engine.runner.geometry.bytes_per_token)


def engine_for(loaded: LoadedModel, max_num_seqs: int, **overrides: Any) -> LLMEngine:
    cfg = EngineConfig(
        model=loaded.model_name,
        device=loaded.device.type,  # type: ignore[arg-type]
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(2048, max_num_seqs),
        enable_prefix_caching=False,
        **overrides,
    )
    return engine_from_loaded(loaded, cfg)


def close(engine: LLMEngine) -> None:
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def step_profile(engine: LLMEngine, prompt_len: int, steps: int = 16) -> dict[str, Any]:
    """Where a batch-1 decode step's time goes: torch.profiler over `steps` steps; the device's kernel
    time per step (CUDA: what the GPU is busy with; the rest of a step is the host's work, which the
    unprofiled step_ms divided by this shows) and the ops with the most device and host time."""
    from torch.profiler import ProfilerActivity, profile

    device = engine.runner.device
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    vocab = engine.runner.model.config.vocab_size if hasattr(engine.runner.model, "config") else 512
    engine.add_request(f"profile-{time.monotonic_ns()}", prompts(1, prompt_len, vocab, seed=7)[0], params)
    engine.step()  # the prefill, outside the profile
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    while engine.has_unfinished():
        engine.step()
    engine.requests.clear()
    events = prof.key_averages()

    def top(attr: str) -> list[list[Any]]:
        ranked = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:8]
        return [
            [e.key[:80], round(getattr(e, attr) / 1e3 / steps, 4)] for e in ranked if getattr(e, attr) > 0
        ]

    device_us = sum(e.self_device_time_total for e in events)
    return {
        "steps": steps,
        "device_ms_per_step": device_us / 1e3 / steps,
        "top_device_ms_per_step": top("self_device_time_total"),
        "top_host_ms_per_step": top("self_cpu_time_total"),
    }


def bench_model(
    loaded: LoadedModel, args: argparse.Namespace, batches: list[int], label: str
) -> dict[str, Any]:
    device = loaded.device
    t0 = time.perf_counter()
    engine = engine_for(
        loaded, max(batches), **({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {})
    )
    out: dict[str, Any] = {
        "model": label,
        "params": sum(p.numel() for p in loaded.model.parameters()),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "attention_backend": engine.runner.backend.name,
        "block_size": engine.runner.geometry.block_size,
        "cuda_graphs": None if engine.runner.graphs is None else engine.runner.graphs.sizes,
        "kv_pool_blocks": engine.runner.num_blocks,
        "engine_start_s": time.perf_counter() - t0,
    }
    decode_rate(engine, 1, 8, 4)  # warm-up: kernels compiled, allocator settled
    out["decode"] = [decode_rate(engine, b, args.prompt_len, args.decode_tokens) for b in batches]
    out["prefill"] = prefill_rate(engine, args.prefill_prompts, args.prefill_len)
    b1 = out["decode"][0]
    step_bytes = decode_bytes_per_step(loaded, engine, args.prompt_len + args.decode_tokens // 2)
    achieved = step_bytes / (b1["step_ms"] / 1000)
    measured = copy_bandwidth(device, args.copy_bytes)
    out["batch1_bandwidth"] = {
        "bytes_per_step": step_bytes,
        "achieved_bytes_per_s": achieved,
        "copy_bytes_per_s": measured,
        "fraction_of_copy_bandwidth": achieved / measured,
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        sheet = next((v for k, v in DATASHEET_BANDWIDTH.items() if k in name), None)
        out["batch1_bandwidth"]["datasheet_bytes_per_s"] = sheet
        out["batch1_bandwidth"]["fraction_of_datasheet"] = None if sheet is None else achieved / sheet
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    out["batch1_profile"] = step_profile(engine, args.prompt_len)
    out["batch1_profile"]["device_busy_fraction"] = (
        out["batch1_profile"]["device_ms_per_step"] / b1["step_ms"]
    )
    close(engine)
    return out


def compare_backends(loaded: LoadedModel, args: argparse.Namespace, batch: int) -> list[dict[str, Any]]:
    """Batch decode under each attention path the machine has (block size picks the path)."""
    from kvpilot.kernels.attention import flash_attn_available

    block_sizes = [16] + ([256] if loaded.device.type == "cuda" and flash_attn_available() else [])
    rows = []
    # batch x (prompt + output) tokens at 128 KiB a token (8B shapes), in whole 256-token blocks: 8 GiB
    pool = args.kv_cache_memory or (8 * 2**30 if loaded.device.type == "cuda" else 2**26)
    for bs in block_sizes:
        for eager in (False, True):
            engine = engine_for(
                loaded,
                batch,
                block_size=bs,
                enforce_eager=eager,
                kv_cache_memory=pool,
            )
            decode_rate(engine, 1, 8, 2)
            r = decode_rate(engine, batch, args.prompt_len, args.decode_tokens)
            r.update(backend=engine.runner.backend.name, block_size=bs, enforce_eager=eager)
            rows.append(r)
            close(engine)
    return rows


def bench_quantized(
    loaded: LoadedModel, args: argparse.Namespace, batches: list[int], unquantized: list[dict[str, Any]]
) -> dict[str, Any]:
    """Quantize `loaded`'s linear layers in place (its 16-bit weights are gone after), then decode."""
    from kvpilot.kernels import triton_qlinear
    from kvpilot.runtime.load.quantization import linear_layers, quantize_model

    t0 = time.perf_counter()
    report = quantize_model(loaded.model, args.quantization, args.quantization_group_size)
    sync(loaded.device)
    quantize_s = time.perf_counter() - t0
    gc.collect()
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    qw = next(m.qweight for _, m in linear_layers(loaded.model) if m.qweight is not None)
    probe = torch.zeros(1, qw.in_features, device=loaded.device, dtype=loaded.dtype)
    engine = engine_for(
        loaded, max(batches), **({"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {})
    )
    decode_rate(engine, 1, 8, 4)  # warm-up: kernels compiled
    rows = [decode_rate(engine, b, args.prompt_len, args.decode_tokens) for b in batches]
    base = {r["batch"]: r["tokens_per_s"] for r in unquantized}
    for r in rows:
        r["ratio_to_unquantized"] = r["tokens_per_s"] / base[r["batch"]]  # the same batch sizes, first two
    # what a batch-1 step reads: the quantized linear weights plus everything decode_bytes_per_step counts
    step_bytes = report.bytes_after + decode_bytes_per_step(
        loaded, engine, args.prompt_len + args.decode_tokens // 2
    )
    out = {
        "method": args.quantization,
        "group_size": report.group_size,
        "linear_bytes_before": report.bytes_before,
        "linear_bytes_after": report.bytes_after,
        "quantize_s": quantize_s,
        "matmul": "triton" if triton_qlinear.applies(probe, qw) else f"{loaded.device.type} (qlinear.matmul)",
        "decode": rows,
        "batch1_bytes_per_s": step_bytes / (rows[0]["step_ms"] / 1000),
    }
    close(engine)
    return out


def machine(device: torch.device) -> dict[str, Any]:
    import platform

    info: dict[str, Any] = {
        "host": harness.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import flash_attn

        info["flash_attn"] = flash_attn.__version__
    except ImportError:
        info["flash_attn"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30, cuda=torch.version.cuda)
    else:
        info["cpu"] = harness.cpu_model()
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes and batches (CPU dry run)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,32,128; tiny 1,4,8)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--prefill-len", type=int, default=None)
    ap.add_argument("--prefill-prompts", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: measured sizing)")
    ap.add_argument("--copy-bytes", type=int, default=None, help="buffer size of the bandwidth probe")
    ap.add_argument("--moe", action="store_true", help="also a Mixtral-shaped model, when supported")
    ap.add_argument("--compare-backends", action="store_true")
    ap.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        default=None,
        help="also decode with the 8B-shaped model's linear layers quantized (first two batch sizes)",
    )
    ap.add_argument("--quantization-group-size", type=int, choices=[32, 64, 128], default=32)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    tiny = args.tiny
    batches = [int(b) for b in (args.batches or ("1,4,8" if tiny else "1,32,128")).split(",")]
    defaults = {
        "prompt_len": (16, 128),
        "decode_tokens": (8, 128),
        "prefill_len": (64, 2048),
        "prefill_prompts": (2, 16),
    }
    for key, (small, big) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, small if tiny else big)
    if args.copy_bytes is None:
        args.copy_bytes = 1 << (24 if tiny else 32)
    dtype = getattr(torch, args.dtype)
    result: dict[str, Any] = {"machine": machine(device), "args": {k: str(v) for k, v in vars(args).items()}}

    t0 = time.perf_counter()
    llama_cfg = LLAMA_8B | (TINY_OVERRIDES if tiny else {})
    loaded = random_model(llama_cfg, device, dtype, "random-llama-8b-shape" + ("-tiny" if tiny else ""))
    result["build_s"] = time.perf_counter() - t0
    result["llama"] = bench_model(loaded, args, batches, loaded.model_name)
    if args.compare_backends:
        result["backends"] = compare_backends(loaded, args, batches[min(1, len(batches) - 1)])
    if args.quantization:  # last: it replaces the model's 16-bit weights
        result["quantized"] = bench_quantized(loaded, args, batches[:2], result["llama"]["decode"])
    del loaded
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if args.moe:
        try:
            moe = random_model(
                MIXTRAL | (TINY_OVERRIDES if tiny else {}), device, dtype, "random-mixtral-shape"
            )
        except ValueError as exc:  # the runtime has no MoE model class (yet)
            result["mixtral"] = {"skipped": str(exc)}
        else:
            result["mixtral"] = bench_model(moe, args, batches, moe.model_name)
            del moe
    result["total_s"] = time.perf_counter() - t0
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
