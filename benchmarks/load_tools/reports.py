"""What benchmarks/load_tools_bench.py asks the load tools and what it reads from their reports:
pure functions, no processes.

One workload for both tools: `groups` shared system prompts of `system_prompt_len` tokens, each
followed by a `question_len`-token question, `output_len` tokens out (ignore_eos), sent to
/v1/completions at `rate` requests/s for `duration` seconds. inference-perf runs it as its
`shared_prefix` data with a `constant` or `poisson` load; guidellm as `synthetic_text` with
`prefix_buckets` under its `constant` (or `poisson`) profile.

The figures are the tools' own, read from their JSON reports with the statistics each prints:
inference-perf's mean/median/p90 (and p99) of TTFT, ITL, TPOT and request latency, its
requests/s and tokens/s; guidellm's mean/median/p95 (and p99) over completed requests, and its
throughput means over all requests (its "Server Throughput" table).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INFERENCE_PERF_LOADS = ("constant", "poisson")
GUIDELLM_PROFILES = ("constant", "poisson")
# guidellm 0.8.1's poisson profile sets its start event before its arrival offset, so its workers
# schedule their first arrivals from the offset's initial -1.0 (the Unix epoch) and send them at once:
# 1,494 of 1,505 requests in 10 s at rate=1 on this machine. Its constant profile is the default here;
# a run reports how many requests were targeted before the benchmark started.
GUIDELLM_DEFAULT_PROFILES = ("constant",)
TOOLS = ("inference-perf", "guidellm")


@dataclass(frozen=True)
class Workload:
    rate: float = 1.0
    duration: int = 30
    groups: int = 4
    prompts_per_group: int = 8
    system_prompt_len: int = 256
    question_len: int = 64
    output_len: int = 32
    seed: int = 7

    def __post_init__(self) -> None:
        for name in (
            "duration",
            "groups",
            "prompts_per_group",
            "system_prompt_len",
            "question_len",
            "output_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.rate <= 0:
            raise ValueError("--rate must be positive")


# ---------------------------------------------------------------------------------------------
# What the tools are asked


def inference_perf_config(
    w: Workload, load: str, base_url: str, model: str, tokenizer: Path, out_dir: Path
) -> dict[str, Any]:
    """inference-perf's config (its YAML, as a dict) for one load type over the shared-prefix data."""
    if load not in INFERENCE_PERF_LOADS:
        raise ValueError(f"inference-perf load {load!r}: choose from {', '.join(INFERENCE_PERF_LOADS)}")
    return {
        "load": {
            "type": load,
            "stages": [{"rate": w.rate, "duration": w.duration}],
            "num_workers": 1,  # the client shares 2 cores with the server: one sender process
            "base_seed": w.seed,
        },
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": model, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": w.groups,
                "num_prompts_per_group": w.prompts_per_group,
                "system_prompt_len": w.system_prompt_len,
                "question_len": w.question_len,
                "output_len": w.output_len,
                "seed": w.seed,
            },
        },
        # output tokens as the server's usage counts them (ignore_eos: output_len each), not the
        # response text re-tokenized by the client, which differs between engines' detokenizers
        "report": {
            "request_lifecycle": {"summary": True, "per_stage": True, "use_server_output_tokens": True}
        },
        "storage": {"local_storage": {"path": str(out_dir)}},
    }


def guidellm_prefetch(w: Workload) -> int:
    """Samples guidellm's data loader generates ahead: the run's requests and a few more."""
    return math.ceil(w.rate * w.duration) + 8


