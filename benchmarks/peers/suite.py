#!/usr/bin/env python
"""The side-by-side suite in one run: kvpilot against llama.cpp's server and transformers, single
stream at the native ISA and batches at the native ISA, as on an AVX2-only CPU and as on an AVX-512 CPU
without BF16 and VNNI (`runtime_vs_peers.py suite`).

(a) Single stream, native ISA, every engine on the same "repeat this text" chat prompts
    (features/speculative.py's quoting prompts, one at a time, greedy, EOS ignored): kvpilot's default
    path (runtime/load/defaults.py), --quantization none (the weights dequantized at load: the default
    before), auto (the GGUF's blocks, int8 activations), int8, int4, int4 + n-gram speculation, draft speculation (features/speculative.py's
    tiny random-weight draft with SmolLM2's tokenizer: the cost of a draft that is never right), the
    native llama-server (benchmarks/build_llamacpp.sh) and transformers. Goals: int4 >= 1.3x
    llama.cpp, speculation >= 1.5x llama.cpp.
(b) Batch throughput as on an AVX2-only CPU: kvpilot and transformers run under
    KVPILOT_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
    (the last caps torch's float32 matmuls, MKL's sgemm, which the others leave at AVX-512), llama-server is the
    AVX2-only build (`build_llamacpp.sh --isa avx2`, checked for zero AVX-512 instructions) with 32
    slots; runtime_vs_peers.py's workload (N requests at once). kvpilot in the dtype `auto` picks there
    and with --quantization int8 / int4, transformers in the faster of float32 and bfloat16 there
    (runtime_vs_peers.py's short probe batch picks it; --hf-avx2-dtype both runs the whole batch in each).
    Goals: >= 1.5x llama.cpp, >= 2x transformers in its fastest dtype.
(c) Batch throughput at the native ISA (`--parts native_batch`; not in the default parts): the same
    workload, kvpilot's default path, none, auto, int8 and int4 against the native llama-server with
    32 slots. Goal: >= 2x llama.cpp.
(d) Batch throughput as on an AVX-512 CPU without BF16 and VNNI (a Skylake-SP Xeon; `--parts avx512_batch`,
    not in the default parts): kvpilot's default path under KVPILOT_CPU_HIDE_FEATURES (its kernels built
    and routed as there, as scripts/test.sh emulates it) with oneDNN capped at AVX512_CORE, against the
    llama-server such a CPU gets (`build_llamacpp.sh --isa avx512`: no VNNI, BF16 or AMX instructions)
    with 32 slots; the same workload. Goal: >= 2x llama.cpp.

Every measurement is one runtime_vs_peers.py process (its adapters and options; a process per
configuration, because the ISA environment must be set before torch loads); this script plans the
runs, merges their JSON into one document (with the CPU model, the ISA levels each environment gets,
load averages and the git commit) and prints a markdown table.

    python benchmarks/runtime_vs_peers.py suite                    # the figures (~12 minutes, quiet machine)
    python benchmarks/runtime_vs_peers.py suite --smoke            # tiny settings: proves the pipeline only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
BUILD_DIR = HERE / ".build"
RESULTS_DIR = HERE / "results"
# kvpilot's kernels, ATen's kernels, oneDNN (bf16 matmuls) and MKL (torch's float32 matmuls: without
# MKL_ENABLE_INSTRUCTIONS its sgemm keeps using AVX-512, ~1.6x the AVX2 rate on this CPU)
AVX2_ENV = {
    "KVPILOT_CPU_ISA": "avx2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# An AVX-512 CPU without BF16 and VNNI (Skylake-SP): kvpilot's kernels built and routed as there
# (kernels/isa.py), oneDNN's bf16 matmuls capped at AVX512_CORE; the features scripts/test.sh hides
AVX512_NO_BF16_ENV = {
    "KVPILOT_CPU_HIDE_FEATURES": "avx512_bf16,avx512_vnni,amx_bf16,amx_int8,amx_tile,avx_vnni",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
}
EMULATION_KEYS = set(AVX2_ENV) | set(AVX512_NO_BF16_ENV)
# build_llamacpp.sh's cache folders per --isa (version: engine_llamacpp.DEFAULT_LLAMACPP_VERSION)
LLAMACPP_VERSION = "0.3.36"
LLAMACPP_FOLDERS = {
    "native": "llama.cpp-{version}",
    "avx2": "llama.cpp-{version}-avx2",
    "avx512": "llama.cpp-{version}-avx512",
}
TARGETS = {
    "single_int4_vs_llamacpp": 1.3,
    "single_speculative_vs_llamacpp": 1.5,
    "avx2_batch_vs_llamacpp": 1.5,
    "avx2_batch_vs_hf_fastest": 2.0,
    "native_batch_vs_llamacpp": 2.0,
    "avx512_batch_vs_llamacpp": 2.0,
}
PARTS = ("single", "avx2_batch", "native_batch", "avx512_batch")
BATCH_PARTS = ("avx2_batch", "native_batch", "avx512_batch")


@dataclass(frozen=True)
class Run:
    """One runtime_vs_peers.py process and the figures taken from its JSON."""

    key: str
    part: str  # one of PARTS
    argv: list[str]
    env: dict[str, str]  # set on top of os.environ (which loses EMULATION_KEYS first)
    # label -> engine name in runtime_vs_peers.py's JSON ("kvpilot", "hf", "llamacpp")
    picks: dict[str, str] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny settings: checks the pipeline, no figures")
    p.add_argument("--parts", default="single,avx2_batch", help="comma list of " + ",".join(PARTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="runtime_vs_peers.py --rounds (best round reported)")
    p.add_argument(
        "--omp-wait-policy",
        choices=["default", "PASSIVE", "ACTIVE"],
        default="default",
        help="OpenMP idle threads for kvpilot and transformers: libgomp's default (what kvpilot serve "
        "runs with; a quiet machine), PASSIVE (a shared one: see runtime_vs_peers.py)",
    )
    p.add_argument("--single-prompts", type=int, default=3, help="quoting prompts per round")
    p.add_argument("--single-words", type=int, default=90, help="words each quoting prompt asks to repeat")
    p.add_argument("--single-output", type=int, default=64, help="output tokens per single stream")
    p.add_argument("--spec-k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-hidden", type=int, default=128)
    p.add_argument("--hf-single-dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    p.add_argument(
        "--hf-avx2-dtype",
        default="auto",
        choices=["auto", "both"],
        help="AVX2 batch: transformers in the dtype runtime_vs_peers.py's probe finds faster (auto: a short "
        "fp32-vs-bf16 batch, times in the JSON) or the whole batch in each of float32 and bfloat16 (both: "
        "bf16 is ~4x slower than fp32 without native bf16, minutes more)",
    )
    p.add_argument("--num-requests", type=int, default=32, help="AVX2 batch: requests submitted at once")
    p.add_argument("--prompt-range", default="32,256", help="AVX2 batch: prompt lengths LO,HI")
    p.add_argument("--output-range", default="32,128", help="AVX2 batch: output lengths LO,HI")
    p.add_argument("--llamacpp-slots", type=int, default=32)
    p.add_argument("--llamacpp-version", default=LLAMACPP_VERSION, help="build_llamacpp.sh's cached build")
    p.add_argument(
        "--llamacpp-native-bin", default=None, help="default: build_llamacpp.sh's cached --isa native build"
    )
    p.add_argument(
        "--llamacpp-avx2-bin", default=None, help="default: build_llamacpp.sh's cached --isa avx2 build"
    )
    p.add_argument(
        "--llamacpp-avx512-bin", default=None, help="default: build_llamacpp.sh's cached --isa avx512 build"
    )
    p.add_argument(
        "--output", default=None, help="default benchmarks/results/runtime_vs_peers_suite-<time>.json"
    )
    args = p.parse_args(argv)
    parts = {s for s in args.parts.split(",") if s}
    if not parts or parts - set(PARTS):
        p.error(f"--parts takes some of {', '.join(PARTS)}, not {args.parts!r}")
    args.parts = parts
    if args.smoke:
        args.single_prompts, args.single_words, args.single_output = 1, 20, 12
        args.num_requests, args.prompt_range, args.output_range = 4, "32,64", "8,16"
        args.llamacpp_slots = min(args.llamacpp_slots, 4)
    return args


def plan(
    args: argparse.Namespace,
    native_bin: str | None,
    avx2_bin: str | None,
    draft_dir: str | None,
    avx512_bin: str | None = None,
) -> list[Run]:
    """The runtime_vs_peers.py processes of the suite, in order."""
    common = [
        "--threads",
        str(args.threads),
        "--rounds",
        str(args.rounds),
        "--omp-wait-policy",
        args.omp_wait_policy,
    ]
    runs: list[Run] = []
    if "single" in args.parts:
        single = [
            *common,
            "--skip",
            "batch,online,peak,serve",
            "--single-text",
            "quoting",
            "--single-count",
            str(args.single_prompts),
            "--single-words",
            str(args.single_words),
            "--single-output",
            str(args.single_output),
        ]
        peers = ["kvpilot", "hf"] + (["llamacpp"] if native_bin else [])
        runs.append(
            Run(
                "single_peers",
                "single",
                [
                    *single,
                    "--engines",
                    ",".join(peers),
                    "--hf-dtype",
                    args.hf_single_dtype,
                    *(["--llamacpp-bin", native_bin] if native_bin else []),
                    # one stream: one slot with room for the prompt and the answer
                    "--llamacpp-slots",
                    "1",
                    "--llamacpp-ctx-per-slot",
                    "2048",
                ],
                {},
                {"kvpilot default": "kvpilot", "transformers": "hf", "llama.cpp server (native)": "llamacpp"},
            )
        )
        spec = ["--kvpilot-spec-k", str(args.spec_k)]
        variants = {
            "single_none": ("kvpilot none (dequantized)", ["--kvpilot-quantization", "none"]),
            "single_auto": ("kvpilot auto (int8 activations)", ["--kvpilot-quantization", "auto"]),
            "single_int8": ("kvpilot int8", ["--kvpilot-quantization", "int8"]),
            "single_int4": ("kvpilot int4", ["--kvpilot-quantization", "int4"]),
            "single_int4_ngram": (
                "kvpilot int4 + ngram",
                ["--kvpilot-quantization", "int4", "--kvpilot-speculative-method", "ngram", *spec],
            ),
        }
        if draft_dir is not None:
            variants["single_draft"] = (
                "kvpilot draft (random 2-layer)",
                ["--kvpilot-speculative-method", "draft", "--kvpilot-speculative-model", draft_dir, *spec],
            )
        for key, (label, extra) in variants.items():
            runs.append(Run(key, "single", [*single, "--engines", "kvpilot", *extra], {}, {label: "kvpilot"}))
        # the same int4 run with the decoder layers called one by one from Python: what the C stack saves
        runs.append(
            Run(
                "single_int4_python_layers",
                "single",
                [*single, "--engines", "kvpilot", "--kvpilot-quantization", "int4"],
                {"KVPILOT_CPU_DECODER_STACK": "0"},
                {"kvpilot int4, layers from Python": "kvpilot"},
            )
        )
    batch = [
        *common,
        "--skip",
        "single,online,peak,serve",
        "--num-requests",
        str(args.num_requests),
        "--prompt-range",
        args.prompt_range,
        "--output-range",
        args.output_range,
    ]
    if "native_batch" in args.parts:
        peers = ["kvpilot"] + (["llamacpp"] if native_bin else [])
        runs.append(
            Run(
                "native_peers",
                "native_batch",
                [
                    *batch,
                    "--engines",
                    ",".join(peers),
                    *(["--llamacpp-bin", native_bin] if native_bin else []),
                    "--llamacpp-slots",
                    str(args.llamacpp_slots),
                ],
                {},
                {
                    "kvpilot default": "kvpilot",
                    f"llama.cpp server native, {args.llamacpp_slots} slots": "llamacpp",
                },
            )
        )
        for q, label in (
            ("none", "kvpilot none (dequantized)"),
            ("auto", "kvpilot auto (int8 activations)"),
            ("int8", "kvpilot int8"),
            ("int4", "kvpilot int4"),
        ):
            runs.append(
                Run(
                    f"native_{q}",
                    "native_batch",
                    [*batch, "--engines", "kvpilot", "--kvpilot-quantization", q],
                    {},
                    {label: "kvpilot"},
                )
            )
    if "avx2_batch" in args.parts:
        peers = ["kvpilot", "hf"] + (["llamacpp"] if avx2_bin else [])
        runs.append(
            Run(
                "avx2_peers",
                "avx2_batch",
                [
                    *batch,
                    "--engines",
                    ",".join(peers),
                    "--hf-dtype",
                    "auto" if args.hf_avx2_dtype == "auto" else "float32",
                    *(["--llamacpp-bin", avx2_bin] if avx2_bin else []),
                    "--llamacpp-slots",
                    str(args.llamacpp_slots),
                ],
                dict(AVX2_ENV),
                {
                    "kvpilot auto dtype": "kvpilot",
                    "transformers " + ("(faster dtype)" if args.hf_avx2_dtype == "auto" else "float32"): "hf",
                    f"llama.cpp server AVX2 build, {args.llamacpp_slots} slots": "llamacpp",
                },
            )
        )
        extras = [
            ("avx2_int8", "kvpilot int8", ["--engines", "kvpilot", "--kvpilot-quantization", "int8"]),
            ("avx2_int4", "kvpilot int4", ["--engines", "kvpilot", "--kvpilot-quantization", "int4"]),
        ]
        if args.hf_avx2_dtype == "both":
            extras.append(
                ("avx2_hf_bfloat16", "transformers bfloat16", ["--engines", "hf", "--hf-dtype", "bfloat16"])
            )
        for key, label, extra in extras:
            engine = "hf" if key.startswith("avx2_hf") else "kvpilot"
            runs.append(Run(key, "avx2_batch", [*batch, *extra], dict(AVX2_ENV), {label: engine}))
    if "avx512_batch" in args.parts:
        peers = ["kvpilot"] + (["llamacpp"] if avx512_bin else [])
        runs.append(
            Run(
                "avx512_peers",
                "avx512_batch",
                [
                    *batch,
                    "--engines",
                    ",".join(peers),
                    *(["--llamacpp-bin", avx512_bin] if avx512_bin else []),
                    "--llamacpp-slots",
                    str(args.llamacpp_slots),
                ],
                dict(AVX512_NO_BF16_ENV),
                {
                    "kvpilot default": "kvpilot",
                    f"llama.cpp server AVX-512 build (no VNNI/BF16), {args.llamacpp_slots} slots": "llamacpp",
                },
            )
        )
    return runs


def child_env(run: Run) -> dict[str, str]:
    """os.environ with the run's ISA settings; a run never inherits another emulation's settings."""
    env = {k: v for k, v in os.environ.items() if k not in EMULATION_KEYS}
    env.update(run.env)
    return env


# ---------------------------------------------------------------------------------------------
# The table


def figure(doc: dict[str, Any] | None, engine: str, part: str, key: str) -> Any:
    rec = ((doc or {}).get("engines") or {}).get(engine) or {}
    val = rec.get(part)
    return val.get(key) if isinstance(val, dict) else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def summarize(runs: list[Run], docs: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Rows per part (label -> figures) and the ratios the issue names, against its goals."""
    single: dict[str, dict[str, Any]] = {}
    batches: dict[str, dict[str, dict[str, Any]]] = {part: {} for part in BATCH_PARTS}
    for run in runs:
        doc = docs.get(run.key)
        for label, engine in run.picks.items():
            rec = ((doc or {}).get("engines") or {}).get(engine)
            if rec is None:
                continue
            errors = rec.get("errors")
            if run.part == "single":
                row = {
                    "decode_tok_per_s": figure(doc, engine, "single_stream", "decode_tok_per_s"),
                    "acceptance_rate": figure(doc, engine, "single_stream", "acceptance_rate"),
                    "config": {k: v for k, v in (rec.get("config") or {}).items() if k != "argv"},
                }
                single[label] = {**row, **({"errors": errors} if errors else {})}
            else:
                row = {"output_tok_per_s": figure(doc, engine, "batch", "output_tok_per_s")}
                if engine == "hf":
                    row["dtype"] = (rec.get("config") or {}).get("dtype")
                    if "dtype_probe_s" in rec:
                        row["dtype_probe_s"] = rec["dtype_probe_s"]
                batches[run.part][label] = {**row, **({"errors": errors} if errors else {})}
    llama_single = next((v["decode_tok_per_s"] for k, v in single.items() if k.startswith("llama.cpp")), None)
    for row in single.values():
        row["vs_llamacpp"] = ratio(row["decode_tok_per_s"], llama_single)
    best: dict[str, dict[str, float | None]] = {}
    for part, batch in batches.items():
        llama_batch = next(
            (v["output_tok_per_s"] for k, v in batch.items() if k.startswith("llama.cpp")), None
        )
        hf_rates = [v["output_tok_per_s"] for k, v in batch.items() if k.startswith("transformers")]
        hf_best = max((r for r in hf_rates if r), default=None)
        for row in batch.values():
            row["vs_llamacpp"] = ratio(row["output_tok_per_s"], llama_batch)
            row["vs_hf_fastest"] = ratio(row["output_tok_per_s"], hf_best)
        kv_batch = [
            v["output_tok_per_s"]
            for k, v in batch.items()
            if k.startswith("kvpilot") and v["output_tok_per_s"]
        ]
        best[part] = {"kvpilot": max(kv_batch, default=None), "llamacpp": llama_batch, "hf": hf_best}
    spec = [
        v["decode_tok_per_s"]
        for k, v in single.items()
        if ("ngram" in k or "draft" in k) and v["decode_tok_per_s"]
    ]
    ratios = {
        "single_int4_vs_llamacpp": (single.get("kvpilot int4") or {}).get("vs_llamacpp"),
        "single_speculative_vs_llamacpp": ratio(max(spec, default=None), llama_single),
        "avx2_batch_vs_llamacpp": ratio(best["avx2_batch"]["kvpilot"], best["avx2_batch"]["llamacpp"]),
        "avx2_batch_vs_hf_fastest": ratio(best["avx2_batch"]["kvpilot"], best["avx2_batch"]["hf"]),
        "native_batch_vs_llamacpp": ratio(best["native_batch"]["kvpilot"], best["native_batch"]["llamacpp"]),
        "avx512_batch_vs_llamacpp": ratio(best["avx512_batch"]["kvpilot"], best["avx512_batch"]["llamacpp"]),
    }
    return {
        "single_stream_decode_tok_per_s": single,
        "avx2_batch_output_tok_per_s": batches["avx2_batch"],
        "native_batch_output_tok_per_s": batches["native_batch"],
        "avx512_batch_output_tok_per_s": batches["avx512_batch"],
        "ratios": ratios,
        "targets": TARGETS,
        "targets_met": {k: None if v is None else v >= TARGETS[k] for k, v in ratios.items()},
    }


