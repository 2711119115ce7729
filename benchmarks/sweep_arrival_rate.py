"""Sweep the arrival-rate term's settings on every trace, at 60 s and 15 s pod startup.

    python benchmarks/sweep_arrival_rate.py [--startup-s 60,15]

Each row is kvpilot with the default Behavior except the settings named (minReplicas 2,
maxReplicas 40, the assumed calibration, 15 s between decisions, TTFT SLO 2 s: the setup of
benchmarks/simulate_policies.py). Prints a markdown table: SLO attainment and replica-hours per trace.
The chosen defaults and what the sweep says are in docs/autoscaler.md (Results).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import KvpilotPolicy
from kvpilot.autoscaler.simulator import simulate
from kvpilot.autoscaler.spec import Behavior, ScalingTargets
from kvpilot.autoscaler.trace import load_trace

HERE = Path(__file__).resolve().parent
TRACES = ("bursty", "diurnal", "flash_crowd")

CONFIGS: list[dict[str, Any]] = [
    {"arrival_rate": False},
    {},  # the default
    {"arrival_lead_s": 0.0},
    {"arrival_lead_s": 90.0},
    {"arrival_trend_window_s": 90.0},
    {"arrival_trend_window_s": 90.0, "arrival_lead_s": 90.0},
    {"arrival_trend_window_s": 120.0},
    {"arrival_trend_window_s": 300.0},
    {"arrival_max_growth": 1.5},
    {"arrival_headroom": 0.85},
    {"arrival_headroom": 1.15},
    {"arrival_service_exponent": 0.75},
    {"arrival_service_exponent": 1.0},
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--startup-s", default="60,15", help="comma-separated pod startup times")
    args = parser.parse_args()
    traces = {name: load_trace(HERE / "traces" / f"{name}.csv") for name in TRACES}
    headers = ["startup", "settings (vs default)"] + [h for t in TRACES for h in (f"{t} SLO", f"{t} rh")]
    print(harness.table_header(headers), flush=True)
    for startup in (float(x) for x in args.startup_s.split(",")):
        cal = replace(Calibration(), startup_s=startup)
        for cfg in CONFIGS:
            behavior = replace(Behavior(), **cfg)
            cells = []
            for trace in traces.values():
                spec = {"minReplicas": 2, "maxReplicas": 40}
                targets = ScalingTargets.from_spec(spec, behavior, max_num_seqs=cal.max_num_seqs)
                r = simulate(trace, KvpilotPolicy(targets), cal, slo_ttft_s=2.0, sync_interval_s=15.0)
                cells += [f"{r.slo_attainment * 100:.2f}%", f"{r.replica_hours:.2f}"]
            label = ", ".join(f"{k}={v:g}" if not isinstance(v, bool) else f"{k}={v}" for k, v in cfg.items())
            print(harness.table_row([f"{startup:g} s", label or "default", *cells]), flush=True)


if __name__ == "__main__":
    main()
