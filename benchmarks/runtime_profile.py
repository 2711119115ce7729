#!/usr/bin/env python
"""Where kvpilot's CPU time goes in the batched benchmark workload.

Wraps (from outside, without editing the runtime) the engine's stages with wall-clock timers:
scheduling, batch preparation, the model forward (split into KV write, KV gather, SDPA and the rest:
linears, norms, rotary), the LM head, the sampler and the engine's own bookkeeping. On CPU every
torch op is synchronous, so wall time of a wrapped call is the time it costs. Steps are split into
decode-only and mixed (prefill chunks present). Optionally a torch.profiler op table (--torch-ops).

    python benchmarks/runtime_profile.py --num-requests 128 --steps 300 [--torch-ops]
    KVPILOT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/runtime_profile.py --num-requests 32 --max-num-seqs 32 \
        --prompt-range 32,256 --output-range 32,128 --quantization int4    # the suite's AVX2 batch

Prints JSON. The workload is the same as runtime_vs_peers.py's (benchmarks/workload.py, seed 0); the
run stops after --steps steps so it profiles the start (prefill-heavy) and the steady decode phase.

`--single-stream`: one request's decode steps (batch 1) split in the calling thread's CPU time (robust
on a shared machine; with --threads 1 all the work is on that thread) into the decoder stack's one C
call (kernels/cpu_decoder.run: the layers' matmuls, attention, norms), the LM head's quantized matmul
and the rest (Python: embedding lookup, final norm, sampling, scheduling, bookkeeping), or, for a
model that does not take the stack, the whole forward and the rest:

    python benchmarks/runtime_profile.py --single-stream --threads 1                          # the default path
    python benchmarks/runtime_profile.py --single-stream --threads 1 --quantization auto      # int8 activations
    python benchmarks/runtime_profile.py --single-stream --threads 1 --quantization none      # dequantized
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see runtime_vs_peers.py

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as wl

from kvpilot.runtime.engine.build import build_engine


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return wrapped

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


def instrument(engine: Any, timers: Timers) -> None:
    """Patch module functions and instance methods the engine calls (this process only)."""
    import torch.nn.functional as F

    import kvpilot.kernels.attention as attn
    import kvpilot.runtime.engine.runner as mr

    mr.prepare_batch = timers.wrap("prepare_batch", mr.prepare_batch)
    attn.write_kv = timers.wrap("attn.write_kv", attn.write_kv)
    attn.gather_kv = timers.wrap("attn.gather_kv", attn.gather_kv)
    sdpa = timers.wrap("attn.sdpa", F.scaled_dot_product_attention)
    attn.F = type("FShim", (), {"scaled_dot_product_attention": staticmethod(sdpa)})
    try:  # the C paged-attention backend imports write_kv by name: wrap its copies too
        import kvpilot.kernels.cpu_attention as cpu_attn

        cpu_attn.write_kv = timers.wrap("attn.write_kv", cpu_attn.write_kv)
        cpu_attn.paged_attention = timers.wrap("attn.kernel", cpu_attn.paged_attention)
    except ImportError:
        pass
    from kvpilot.kernels import cpu_decoder  # the runner's compiled forward: every layer in one C call

    cpu_decoder.run = timers.wrap("decoder_stack", cpu_decoder.run)
    engine.scheduler.schedule = timers.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.on_step_done = timers.wrap("on_step_done", engine.scheduler.on_step_done)
    engine.sampler.sample = timers.wrap("sampler", engine.sampler.sample)
    model = engine.runner.model
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    inner = model.model
    inner.forward = timers.wrap("model_forward", inner.forward)
    for layer in inner.layers:
        layer.self_attn.forward = timers.wrap("layer.self_attn", layer.self_attn.forward)
        layer.self_attn.attn.forward = timers.wrap("layer.paged_attention", layer.self_attn.attn.forward)
        layer.mlp.forward = timers.wrap("layer.mlp", layer.mlp.forward)
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            lin.forward = timers.wrap("linears", lin.forward)
        layer.input_layernorm.forward = timers.wrap("norms", layer.input_layernorm.forward)
        layer.post_attention_layernorm.forward = timers.wrap("norms", layer.post_attention_layernorm.forward)
    inner.rotary_emb.forward = timers.wrap("rotary", inner.rotary_emb.forward)


def single_stream_profile(engine: Any, tokenizer_gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Per decode step of one request, the calling thread's CPU time: the C decoder stack, the LM
    head's quantized matmul (or the whole forward where the stack does not run), and the rest."""
    from kvpilot.kernels import cpu_decoder, qlinear
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    spent: dict[str, float] = defaultdict(float)

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*a: Any, **kw: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.thread_time() - c0

        return wrapped

    ids = wl.corpus_token_ids(str(tokenizer_gguf))[: args.single_prompt]
    engine.generate([ids[:32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    stacked = engine.runner.compiled is not None
    cpu_decoder.run = timed("decoder stack (one C call)", cpu_decoder.run)
    qlinear.kernel_matmul = timed("LM head (quantized matmul)", qlinear.kernel_matmul)
    if not stacked:  # the model's own forward (its LM head is compute_logits)
        model = engine.runner.model
        model.model.forward = timed("forward (Python layers)", model.model.forward)
        model.compute_logits = timed("LM head (model)", model.compute_logits)
    engine.add_request(
        "s", ids, SamplingParams(max_tokens=args.single_output, temperature=0.0, ignore_eos=True)
    )
    engine.step()  # the prefill
    spent.clear()
    steps, c0, w0 = 0, time.thread_time(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
    parts = {k: v for k, v in spent.items() if k != "LM head (quantized matmul)" or stacked}
    parts["rest: Python (embedding, norm, sampling, scheduling, bookkeeping)"] = cpu - sum(parts.values())
    return {
        "config": {k: v for k, v in engine.cfg.model_dump(exclude_none=True).items() if k in CONFIG_KEYS},
        "decoder_stack": stacked,
        "threads": torch.get_num_threads(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "decode_steps": steps,
        "thread_cpu_ms_per_step": round(cpu / steps * 1e3, 3),
        "wall_ms_per_step": round(wall / steps * 1e3, 3),
        "tok_per_thread_cpu_s": round(steps / cpu, 1),
        "ms_per_step": {k: round(v / steps * 1e3, 3) for k, v in parts.items()},
        "share": {k: round(v / cpu, 3) for k, v in parts.items()},
    }


CONFIG_KEYS = (
    "model",
    "quantization",
    "qmatmul_activations",
    "threads",
    "dtype",
    "cpu_decoder_stack",
    "kv_cache_dtype",
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (the builtin GGUF), a shape such as llama-1b:q4_k_m, or a .gguf path (runtime_vs_peers.py --model)",
    )
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument(
        "--quantization",
        default=None,
        help="EngineConfig.quantization (int8, int4, auto, none; unset: the default path)",
    )
    p.add_argument("--qmatmul-activations", default=None, choices=["int8", "int16", "bf16", "float"])
    p.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype")
    p.add_argument(
        "--single-stream",
        action="store_true",
        help="batch 1: the decode steps of one request (--single-prompt + --single-output tokens) in thread CPU time",
    )
    p.add_argument("--single-prompt", type=int, default=100)
    p.add_argument("--single-output", type=int, default=256)
    p.add_argument(
        "--prompt-range", default="32,512", help="prompt lengths, inclusive (runtime_vs_peers.py's default)"
    )
    p.add_argument("--output-range", default="64,512", help="output lengths, inclusive")
    p.add_argument("--torch-ops", action="store_true", help="also a torch.profiler op table (slower)")
    p.add_argument("--cprofile", action="store_true", help="also the top Python functions (cProfile)")
    args = p.parse_args()

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    gguf_path, tokenizer_gguf = wl.resolve_model(args.model)
    cfg = EngineConfig(
        model=str(gguf_path),
        device="cpu",
        dtype=args.dtype,
        threads=args.threads,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        kv_cache_memory=int(args.kv_gib * 2**30),
        quantization=args.quantization,
        qmatmul_activations=args.qmatmul_activations,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.single_stream:
        cfg = cfg.model_copy(update={"max_num_seqs": 1})
        print(json.dumps(single_stream_profile(build_engine(cfg), tokenizer_gguf, args), indent=2))
        return 0
    engine = build_engine(cfg)
    lo_p, hi_p = map(int, args.prompt_range.split(","))
    lo_o, hi_o = map(int, args.output_range.split(","))
    reqs = wl.make_requests(
        args.num_requests, (lo_p, hi_p), (lo_o, hi_o), seed=0, corpus=wl.corpus_token_ids(str(tokenizer_gguf))
    )
    engine.generate([reqs[0].prompt_ids[:32]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    timers = Timers()
    instrument(engine, timers)
    for r in reqs:
        engine.add_request(
            f"r{r.index}",
            r.prompt_ids,
            SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0),
        )

    kinds: dict[str, dict[str, float]] = {"decode": defaultdict(float), "mixed": defaultdict(float)}
    counts = {"decode": 0, "mixed": 0}
    tokens = {"decode": 0, "mixed": 0}
    batch_sizes: dict[str, list[int]] = {"decode": [], "mixed": []}
    prof = cProfile.Profile() if args.cprofile else None
    tprof = None
    if args.torch_ops:
        tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False)
        tprof.__enter__()
    t_start = time.perf_counter()
    for _ in range(args.steps):
        if not engine.has_unfinished():
            break
        before = timers.snapshot()
        sched_preview = engine.scheduler  # noqa: F841 (the step schedules itself)
        s0 = engine.stats()
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        engine.step()
        if prof is not None:
            prof.disable()
        dt = time.perf_counter() - t0
        s1 = engine.stats()
        new_prompt = s1.prompt_tokens - s0.prompt_tokens
        new_gen = s1.generation_tokens - s0.generation_tokens
        kind = "mixed" if new_prompt > 0 else "decode"
        counts[kind] += 1
        tokens[kind] += new_prompt + new_gen
        batch_sizes[kind].append(s1.num_running)
        after = timers.snapshot()
        k = kinds[kind]
        k["step_wall"] += dt
        for name, v in after.items():
            k[name] += v - before.get(name, 0.0)
    wall = time.perf_counter() - t_start
    if tprof is not None:
        tprof.__exit__(None, None, None)

    def breakdown(kind: str) -> dict[str, Any]:
        k = kinds[kind]
        n = max(1, counts[kind])
        step = k["step_wall"]
        if step == 0:
            return {"steps": 0}
        attn_other = (
            k["layer.paged_attention"]
            - k["attn.write_kv"]
            - k["attn.gather_kv"]
            - k["attn.sdpa"]
            - k["attn.kernel"]
        )
        self_attn_other = k["layer.self_attn"] - k["layer.paged_attention"] - k["rotary"]
        # qkv/o linears run inside self_attn; gate_up/down inside mlp
        mlp_other = k["layer.mlp"]
        fwd_other = k["model_forward"] - k["layer.self_attn"] - k["layer.mlp"] - k["norms"]
        parts = {
            "schedule": k["schedule"],
            "prepare_batch": k["prepare_batch"],
            "decoder stack (one C call: every layer's kernels)": k["decoder_stack"],
            "linears (qkv, o, gate_up, down)": k["linears"],
            "attention: KV gather (index + copy)": k["attn.gather_kv"],
            "attention: SDPA (torch backend)": k["attn.sdpa"],
            "attention: paged kernel (C backend)": k["attn.kernel"],
            "attention: KV write": k["attn.write_kv"],
            "attention: python/mask/loop": attn_other,
            "rotary": k["rotary"],
            "norms (+ residual add)": k["norms"],
            "qkv split/reshape + silu*mul": self_attn_other + mlp_other - k["linears"],
            "embedding + layer glue": fwd_other,
            "lm_head": k["lm_head"],
            "sampler": k["sampler"],
            "on_step_done": k["on_step_done"],
        }
        accounted = sum(parts.values())
        parts["engine bookkeeping (rest of step)"] = step - accounted
        return {
            "steps": counts[kind],
            "mean_step_ms": round(step / n * 1000, 2),
            "tokens_per_step": round(tokens[kind] / n, 1),
            "mean_running": round(sum(batch_sizes[kind]) / max(1, len(batch_sizes[kind])), 1),
            "tok_per_s": round(tokens[kind] / step, 1),
            "ms_per_step": {name: round(v / n * 1000, 2) for name, v in parts.items()},
            "share": {name: round(v / step, 3) for name, v in parts.items()},
        }

    doc: dict[str, Any] = {
        "config": cfg.model_dump(exclude_none=True),
        "resolved_dtype": str(next(engine.runner.model.parameters()).dtype),
        "attention_backend": engine.runner.backend.name,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "steps_profiled": counts["decode"] + counts["mixed"],
        "wall_s": round(wall, 2),
        "decode_steps": breakdown("decode"),
        "mixed_steps": breakdown("mixed"),
        "calls": dict(timers.calls),
    }
    if tprof is not None:
        table = tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        doc["torch_ops_top25"] = table.splitlines()
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        doc["cprofile_top25_tottime"] = buf.getvalue().splitlines()
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