def markdown(summary: dict[str, Any], cpu: str) -> str:
    def cell(v: Any) -> str:
        return "" if v is None else (f"{v}x" if isinstance(v, float) and v < 20 else str(v))

    def errors(row: dict[str, Any]) -> str:
        return " (errors: see JSON)" if row.get("errors") else ""

    single = harness.markdown_table(
        ["single stream (quoting prompts, native ISA)", "decode tok/s", "vs llama.cpp", "acceptance"],
        (
            [
                label + errors(row),
                row["decode_tok_per_s"] or "",
                cell(row["vs_llamacpp"]),
                row["acceptance_rate"],
            ]
            for label, row in summary["single_stream_decode_tok_per_s"].items()
        ),
    )
    batches = [
        harness.markdown_table(
            [title, "output tok/s", "vs llama.cpp", "vs fastest transformers"],
            (
                [
                    label + errors(row),
                    row["output_tok_per_s"] or "",
                    cell(row["vs_llamacpp"]),
                    cell(row["vs_hf_fastest"]),
                ]
                for label, row in summary[key].items()
            ),
        )
        for title, key in (
            ("batch, native ISA", "native_batch_output_tok_per_s"),
            ("batch, AVX2 (emulated)", "avx2_batch_output_tok_per_s"),
            ("batch, AVX-512 without BF16/VNNI (emulated)", "avx512_batch_output_tok_per_s"),
        )
        if summary[key]
    ]
    goals = harness.markdown_table(
        ["ratio", "measured", "goal", "met"],
        (
            [key, cell(summary["ratios"][key]), f">= {goal}x", summary["targets_met"][key]]
            for key, goal in summary["targets"].items()
        ),
    )
    tables = [single] if summary["single_stream_decode_tok_per_s"] else []
    return "\n\n".join([f"CPU: {cpu}", *tables, *batches, goals])


