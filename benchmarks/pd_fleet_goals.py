"""Issue 25's simulated goal: prefill/decode disaggregation against aggregated fleets, per trace, in the
fleet simulator with the router's policy code. Prints one JSON object (and, with --markdown, the goal
table of docs/disaggregation.md).

    python benchmarks/pd_fleet_goals.py --trace PATH[@RATE_SCALE] [--trace ...]
        [--router router:kv-aware] [--startup 10] [--calibration h100/llama-3.1-8b]
        [--max-replicas 16] [--link-gbs 25] [--min-prompt-tokens 512] [--jobs 2] [--markdown]

Traces are paths (.csv or Mooncake .jsonl), never read from a fixed place; `@8` replays 8x the requests
in the same time. SLO: TTFT 2 s + 2 x the prompt's idle prefill, TPOT 50 ms (api/slo.judge), goal 99%.
Per trace:
- aggregated static: the smallest fixed aggregated fleet with >= 99% attainment (binary search);
- P/D static: at every total from 2 up to the aggregated fleet's size, the best P:D split (every split
  simulated), and the smallest total whose best split reaches 99%;
- P/D autoscaler: pd_policy.decide_pd (per-role signals, learned P:D ratio, per-role closed loop) at
  --startup s, starting from 1 + 1.
The goal: the autoscaler >= 99% at fewer replica-hours than the aggregated static fleet.
Each P/D row's `transfer` has the pulls (count, GB, mean seconds, per 1k prompt tokens, fallbacks) and
the TTFT breakdown of the disaggregated requests (prefill leg, pull, decode admission and first step),
over all of them and over those that missed TTFT (`ttft_breakdown`, `ttft_breakdown_missed`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvpilot.autoscaler.fleet_policies import StaticPolicy
from kvpilot.autoscaler.pd_policy import PdKvpilotPolicy, PdTargets
from kvpilot.autoscaler.pd_simulator import PdStaticPolicy, simulate_pd
from kvpilot.autoscaler.replica_model import resolve_calibration
from kvpilot.autoscaler.simulator import ROUTERS, simulate
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.spec import ScalingTargets, SloTargets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_slo_goals import load_spec, spec_name
from harness import machine, print_table

SLO = Slo(ttft_s=2.0, tpot_s=0.05, ttft_prefill_factor=2.0)
GOAL = 0.99
Job = tuple[str, str, dict[str, Any]]  # trace spec, kind, params


def _run(job: Job) -> dict[str, Any]:
    spec, kind, p = job
    cal = replace(
        resolve_calibration(p["calibration"]), startup_s=p["startup_s"], kv_link_bytes_s=p["link_gbs"] * 1e9
    )
    trace = load_spec(spec)
    router = p["router"]
    pd_routers = {"prefill_router": ROUTERS[router](), "decode_router": ROUTERS[router]()}
    out: dict[str, Any] = {"trace": spec, "kind": kind}
    if kind == "aggregated":
        r = simulate(trace, StaticPolicy(p["n"]), cal, router=ROUTERS[router](), slo=SLO)
        out["sizes"] = p["n"]
    elif kind == "pd static":
        r = simulate_pd(
            trace, PdStaticPolicy(*p["sizes"]), cal, slo=SLO, min_prompt_tokens=p["min_prompt"], **pd_routers
        )
        out["sizes"] = list(p["sizes"])
    else:
        planner = SloTargets(cal, p["calibration"], SLO.ttft_s, SLO.tpot_s, SLO.ttft_prefill_factor)
        base = ScalingTargets(
            min_replicas=1, max_replicas=p["max"], max_num_seqs=cal.max_num_seqs, slo=planner
        )
        policy = PdKvpilotPolicy(PdTargets(base, 1, p["max"], 1, p["max"]), initial=(1, 1))
        r = simulate_pd(trace, policy, cal, slo=SLO, min_prompt_tokens=p["min_prompt"], **pd_routers)
        out["last_reason"] = policy.last_reason
        out["ratio"] = policy.state.ratio
    out.update(
        slo_attainment=r.slo_attainment,
        ttft_attainment=r.ttft_attainment,
        replica_hours=r.replica_hours,
        peak_replicas=r.peak_replicas,
        mean_replicas=r.mean_replicas,
        ttft_p99_s=r.ttft_p99_s,
        tpot_p99_s=r.tpot_p99_s,
        role_replica_hours=r.settings.get("role_replica_hours"),
        transfer=r.settings.get("disaggregation"),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", required=True, help="PATH[@RATE_SCALE], repeatable")
    parser.add_argument("--router", default="router:kv-aware")
    parser.add_argument("--startup", type=float, default=10.0, help="replica startup, seconds")
    parser.add_argument("--calibration", default="h100/llama-3.1-8b")
    parser.add_argument("--max-replicas", type=int, default=16)
    parser.add_argument("--link-gbs", type=float, default=25.0, help="KV transfer link, GB/s")
    parser.add_argument("--min-prompt-tokens", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.router not in ROUTERS:
        parser.error(f"--router: unknown router {args.router!r} (known: {', '.join(ROUTERS)})")
    for spec in args.trace:
        if not Path(spec.partition("@")[0]).is_file():
            parser.error(f"--trace: no file {spec.partition('@')[0]}")
    if args.link_gbs <= 0:
        parser.error("--link-gbs: must be > 0")
    if args.min_prompt_tokens < 0:
        parser.error("--min-prompt-tokens: must be >= 0")
    if args.max_replicas < 2:
        parser.error("--max-replicas: must be >= 2")
    common = {
        "calibration": args.calibration,
        "startup_s": args.startup,
        "link_gbs": args.link_gbs,
        "router": args.router,
        "min_prompt": args.min_prompt_tokens,
        "max": args.max_replicas,
    }
    started = time.time()
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        auto_futures = {t: pool.submit(_run, (t, "pd autoscaler", common)) for t in args.trace}
        agg: dict[tuple[str, int], dict[str, Any]] = {}
        bounds = {t: [1, args.max_replicas] for t in args.trace}
        for r in pool.map(_run, [(t, "aggregated", {**common, "n": args.max_replicas}) for t in args.trace]):
            agg[(r["trace"], args.max_replicas)] = r
        while any(lo < hi for lo, hi in bounds.values()):
            mids = {t: (lo + hi) // 2 for t, (lo, hi) in bounds.items() if lo < hi}
            jobs = [(t, "aggregated", {**common, "n": m}) for t, m in mids.items()]
            for (t, m), r in zip(mids.items(), pool.map(_run, jobs), strict=True):
                agg[(t, m)] = r
                if r["slo_attainment"] >= GOAL:
                    bounds[t][1] = m
                else:
                    bounds[t][0] = m + 1
        for t in args.trace:
            n_agg = bounds[t][0]
            ref = agg[(t, n_agg)]
            # Every split of every total up to the aggregated fleet's size.
            splits = [(p, total - p) for total in range(2, n_agg + 1) for p in range(1, total)]
            pd_runs = list(pool.map(_run, [(t, "pd static", {**common, "sizes": s}) for s in splits]))
            best: dict[int, dict[str, Any]] = {}
            for r in pd_runs:
                total = sum(r["sizes"])
                if total not in best or r["slo_attainment"] > best[total]["slo_attainment"]:
                    best[total] = r
            reaching = [best[n] for n in sorted(best) if best[n]["slo_attainment"] >= GOAL]
            auto = auto_futures[t].result()
            rows.append(
                {
                    "trace": spec_name(t),
                    "aggregated_static": _row(ref, ref),
                    "pd_static_best": _row(reaching[0], ref) if reaching else None,
                    "pd_static_by_total": {
                        n: {"sizes": b["sizes"], "slo_attainment": round(b["slo_attainment"], 5)}
                        for n, b in sorted(best.items())
                    },
                    "pd_autoscaler": _row(auto, ref),
                    "autoscaler_ratio": None if auto["ratio"] is None else round(auto["ratio"], 3),
                    "autoscaler_last_reason": auto["last_reason"],
                    "goal_met": auto["slo_attainment"] >= GOAL
                    and auto["replica_hours"] < ref["replica_hours"],
                }
            )
    out = {
        "benchmark": "pd_fleet_goals",
        "router": args.router,
        "calibration": args.calibration,
        "startup_s": args.startup,
        "kv_link_gbs": args.link_gbs,
        "min_prompt_tokens": args.min_prompt_tokens,
        "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s, "ttft_prefill_factor": SLO.ttft_prefill_factor},
        "goal": GOAL,
        "rows": rows,
        "seconds": round(time.time() - started, 1),
        "machine": machine(),
    }
    print(json.dumps(out, indent=1))
    if args.markdown:
        headers = [
            "trace",
            "fleet",
            "replicas",
            "attainment",
            "replica-hours (vs aggregated)",
            "TTFT p99",
            "TPOT p99",
        ]
        table = []
        for row in rows:
            for label, key in (
                ("aggregated, fixed (smallest at 99%)", "aggregated_static"),
                ("P/D, fixed (smallest total at 99%, best split)", "pd_static_best"),
                (f"P/D autoscaler ({args.startup:g} s startup)", "pd_autoscaler"),
            ):
                r = row[key]
                if r is None:
                    table.append([row["trace"], label, "none reaches 99%", "", "", "", ""])
                    continue
                table.append(
                    [
                        row["trace"],
                        label,
                        r["replicas"],
                        f"{r['slo_attainment']:.2%}",
                        f"{r['replica_hours']:.3f} ({r['vs_aggregated']:.0%})",
                        f"{r['ttft_p99_s']:.2f} s",
                        f"{r['tpot_p99_s'] * 1000:.1f} ms",
                    ]
                )
        print()
        print_table(headers, table)


def _row(r: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    sizes = r.get("sizes")
    if isinstance(sizes, list):
        replicas = f"{sizes[0]} P + {sizes[1]} D"
    elif sizes is not None:
        replicas = str(sizes)
    else:
        hours = r["role_replica_hours"]
        window_h = r["replica_hours"] / r["mean_replicas"] if r["mean_replicas"] else 0.0
        replicas = (
            f"mean {hours['prefill'] / window_h:.1f} P + {hours['decode'] / window_h:.1f} D, peak {r['peak_replicas']}"
            if window_h
            else "-"
        )
    return {
        "replicas": replicas,
        "slo_attainment": round(r["slo_attainment"], 5),
        "ttft_attainment": round(r["ttft_attainment"], 5),
        "replica_hours": round(r["replica_hours"], 4),
        "vs_aggregated": round(r["replica_hours"] / ref["replica_hours"], 4),
        "ttft_p99_s": round(r["ttft_p99_s"], 3),
        "tpot_p99_s": round(r["tpot_p99_s"], 4),
        "transfer": r.get("transfer"),
    }


if __name__ == "__main__":
    main()
