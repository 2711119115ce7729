"""Routing policies on the fleet simulator, same autoscaler: replica-hours and SLO attainment side by
side for a plain Service (round-robin, per-pod queues) and the fleet router's policies. Prints one
JSON object (and a markdown table with --markdown).

    python benchmarks/simulate_routing.py [--startup-s 60] [--jobs 2] [--markdown]
        [--csv-calibration l4/llama-3.1-8b] [--mooncake-calibration h100/llama-3.1-8b] [--mooncake PATH]

Every run uses the same autoscaler (kvpilot's decide() with the SLO planner, minReplicas 1, 15 s
syncs), the same SLO (TTFT 2 s + 2 x idle prefill, TPOT 50 ms) and pods that start in --startup-s.
Routers (autoscaler/simulator.py ROUTERS):
- round-robin: a plain Service (each request to the next pod, queued there; nothing held);
- least-loaded: the simulator's own idealized one (it also knows each pod's free KV), for reference;
- router:round-robin, router:least-loaded, router:prefix-affinity, router:kv-aware: kvpilot.router.policy,
  the code `kvpilot router` runs, through autoscaler/sim_routing.py: a pod takes requests up to
  maxNumSeqs, the rest wait in the router's central queue (which the autoscaler reads as waiting).
Traces: bursty and flash_crowd (benchmarks/traces; ~590-token prompts, one H100 serves them whole, so
they run on an L4 + Llama-3.1-8B replica, which needs a fleet), and, with --mooncake PATH, the Mooncake
FAST'25 synthetic trace (kvcache-ai/Mooncake, FAST25-release/traces/synthetic_trace.jsonl, saved as
mooncake_synthetic.jsonl; H100 + Llama-3.1-8B), the one whose hash_ids give prefix reuse, so
prefix-affinity and kv-aware run there only.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness

from kvpilot.autoscaler.fleet_policies import KvpilotPolicy
from kvpilot.autoscaler.replica_model import resolve_calibration
from kvpilot.autoscaler.simulator import ROUTERS, simulate
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.spec import ScalingTargets, SloTargets

HERE = Path(__file__).resolve().parent
SLO = Slo(ttft_s=2.0, tpot_s=0.05, ttft_prefill_factor=2.0)
MIN_REPLICAS, MAX_REPLICAS = 1, 40
BASE_ROUTERS = ("round-robin", "least-loaded", "router:round-robin", "router:least-loaded")
PREFIX_ROUTERS = ("router:prefix-affinity", "router:kv-aware")
KEYS = (
    "slo_attainment",
    "ttft_attainment",
    "replica_hours",
    "mean_replicas",
    "peak_replicas",
    "scale_events",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p99_s",
    "prefix_hit_rate",
    "rejected",
    "requests",
)

Job = tuple[str, str, str, float]  # trace path, calibration, router, startup_s


def run(job: Job) -> dict[str, Any]:
    from kvpilot.autoscaler.trace import load_trace

    path, cal_name, router, startup_s = job
    trace = load_trace(path)
    cal = replace(resolve_calibration(cal_name), startup_s=startup_s)
    planner = SloTargets(cal, cal_name, SLO.ttft_s, SLO.tpot_s, SLO.ttft_prefill_factor)
    targets = ScalingTargets(
        min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS, max_num_seqs=cal.max_num_seqs, slo=planner
    )
    started = time.process_time()
    res = simulate(trace, KvpilotPolicy(targets), cal, slo=SLO, router=ROUTERS[router]()).to_dict()
    return {
        "trace": Path(path).stem,
        "calibration": cal_name,
        "router": router,
        "startup_s": startup_s,
        **{k: res[k] for k in KEYS},
        "cpu_s": round(time.process_time() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--startup-s", type=float, default=60.0, help="pod startup time, seconds")
    parser.add_argument("--csv-calibration", default="l4/llama-3.1-8b")
    parser.add_argument("--mooncake-calibration", default="h100/llama-3.1-8b")
    parser.add_argument("--mooncake", help="the Mooncake JSONL trace (left out without it)")
    parser.add_argument(
        "--only", help="comma-separated trace names (bursty, flash_crowd, mooncake_synthetic)"
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.startup_s < 0:
        parser.error("--startup-s must be >= 0")
    for flag, name in (
        ("--csv-calibration", args.csv_calibration),
        ("--mooncake-calibration", args.mooncake_calibration),
    ):
        try:
            resolve_calibration(name)
        except ValueError as exc:
            parser.error(f"{flag}: {exc}")
    notes: list[str] = []
    traces: list[tuple[str, str, tuple[str, ...]]] = [
        (str(HERE / "traces" / f"{t}.csv"), args.csv_calibration, BASE_ROUTERS)
        for t in ("bursty", "flash_crowd")
    ]
    if args.mooncake and Path(args.mooncake).is_file():
        traces.append((args.mooncake, args.mooncake_calibration, BASE_ROUTERS + PREFIX_ROUTERS))
    else:
        notes.append(
            f"Mooncake trace not found at {args.mooncake}; left out"
            if args.mooncake
            else "no --mooncake PATH given: the Mooncake trace is left out"
        )
        if os.environ.get("CI") == "true":
            raise SystemExit(f"CI: {notes[-1]}")
    if args.only:
        wanted = set(args.only.split(","))
        traces = [t for t in traces if Path(t[0]).stem in wanted]
    jobs: list[Job] = [(path, cal, r, args.startup_s) for path, cal, routers in traces for r in routers]
    started = time.time()
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(run, jobs))
    base = {r["trace"]: r for r in rows if r["router"] == "round-robin"}
    for r in rows:
        b = base[r["trace"]]
        r["replica_hours_vs_round_robin"] = round(r["replica_hours"] / max(1e-9, b["replica_hours"]), 3)
    out = {
        "benchmark": "simulate-routing",
        "autoscaler": "kvpilot (SLO planner), minReplicas 1, maxReplicas 40, sync 15 s",
        "startup_s": args.startup_s,
        "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s, "ttft_prefill_factor": SLO.ttft_prefill_factor},
        "notes": notes,
        "machine": harness.machine(),
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    harness.emit(out)
    if args.markdown:
        print()
        harness.print_table(
            [
                "trace (replica)",
                "router",
                "SLO attainment",
                "TTFT only",
                "replica-h",
                "vs round-robin",
                "mean / peak replicas",
                "TTFT p50 / p99 s",
                "TPOT p99 s",
                "prefix hit",
                "rejected",
            ],
            (
                [
                    f"{r['trace']} ({r['calibration']})",
                    r["router"],
                    f"{r['slo_attainment'] * 100:.2f}%",
                    f"{r['ttft_attainment'] * 100:.2f}%",
                    f"{r['replica_hours']:.2f}",
                    f"{r['replica_hours_vs_round_robin'] * 100:.0f}%",
                    f"{r['mean_replicas']:.1f} / {r['peak_replicas']}",
                    f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
                    f"{r['tpot_p99_s']:.3f}",
                    f"{r['prefix_hit_rate'] * 100:.1f}%",
                    r["rejected"],
                ]
                for r in rows
            ),
        )


if __name__ == "__main__":
    main()