# ---------------------------------------------------------------------------------------------
# The machine, the binaries, the draft


def isa_levels(env: dict[str, str]) -> dict[str, Any]:
    """What kvpilot's kernels and torch's ATen pick under `env` (a child process: set before import)."""
    code = (
        "import json, torch\n"
        "from kvpilot.kernels import isa\n"
        "print(json.dumps({'kvpilot_kernels': isa.selected(), "
        "'aten_cpu_capability': torch.backends.cpu.get_cpu_capability(), "
        "'kvpilot_native_bf16': isa.native_bf16()}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    out["env"] = {k: env[k] for k in sorted(EMULATION_KEYS) if k in env}
    return out


def avx512_instruction_count(binary: str) -> int | None:
    """Lines of `objdump -d` that use a zmm or an AVX-512 opmask register (0 for an AVX2-only build)."""
    try:
        proc = subprocess.Popen(
            ["objdump", "-d", "--no-show-raw-insn", binary], stdout=subprocess.PIPE, text=True
        )
    except OSError:
        return None
    assert proc.stdout is not None
    n = sum(1 for line in proc.stdout if "%zmm" in line or any(f"{{%k{i}}}" in line for i in range(1, 8)))
    return n if proc.wait() == 0 else None


def llamacpp_binary(isa: str, version: str, explicit: str | None) -> tuple[str | None, str | None]:
    """(path, error): the given binary, or build_llamacpp.sh's cached one. Never builds (a build takes
    ~10 minutes on 2 cores): a missing binary is an error that says how to build it."""
    if explicit:
        return (explicit, None) if Path(explicit).is_file() else (None, f"{explicit} does not exist")
    path = BUILD_DIR / LLAMACPP_FOLDERS[isa].format(version=version) / "bin" / "llama-server"
    if path.is_file():
        return str(path), None
    return None, f"{path} is missing: run `bash benchmarks/build_llamacpp.sh --isa {isa}` first"


def write_draft(directory: str, layers: int, hidden: int) -> None:
    """features/speculative.py's random-weight draft (SmolLM2's tokenizer and vocabulary)."""
    import torch
    import workload as wl
    from features.speculative import write_random_draft

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.load.loader import load_model

    cfg = EngineConfig.model_validate({"model": str(wl.smollm2_gguf())})
    target = load_model(cfg, torch.device("cpu"), torch.float32)
    write_random_draft(Path(directory), target, layers, hidden)


def git_commit() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "uncommitted_changes": bool(git("status", "--porcelain")),
    }


