"""Run every scaling policy on every trace in benchmarks/traces/ and print a JSON table.

    python benchmarks/simulate_policies.py [--traces benchmarks/traces] [--calibration FILE] [--jobs 2]
        [--markdown]

Policies, all on the same simulated fleet (kvpilot.autoscaler.simulator) and the same SLO:
- kvpilot: policy.decide() with the CRD defaults (targetKVCacheUtilization 0.7, targetQueueDepth 4,
  windows 0 s / 300 s), minReplicas 2; and kvpilot-kv0.5, the same with a 0.5 KV target.
- static: the smallest fixed fleet that meets the SLO-attainment goal on the trace (perfect hindsight).
- moving-average: KubeAI-style, 10-minute window, minReplicas 2, target requests per replica swept;
  reported at the target whose replica-hours are closest to kvpilot's without exceeding them (the fair
  comparison: "better SLO at no more replica-hours"), plus its best-SLO target for reference.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import KvpilotPolicy, MovingAveragePolicy, StaticPolicy
from kvpilot.autoscaler.simulator import simulate, size_static_for_slo
from kvpilot.autoscaler.spec import ScalingTargets
from kvpilot.autoscaler.trace import load_trace

SLO_TTFT_S = 2.0
SLO_GOAL = 0.99
MIN_REPLICAS = 2
MAX_REPLICAS = 40
MA_TARGETS = (8.0, 12.0, 16.0, 24.0, 32.0, 48.0)
KEYS = (
    "slo_attainment",
    "replica_hours",
    "scale_events",
    "peak_replicas",
    "ttft_p99_s",
    "rejected",
    "preemptions",
)


def _run(job: tuple[str, str, dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    trace_path, kind, params, cal = job
    trace = load_trace(trace_path)
    calibration = Calibration.from_dict(cal)
    common = {"slo_ttft_s": SLO_TTFT_S}
    if kind == "kvpilot":
        policy: Any = KvpilotPolicy(ScalingTargets.from_spec(params))
    elif kind == "moving-average":
        policy = MovingAveragePolicy(params["target"], 600.0, MIN_REPLICAS, MAX_REPLICAS)
    else:
        n = size_static_for_slo(trace, calibration, SLO_GOAL, MAX_REPLICAS, **common)
        policy = StaticPolicy(n, sizing=f"smallest fleet with >= {SLO_GOAL} SLO attainment")
    res = simulate(trace, policy, calibration, **common).to_dict()
    return {
        "trace": Path(trace_path).stem,
        "kind": kind,
        "params": params,
        **{k: res[k] for k in KEYS},
        "settings": res["settings"]["policy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=str(Path(__file__).parent / "traces"))
    parser.add_argument("--calibration")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--markdown", action="store_true", help="also print the markdown table")
    args = parser.parse_args()
    cal = (Calibration.from_file(args.calibration) if args.calibration else Calibration()).to_dict()
    traces = sorted(str(p) for p in Path(args.traces).glob("*.csv"))
    spec = {"minReplicas": MIN_REPLICAS, "maxReplicas": MAX_REPLICAS}
    jobs = []
    for t in traces:
        jobs.append((t, "kvpilot", {**spec}, cal))
        jobs.append((t, "kvpilot", {**spec, "targetKVCacheUtilization": 0.5}, cal))
        jobs.append((t, "static", {}, cal))
        jobs += [(t, "moving-average", {"target": x}, cal) for x in MA_TARGETS]
    started = time.time()
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        runs = list(pool.map(_run, jobs))
    rows: list[dict[str, Any]] = []
    for t in traces:
        name = Path(t).stem
        mine = [r for r in runs if r["trace"] == name]
        kv = next(r for r in mine if r["kind"] == "kvpilot" and "targetKVCacheUtilization" not in r["params"])
        kv5 = next(r for r in mine if r["kind"] == "kvpilot" and "targetKVCacheUtilization" in r["params"])
        static = next(r for r in mine if r["kind"] == "static")
        ma = [r for r in mine if r["kind"] == "moving-average"]
        within = [r for r in ma if r["replica_hours"] <= kv["replica_hours"]]
        ma_matched = (
            max(within, key=lambda r: r["replica_hours"])
            if within
            else min(ma, key=lambda r: r["replica_hours"])
        )
        ma_best = max(ma, key=lambda r: (r["slo_attainment"], -r["replica_hours"]))
        for label, r in (
            ("kvpilot", kv),
            ("kvpilot-kv0.5", kv5),
            ("static-peak", static),
            ("moving-average (rh-matched)", ma_matched),
            ("moving-average (best SLO)", ma_best),
        ):
            row = {"trace": name, "policy": label, **{k: r[k] for k in KEYS}, "settings": r["settings"]}
            row["replica_hours_vs_static"] = round(r["replica_hours"] / static["replica_hours"], 3)
            rows.append(row)
    out = {
        "slo_ttft_s": SLO_TTFT_S,
        "slo_goal": SLO_GOAL,
        "calibration": cal,
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    print(json.dumps(out, indent=2))
    if args.markdown:
        print()
        print(
            "| trace | policy | SLO attainment | replica-hours | vs static | scale events | peak | p99 TTFT s |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['trace']} | {r['policy']} | {r['slo_attainment'] * 100:.2f}% | {r['replica_hours']:.2f} | "
                f"{r['replica_hours_vs_static'] * 100:.0f}% | {r['scale_events']} | {r['peak_replicas']} | "
                f"{r['ttft_p99_s']:.1f} |"
            )


if __name__ == "__main__":
    main()
