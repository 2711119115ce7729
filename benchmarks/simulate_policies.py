"""Run every scaling policy on every trace in benchmarks/traces/ and print a JSON table.

    python benchmarks/simulate_policies.py [--calibration assumed|measured|FILE] [--startup-s S]
        [--jobs 2] [--markdown]

The replica model comes from a calibration. `assumed` (default) is the built-in guess for an 8B model
on one 48 GB GPU (kvpilot.autoscaler.calibration.Calibration()), the kind of replica the traces were
written for. `measured` is benchmarks/calibration/smollm2-cpu.json, fitted by
benchmarks/calibrate_simulator.py to the real runtime serving SmolLM2 on this machine's CPU: it
cannot meet a 2 s TTFT for the traces' longer prompts at any fleet size, so it validates the
simulator (see that script) rather than the policy. `--startup-s` replaces the calibration's pod
startup time (the sensitivity that matters most).

Policies, all on the same simulated fleet (kvpilot.autoscaler.simulator) and the same SLO (TTFT <= 2 s):
- kvpilot: policy.decide() with the CRD defaults (targetKVCacheUtilization 0.7, targetQueueDepth 4,
  windows 0 s / 300 s) and the autoscaler's default Behavior (arrival-rate term on), minReplicas 2;
  kvpilot-kv0.5 is the same with a 0.5 utilization target; "kvpilot (no arrival rate)" is the
  previous default (Behavior.arrival_rate off); "kvpilot (arrival, 90 s trend)" and
  "kvpilot (arrival, headroom 1.15)" vary the arrival term; "kvpilot (proportional down)" uses the
  HPA's proportional scale-down (scale_down_exponent 1).
- static-min: the smallest fixed fleet whose attainment over the whole trace meets the goal (perfect
  hindsight; it may let short peaks miss, as they are a small share of all requests).
- static-peak: the smallest fixed fleet that meets the goal in every minute: provisioned for the peak.
- moving-average: KubeAI-style, 10-minute window, minReplicas 2, target requests per replica swept;
  reported at the target whose replica-hours are closest to kvpilot's without exceeding them (the fair
  comparison: "better SLO at no more replica-hours"), plus its best-SLO target.
- clairvoyant (a reference, not a policy one can run): knows the arrivals ahead and sizes the fleet
  `startup_s` early for the busiest minute to come, at the per-replica rate (swept) that meets the goal
  at the fewest replica-hours.
- reactive oracle (a reference): knows the true arrival rate of the last minute and sizes for it at
  once (rate swept; the best SLO at no more replica-hours than static-min). What reacting, however
  well informed, can do with this startup time: the gap to clairvoyant is the cost of pod startup.
"""

from __future__ import annotations

import argparse
import bisect
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import KvpilotPolicy, MovingAveragePolicy, StaticPolicy
from kvpilot.autoscaler.samples import MetricsSnapshot
from kvpilot.autoscaler.simulator import simulate, size_static_for_slo
from kvpilot.autoscaler.spec import Behavior, ScalingTargets
from kvpilot.autoscaler.trace import TraceRequest, load_trace

HERE = Path(__file__).resolve().parent
MEASURED = HERE / "calibration" / "smollm2-cpu.json"
SLO_TTFT_S = 2.0
SLO_GOAL = 0.99
MIN_REPLICAS = 2
MA_WINDOW_S = 600.0
# Variants of the default Behavior shown as their own rows.
KVPILOT_VARIANTS: dict[str, dict[str, Any]] = {
    "kvpilot (no arrival rate)": {"arrival_rate": False},
    "kvpilot (arrival, 90 s trend)": {"arrival_trend_window_s": 90.0},
    "kvpilot (arrival, headroom 1.15)": {"arrival_headroom": 1.15},
}
KEYS = (
    "slo_attainment",
    "worst_minute_attainment",
    "replica_hours",
    "scale_events",
    "peak_replicas",
    "ttft_p99_s",
    "rejected",
    "preemptions",
)