def guidellm_argv(
    exe: str, w: Workload, profile: str, base_url: str, model: str, tokenizer: Path, out_json: Path
) -> list[str]:
    """`guidellm run` for one profile over the same shape of data (shared prefixes + questions)."""
    if profile not in GUIDELLM_PROFILES:
        raise ValueError(f"guidellm profile {profile!r}: choose from {', '.join(GUIDELLM_PROFILES)}")
    data = {
        "kind": "synthetic_text",
        "prompt_tokens": w.question_len,
        "output_tokens": w.output_len,
        "prefix_buckets": [{"prefix_tokens": w.system_prompt_len, "prefix_count": w.groups}],
    }
    return [
        exe, "run",
        "--backend", f"kind=openai_http,target={base_url},model={model},request_format=/v1/completions",
        "--profile", f"kind={profile},rate={w.rate:g}",
        "--constraint", f"kind=max_duration,seconds={w.duration}",
        "--data", json.dumps(data, separators=(",", ":")),
        # guidellm's data loader prefetches 4096 samples by default, generating them beside the
        # server for the whole run; a run needs rate x duration
        "--data-loader", f"kind=pytorch,prefetch_factor={guidellm_prefetch(w)}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--seed", f"kind=static,value={w.seed}",
        "--output", f"kind=json,path={out_json}",
        "--disable-progress",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# What the tools report


def _stats(dist: dict[str, Any] | None, keys: tuple[str, ...], scale: float) -> dict[str, float | None]:
    if not dist:
        return {k: None for k in keys}
    return {k: None if dist.get(k) is None else round(dist[k] * scale, 2) for k in keys}


IP_KEYS = ("mean", "median", "p90", "p99")


def inference_perf_figures(stage: dict[str, Any]) -> dict[str, Any]:
    """inference-perf's figures from one stage's report (stage_N_lifecycle_metrics.json): requests/s
    and tokens/s, TTFT/ITL/TPOT (ms) and request latency (s) as mean/median/p90/p99, and the mean
    prompt length in tokens."""
    ok, load = stage["successes"], stage.get("load_summary", {})
    lat, thr = ok.get("latency", {}), ok.get("throughput", {})
    prompt = ok.get("prompt_tokens", {})
    return {
        "requests": ok["count"],
        "failures": stage.get("failures", {}).get("count", 0),
        "requested_rate": load.get("requested_rate"),
        "achieved_rate": None if load.get("achieved_rate") is None else round(load["achieved_rate"], 3),
        "requests_per_s": round(thr["requests_per_sec"], 3),
        "output_tokens_per_s": round(thr["output_tokens_per_sec"], 1),
        "total_tokens_per_s": round(thr["total_tokens_per_sec"], 1),
        "ttft_ms": _stats(lat.get("time_to_first_token"), IP_KEYS, 1000),
        "itl_ms": _stats(lat.get("inter_token_latency"), IP_KEYS, 1000),
        "tpot_ms": _stats(lat.get("time_per_output_token"), IP_KEYS, 1000),
        "request_latency_s": _stats(lat.get("request_latency"), IP_KEYS, 1),
        "prompt_tokens_mean": None if prompt.get("mean") is None else round(prompt["mean"], 1),
    }


def read_inference_perf(out_dir: Path) -> dict[str, Any]:
    """The one stage's figures of an inference-perf run that wrote its reports to `out_dir`."""
    stages = sorted(out_dir.glob("stage_*_lifecycle_metrics.json"))
    if len(stages) != 1:
        raise RuntimeError(f"expected one stage report in {out_dir}, found {[p.name for p in stages]}")
    return inference_perf_figures(json.loads(stages[0].read_text()))


GL_KEYS = ("mean", "median", "p95", "p99")


def _gl_stats(metric: dict[str, Any], scale: float = 1) -> dict[str, float | None]:
    s = metric["successful"]
    pct = s.get("percentiles") or {}
    row = {"mean": s.get("mean"), "median": s.get("median"), "p95": pct.get("p95"), "p99": pct.get("p99")}
    return _stats(row, GL_KEYS, scale)


def guidellm_figures(report: dict[str, Any]) -> dict[str, Any]:
    """guidellm's figures from its JSON report (one benchmark): completed/incomplete/errored requests,
    requests/s and tokens/s (means over all requests, as its Server Throughput table), and TTFT/ITL/
    TPOT (ms) and request latency (s) as mean/median/p95/p99 over completed requests."""
    (bench,) = report["benchmarks"]
    m = bench["metrics"]
    totals = m["request_totals"]
    return {
        "strategy": bench["config"]["strategy"]["type_"],
        "rate": bench["config"]["strategy"].get("rate"),
        "requests": totals["successful"],
        "incomplete": totals["incomplete"],
        "errored": totals["errored"],
        "requests_per_s": round(m["requests_per_second"]["total"]["mean"], 3),
        "output_tokens_per_s": round(m["output_tokens_per_second"]["total"]["mean"], 1),
        "total_tokens_per_s": round(m["tokens_per_second"]["total"]["mean"], 1),
        "ttft_ms": _gl_stats(m["time_to_first_token_ms"]),
        "itl_ms": _gl_stats(m["inter_token_latency_ms"]),
        "tpot_ms": _gl_stats(m["time_per_output_token_ms"]),
        "request_latency_s": _gl_stats(m["request_latency"]),
        "prompt_tokens_mean": round(m["prompt_token_count"]["successful"]["mean"], 1),
        "targeted_before_start": targeted_before_start(bench),
    }


def targeted_before_start(bench: dict[str, Any]) -> int:
    """Requests guidellm scheduled to start before the benchmark itself started (an arrival schedule
    that fell behind or was never anchored: they went out at once, not at the profile's rate)."""
    count = 0
    for status in ("successful", "incomplete", "errored"):
        for r in bench["requests"].get(status, []):
            info = r["info"]
            if info["timings"]["targeted_start"] < info["scheduler_start_time"] - 1.0:
                count += 1
    return count


def read_guidellm(out_json: Path) -> dict[str, Any]:
    return guidellm_figures(json.loads(out_json.read_text()))


# ---------------------------------------------------------------------------------------------
# Side by side


def _fmt(v: Any) -> str:
    return "" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def side_by_side(
    results: dict[str, dict[str, dict[str, Any]]],
) -> list[tuple[str, list[str], list[list[str]]]]:
    """One table per tool: a row per (target, load) with the tool's throughput and latency figures.
    `results` is target -> "tool/load" -> figures (or {"error": ...})."""
    tables = []
    for tool, pct in (("inference-perf", "p90"), ("guidellm", "p95")):
        headers = [
            "target", "load", "requests", "req/s", "output tok/s",
            "TTFT mean", "TTFT median", f"TTFT {pct}", "TTFT p99",
            "ITL mean", "ITL median", f"ITL {pct}", "ITL p99",
        ]  # fmt: skip
        rows = []
        for target, runs in results.items():
            for key, f in runs.items():
                name, _, load = key.partition("/")
                if name != tool:
                    continue
                if "error" in f:
                    rows.append([target, load, f"error: {f['error']}"] + [""] * (len(headers) - 3))
                    continue
                t, i = f["ttft_ms"], f["itl_ms"]
                if f.get("targeted_before_start"):
                    load += f" ({f['targeted_before_start']} sent at once)"
                done = _fmt(f["requests"])
                cut = {"unfinished": f.get("incomplete"), "failed": f.get("failures") or f.get("errored")}
                done += "".join(f" (+{n} {what})" for what, n in cut.items() if n)
                rows.append([
                    target, load, done, _fmt(f["requests_per_s"]), _fmt(f["output_tokens_per_s"]),
                    _fmt(t["mean"]), _fmt(t["median"]), _fmt(t[pct]), _fmt(t["p99"]),
                    _fmt(i["mean"]), _fmt(i["median"]), _fmt(i[pct]), _fmt(i["p99"]),
                ])  # fmt: skip
        if rows:
            tables.append((tool, headers, rows))
    return tables