def log(msg: str) -> None:
    print(f"[suite {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = Path(args.output) if args.output else RESULTS_DIR / f"runtime_vs_peers_suite-{stamp}.json"
    run_dir = out_path.parent / f"{out_path.stem}-runs"
    run_dir.mkdir(parents=True, exist_ok=True)
    cpu = harness.cpu_model()
    native_env = child_env(Run("", "", [], {}))
    avx2_env = child_env(Run("", "", [], dict(AVX2_ENV)))
    avx512_env = child_env(Run("", "", [], dict(AVX512_NO_BF16_ENV)))
    doc: dict[str, Any] = {
        "benchmark": "runtime vs peers suite: kvpilot vs llama.cpp server vs transformers, single stream and "
        "batches at the native ISA and emulated ones",
        "command": " ".join(
            ["python benchmarks/runtime_vs_peers.py suite", *(argv if argv is not None else sys.argv[1:])]
        ),
        "smoke": args.smoke,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_commit(),
        "machine": {
            "lscpu_model_name": cpu,
            "load_avg_start": [round(x, 2) for x in os.getloadavg()],
            "isa_native": isa_levels(native_env),
            "isa_avx2_emulated": isa_levels(avx2_env),
            **(
                {"isa_avx512_no_bf16_emulated": isa_levels(avx512_env)}
                if "avx512_batch" in args.parts
                else {}
            ),
        },
        "llamacpp": {},
    }
    bins: dict[str, str | None] = {"native": None, "avx2": None, "avx512": None}
    for isa, wanted, explicit in (
        ("native", {"single", "native_batch"}, args.llamacpp_native_bin),
        ("avx2", {"avx2_batch"}, args.llamacpp_avx2_bin),
        ("avx512", {"avx512_batch"}, args.llamacpp_avx512_bin),
    ):
        if not wanted & args.parts:
            continue
        log(f"llama-server ({isa}): locating")
        path, err = llamacpp_binary(isa, args.llamacpp_version, explicit)
        rec: dict[str, Any] = {"binary": path, "error": err}
        if path:
            n = avx512_instruction_count(path)
            rec["avx512_instruction_lines"] = n
            if isa == "avx2" and n != 0:
                rec["error"] = f"not an AVX2-only build: objdump finds {n} AVX-512 instruction lines"
                path = None
        doc["llamacpp"][isa] = rec
        bins[isa] = path
        if rec["error"]:
            log(f"llama-server ({isa}) left out: {rec['error']}")

    with tempfile.TemporaryDirectory(prefix="suite-draft-") as draft_dir:
        if "single" in args.parts:
            log("writing the random-weight draft")
            write_draft(draft_dir, args.draft_layers, args.draft_hidden)
        runs = plan(
            args,
            bins["native"],
            bins["avx2"],
            draft_dir if "single" in args.parts else None,
            avx512_bin=bins["avx512"],
        )
        docs: dict[str, dict[str, Any] | None] = {}
        doc["runs"] = {}
        for i, run in enumerate(runs, 1):
            target = run_dir / f"{run.key}.json"
            argv_run = [sys.executable, str(HERE / "runtime_vs_peers.py"), *run.argv, "--output", str(target)]
            log(f"run {i}/{len(runs)}: {run.key} ({run.part}{', env ' + str(run.env) if run.env else ''})")
            t0 = time.perf_counter()
            res = subprocess.run(argv_run, env=child_env(run), stdout=subprocess.DEVNULL)
            wall = round(time.perf_counter() - t0, 1)
            docs[run.key] = (
                json.loads(target.read_text()) if res.returncode == 0 and target.exists() else None
            )
            doc["runs"][run.key] = {
                "part": run.part,
                "env": run.env,
                "argv": run.argv,
                "returncode": res.returncode,
                "wall_s": wall,
                "result_file": str(target),
                "result": docs[run.key],
            }
    doc["summary"] = summarize(runs, docs)
    doc["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(markdown(doc["summary"], cpu))
    print(
        f"\nJSON: {out_path} ({doc['wall_s']} s, load average {doc['machine']['load_avg_start']} -> "
        f"{doc['machine']['load_avg_end']})"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    raise SystemExit(main())