class ClairvoyantPolicy:
    """Knows the trace: at each sync, sizes for the busiest minute that starts within the next
    startup + sync interval, at `per_replica_rps` requests/s per replica. A reference bound."""

    name = "clairvoyant"

    def __init__(
        self,
        trace: list[TraceRequest],
        per_replica_rps: float,
        lead_s: float,
        min_replicas: int,
        max_replicas: int,
    ) -> None:
        self.times = [r.t for r in trace]
        self.rate = per_replica_rps
        self.lead_s = lead_s
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas

    def _need(self, now: float) -> int:
        busiest = 0.0
        t = now
        while t <= now + self.lead_s:
            i, j = bisect.bisect_left(self.times, t), bisect.bisect_left(self.times, t + 60.0)
            busiest = max(busiest, (j - i) / 60.0)
            t += 5.0
        return min(self.max_replicas, max(self.min_replicas, math.ceil(busiest / self.rate - 1e-9)))

    def initial_replicas(self) -> int:
        return self._need(0.0)

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        return self._need(now)

    def settings(self) -> dict[str, Any]:
        return {"per_replica_rps": self.rate, "lead_s": self.lead_s, "min_replicas": self.min_replicas}


class ReactiveOraclePolicy:
    """Knows the true arrival rate of the last minute (what no metric gives so cleanly) and sizes the
    fleet for it at once, at `per_replica_rps`; holds the largest size of the last 5 minutes before
    scaling down. A reference: what reacting, however well informed, can do with this startup time."""

    name = "reactive-oracle"

    def __init__(
        self, trace: list[TraceRequest], per_replica_rps: float, min_replicas: int, max_replicas: int
    ) -> None:
        self.times = [r.t for r in trace]
        self.rate = per_replica_rps
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.recent: list[tuple[float, int]] = []

    def initial_replicas(self) -> int:
        return self.min_replicas

    def decide(self, now: float, current: int, snapshot: MetricsSnapshot, in_flight: int) -> int:
        i, j = bisect.bisect_left(self.times, now - 60.0), bisect.bisect_left(self.times, now)
        need = min(self.max_replicas, max(self.min_replicas, math.ceil((j - i) / 60.0 / self.rate - 1e-9)))
        self.recent = [(t, n) for t, n in self.recent if now - t < 300.0] + [(now, need)]
        return need if need >= current else max(n for _, n in self.recent)

    def settings(self) -> dict[str, Any]:
        return {"per_replica_rps": self.rate, "window_s": 60.0, "scale_down_hold_s": 300.0}


def _run(job: tuple[str, str, dict[str, Any], dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    trace_path, kind, params, cal, common = job
    trace = load_trace(trace_path)
    calibration = Calibration.from_dict(cal)
    max_replicas = common["max_replicas"]
    sim = {"slo_ttft_s": SLO_TTFT_S, "sync_interval_s": common["sync_interval_s"]}
    if kind == "kvpilot":
        spec = {k: v for k, v in params.items() if k != "behavior"}
        behavior = replace(Behavior(), **params.get("behavior", {}))
        spec = {"minReplicas": MIN_REPLICAS, "maxReplicas": max_replicas, **spec}
        targets = ScalingTargets.from_spec(spec, behavior, max_num_seqs=calibration.max_num_seqs)
        policy: Any = KvpilotPolicy(targets)
    elif kind == "moving-average":
        policy = MovingAveragePolicy(params["target"], MA_WINDOW_S, MIN_REPLICAS, max_replicas)
    elif kind == "reactive-oracle":
        policy = ReactiveOraclePolicy(trace, params["rps"], MIN_REPLICAS, max_replicas)
    elif kind == "clairvoyant":
        lead = calibration.startup_s + common["sync_interval_s"]
        policy = ClairvoyantPolicy(trace, params["rps"], lead, MIN_REPLICAS, max_replicas)
    else:
        peak = kind == "static-peak"
        n = size_static_for_slo(trace, calibration, SLO_GOAL, max_replicas, every_minute=peak, **sim)
        how = "in every minute" if peak else "over the trace"
        policy = StaticPolicy(n, sizing=f"smallest fleet with >= {SLO_GOAL} SLO attainment {how}")
    res = simulate(trace, policy, calibration, **sim).to_dict()
    return {
        "trace": Path(trace_path).stem,
        "kind": kind,
        "params": params,
        **{k: res[k] for k in KEYS},
        "settings": res["settings"]["policy"],
    }


def _load_calibration(value: str) -> tuple[str, Calibration]:
    if value == "assumed":
        return "assumed", Calibration()
    path = MEASURED if value == "measured" else Path(value)
    return str(path), Calibration.from_file(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=str(HERE / "traces"))
    parser.add_argument("--calibration", default="assumed", help="assumed (default), measured, or a FILE")
    parser.add_argument("--startup-s", type=float, help="replace the calibration's pod startup time")
    parser.add_argument("--max-replicas", type=int, default=40)
    parser.add_argument("--sync-interval", type=float, default=15.0, help="seconds between decisions")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--markdown", action="store_true", help="also print the markdown table")
    args = parser.parse_args()
    cal_name, calibration = _load_calibration(args.calibration)
    if args.startup_s is not None:
        calibration = replace(calibration, startup_s=args.startup_s)
    cal = calibration.to_dict()
    max_replicas = args.max_replicas
    common = {"max_replicas": max_replicas, "sync_interval_s": args.sync_interval}
    traces = sorted(str(p) for p in Path(args.traces).glob("*.csv"))
    jobs: list[tuple[str, str, dict[str, Any], dict[str, Any], dict[str, Any]]] = []
    for t in traces:
        jobs.append((t, "kvpilot", {}, cal, common))
        jobs.append((t, "kvpilot", {"targetKVCacheUtilization": 0.5}, cal, common))
        jobs.append((t, "kvpilot", {"behavior": {"scale_down_exponent": 1.0}}, cal, common))
        for variant in KVPILOT_VARIANTS.values():
            jobs.append((t, "kvpilot", {"behavior": variant}, cal, common))
        jobs.append((t, "static-min", {}, cal, common))
        jobs.append((t, "static-peak", {}, cal, common))
        jobs += [(t, "moving-average", {"target": x}, cal, common) for x in _ma_targets(calibration)]
        jobs += [(t, "clairvoyant", {"rps": x}, cal, common) for x in _clairvoyant_rates(calibration)]
        jobs += [(t, "reactive-oracle", {"rps": x}, cal, common) for x in _oracle_rates(calibration)]
    started = time.time()
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        runs = list(pool.map(_run, jobs))
    rows: list[dict[str, Any]] = []
    for t in traces:
        name = Path(t).stem
        mine = [r for r in runs if r["trace"] == name]
        kv = next(r for r in mine if r["kind"] == "kvpilot" and not r["params"])
        kv5 = next(r for r in mine if r["kind"] == "kvpilot" and "targetKVCacheUtilization" in r["params"])
        prop = next(
            r
            for r in mine
            if r["kind"] == "kvpilot" and r["params"].get("behavior") == {"scale_down_exponent": 1.0}
        )
        variants = [
            (label, next(r for r in mine if r["kind"] == "kvpilot" and r["params"].get("behavior") == b))
            for label, b in KVPILOT_VARIANTS.items()
        ]
        static = next(r for r in mine if r["kind"] == "static-min")
        peak = next(r for r in mine if r["kind"] == "static-peak")
        ma = [r for r in mine if r["kind"] == "moving-average"]
        within = [r for r in ma if r["replica_hours"] <= kv["replica_hours"]]
        ma_matched = (
            max(within, key=lambda r: r["replica_hours"])
            if within
            else min(ma, key=lambda r: r["replica_hours"])
        )
        ma_best = max(ma, key=lambda r: (r["slo_attainment"], -r["replica_hours"]))
        seers = [r for r in mine if r["kind"] == "clairvoyant"]
        meeting = [r for r in seers if r["slo_attainment"] >= SLO_GOAL]
        seer = (
            min(meeting, key=lambda r: r["replica_hours"])
            if meeting
            else max(seers, key=lambda r: r["slo_attainment"])
        )
        oracles = [r for r in mine if r["kind"] == "reactive-oracle"]
        affordable = [r for r in oracles if r["replica_hours"] <= static["replica_hours"]] or oracles
        oracle = max(affordable, key=lambda r: (r["slo_attainment"], -r["replica_hours"]))
        for label, r in (
            ("kvpilot", kv),
            ("kvpilot-kv0.5", kv5),
            *variants,
            ("kvpilot (proportional down)", prop),
            ("static-min", static),
            ("static-peak", peak),
            ("moving-average (rh-matched)", ma_matched),
            ("moving-average (best SLO)", ma_best),
            ("clairvoyant (reference)", seer),
            ("reactive oracle (reference)", oracle),
        ):
            row = {"trace": name, "policy": label, **{k: r[k] for k in KEYS}, "settings": r["settings"]}
            row["replica_hours_vs_static_min"] = round(r["replica_hours"] / static["replica_hours"], 3)
            row["replica_hours_vs_static_peak"] = round(r["replica_hours"] / peak["replica_hours"], 3)
            rows.append(row)
    out = {
        "slo_ttft_s": SLO_TTFT_S,
        "slo_goal": SLO_GOAL,
        "calibration_file": cal_name,
        "calibration": cal,
        "max_replicas": max_replicas,
        "sync_interval_s": args.sync_interval,
        "machine": harness.machine(),
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    harness.emit(out)
    if args.markdown:
        print()
        harness.print_table(
            [
                "trace",
                "policy",
                "SLO attainment",
                "worst minute",
                "replica-hours",
                "vs static-min",
                "vs static-peak",
                "scale events",
                "peak",
                "p99 TTFT s",
            ],
            (
                [
                    r["trace"],
                    r["policy"],
                    f"{r['slo_attainment'] * 100:.2f}%",
                    f"{r['worst_minute_attainment'] * 100:.0f}%",
                    f"{r['replica_hours']:.2f}",
                    f"{r['replica_hours_vs_static_min'] * 100:.0f}%",
                    f"{r['replica_hours_vs_static_peak'] * 100:.0f}%",
                    r["scale_events"],
                    r["peak_replicas"],
                    f"{r['ttft_p99_s']:.1f}",
                ]
                for r in rows
            ),
        )


def _per_replica_rps(cal: Calibration) -> float:
    """Requests/s one replica serves at full batch on the traces' median request (400 in, 150 out):
    only used to put the swept parameters of the baselines on the calibration's scale."""
    seqs = cal.max_num_seqs
    per_request = cal.prefill_s_per_token * 400 + cal.step_seconds(seqs, 0) / seqs * 150
    return 1.0 / per_request


def _ma_targets(cal: Calibration) -> list[float]:
    """Target in-flight requests per replica: around what one replica holds at the KV target."""
    full = min(cal.max_num_seqs, cal.kv_capacity_tokens / 600)
    return sorted({max(1.0, round(full * f, 1)) for f in (0.15, 0.25, 0.35, 0.5, 0.75, 1.0)})


def _clairvoyant_rates(cal: Calibration) -> list[float]:
    base = _per_replica_rps(cal)
    return [round(base * f, 4) for f in (0.4, 0.5, 0.6, 0.7, 0.8)]


def _oracle_rates(cal: Calibration) -> list[float]:
    """Reacting needs headroom for the startup gap: lower per-replica rates than the clairvoyant's."""
    base = _per_replica_rps(cal)
    return [round(base * f, 4) for f in (0.15, 0.2, 0.25, 0.3, 0.4, 0.5)]


if __name__ == "__main__":
    main()
