"""`kvpilot autoscaler run|simulate`.

kvpilot autoscaler run [--kubeconfig F] [--namespace NS | --all-namespaces] [--interval 15]
                       [--metrics-source pods|prometheus] [--prometheus-url URL] [--no-leader-elect]
                       [--health-port 8081] [--metrics-port 8080]
kvpilot autoscaler simulate --trace FILE(.csv|.jsonl) --policy kvpilot|static|moving-average
                       [--calibration NAME|FILE] [--startup-s S] [--slo-ttft S] [--slo-tpot S]
                       [--min-replicas N] [--max-replicas N] [--router round-robin|least-loaded|router:POLICY]
                       [--time-scale F] [--rate-scale R] [--startup-sweep] ...   (prints one JSON object)
kvpilot autoscaler simulate --list-calibrations
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from dataclasses import replace
from typing import Any

from kvpilot.autoscaler.sim_routing import ROUTER_POLICY_NAMES
from kvpilot.autoscaler.spec import Behavior, ScalingRule, ScalingTargets, SloTargets
from kvpilot.autoscaler.trace import TraceError, load_per_minute, load_trace, scale_trace

log = logging.getLogger("kvpilot.autoscaler")

POLICIES = ("kvpilot", "static", "moving-average")
DEFAULT_CALIBRATION = "h100/llama-3.1-8b"
STARTUP_SWEEP_S = (0.0, 10.0, 30.0, 60.0, 120.0)


class _ListCalibrations(argparse.Action):
    """--list-calibrations: print the GPU/model pairs (JSON) and exit, like --version."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from kvpilot.autoscaler.replica_model import list_calibrations

        print(json.dumps(list_calibrations(), indent=2))
        parser.exit(0)


def _positive_float(flag: str) -> Any:
    def parse(value: str) -> float:
        try:
            v = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {value!r}") from None
        if not v > 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be > 0, got {value}")
        return v

    return parse


def _nonneg_float(flag: str) -> Any:
    def parse(value: str) -> float:
        try:
            v = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {value!r}") from None
        if not v >= 0 or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {value}")
        return v

    return parse


def _nonneg_int(flag: str) -> Any:
    def parse(value: str) -> int:
        try:
            v = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {value!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 0, got {v}")
        return v

    return parse


def _positive_int(flag: str) -> Any:
    def parse(value: str) -> int:
        v: int = _nonneg_int(flag)(value)
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {v}")
        return v

    return parse


def _fraction(flag: str, zero: bool = False) -> Any:
    """A number in (0, 1], or in [0, 1] with `zero`."""
    low = _nonneg_float(flag) if zero else _positive_float(flag)

    def parse(value: str) -> float:
        v = low(value)
        if v > 1.0:
            raise argparse.ArgumentTypeError(f"{flag} must be in {'[' if zero else '('}0, 1], got {value}")
        return float(v)

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="autoscaler_command", metavar="{run,simulate}")
    sub.required = True

    run_p = sub.add_parser("run", help="run the autoscaler control loop against a cluster")
    run_p.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster config, then ~/.kube/config)"
    )
    scope = run_p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", help="watch InferenceModels in this namespace only")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch all namespaces (default)")
    run_p.add_argument(
        "--interval", type=_positive_float("--interval"), default=15.0, help="seconds between syncs"
    )
    run_p.add_argument(
        "--metrics-source",
        choices=("pods", "prometheus"),
        default="pods",
        help="default metric source for models whose spec does not say (default: pods)",
    )
    run_p.add_argument("--prometheus-url", help="Prometheus base URL when a spec gives none")
    run_p.add_argument(
        "--router-url",
        action="append",
        default=[],
        metavar="URL",
        help="a kvpilot router replica (repeatable, one per replica): its queue depth per model is part of "
        "the queue signal and wakes models scaled to zero",
    )
    run_p.add_argument("--scrape-timeout", type=_positive_float("--scrape-timeout"), default=2.0)
    run_p.add_argument("--no-leader-elect", action="store_true", help="act without holding the Lease")
    run_p.add_argument(
        "--health-port",
        type=_nonneg_int("--health-port"),
        default=8081,
        help="serves /healthz and /readyz (0: off)",
    )
    run_p.add_argument(
        "--metrics-port",
        type=_nonneg_int("--metrics-port"),
        default=8080,
        help="serves Prometheus /metrics (0: off)",
    )
    run_p.add_argument(
        "--leader-namespace",
        default=os.environ.get("POD_NAMESPACE", "kvpilot-system"),
        help="namespace of the kvpilot-autoscaler Lease",
    )
    run_p.add_argument(
        "--identity",
        help="leader-election identity, also written as status.autoscaler.decidedBy "
        "(default: POD_NAME or hostname, plus pid)",
    )
    add_behavior_arguments(run_p)
    run_p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    run_p.set_defaults(_autoscaler_run=_run_controller)

    sim = sub.add_parser("simulate", help="replay a trace against a simulated fleet; prints JSON")
    sim.add_argument(
        "--trace",
        required=True,
        help="CSV (t_seconds,prompt_tokens,output_tokens) or Mooncake JSONL (.jsonl: timestamp ms, "
        "input_length, output_length, hash_ids)",
    )
    sim.add_argument("--policy", choices=POLICIES, default="kvpilot")
    sim.add_argument(
        "--list-calibrations", action=_ListCalibrations, help="print the named calibrations and exit"
    )
    sim.add_argument(
        "--calibration",
        default=DEFAULT_CALIBRATION,
        metavar="NAME|FILE",
        help=f"replica model: GPU/MODEL[/DTYPE][/tpN] (default {DEFAULT_CALIBRATION}; "
        "--list-calibrations) or a JSON file (kvpilot.autoscaler.calibration)",
    )
    sim.add_argument(
        "--startup-s",
        type=_nonneg_float("--startup-s"),
        help="seconds from scale-up to Ready (default: the calibration's)",
    )
    sim.add_argument(
        "--startup-sweep",
        action="store_true",
        help="run at startup 0, 10, 30, 60 and 120 s; the object gets a `startup_sweep` list",
    )
    sim.add_argument(
        "--slo-ttft", type=_positive_float("--slo-ttft"), default=2.0, help="TTFT target (base), seconds"
    )
    sim.add_argument(
        "--slo-tpot", type=_positive_float("--slo-tpot"), default=0.05, help="TPOT target, seconds"
    )
    sim.add_argument(
        "--slo-ttft-prefill-factor",
        type=_nonneg_float("--slo-ttft-prefill-factor"),
        default=2.0,
        help="the TTFT target grows by this x the prompt's prefill time on an idle replica (0: fixed)",
    )
    sim.add_argument(
        "--router",
        choices=("round-robin", "least-loaded", *ROUTER_POLICY_NAMES),
        default="round-robin",
        help="request-to-replica assignment: round-robin (a plain Service), least-loaded (holds requests "
        "in a central queue), or router:<policy>, the fleet router's own policy code",
    )
    sim.add_argument(
        "--time-scale", type=_positive_float("--time-scale"), default=1.0, help="stretch the trace's time"
    )
    sim.add_argument(
        "--rate-scale",
        type=_positive_float("--rate-scale"),
        default=1.0,
        help="R x the requests over the same time",
    )
    sim.add_argument("--min-replicas", type=_nonneg_int("--min-replicas"), default=1)
    sim.add_argument("--max-replicas", type=_nonneg_int("--max-replicas"), default=40)
    sim.add_argument(
        "--initial-replicas", type=_nonneg_int("--initial-replicas"), help="default: min replicas"
    )
    sim.add_argument("--sync-interval", type=_positive_float("--sync-interval"), default=15.0)
    sim.add_argument(
        "--warmup",
        type=_nonneg_int("--warmup"),
        default=300,
        help="seconds left out of the figures (default 300)",
    )
    g = sim.add_argument_group("kvpilot policy (spec.autoscaling)")
    g.add_argument("--target-kv", type=_fraction("--target-kv"), default=None)
    g.add_argument("--target-queue", type=_positive_float("--target-queue"), default=None)
    g.add_argument("--scale-up-window", type=_nonneg_int("--scale-up-window"), default=None)
    g.add_argument("--scale-down-window", type=_nonneg_int("--scale-down-window"), default=None)
    g.add_argument(
        "--slo-planner",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="size for the arrival rate at the replica's capacity within the SLO (spec.autoscaling.slo; "
        "default on)",
    )
    g2 = sim.add_argument_group("static policy")
    g2.add_argument(
        "--replicas",
        type=_nonneg_int("--replicas"),
        help="fleet size (default: the smallest that meets --slo-target on this trace, found by search)",
    )
    g2.add_argument("--slo-target", type=_fraction("--slo-target"), default=0.99)
    g3 = sim.add_argument_group("moving-average policy (KubeAI-style)")
    g3.add_argument("--target-requests", type=_positive_float("--target-requests"), default=24.0)
    g3.add_argument("--window", type=_positive_float("--window"), default=600.0, help="seconds")
    add_behavior_arguments(sim)
    sim.set_defaults(_autoscaler_run=_run_simulate)


def _rule(flag: str) -> Any:
    """PODS,PERCENT,PERIOD_S -> ScalingRule (an HPA behavior policy, selectPolicy Max)."""

    def parse(value: str) -> ScalingRule:
        parts = value.split(",")
        try:
            if len(parts) != 3:
                raise ValueError
            rule = ScalingRule(pods=int(parts[0]), percent=float(parts[1]), period_s=float(parts[2]))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} must be PODS,PERCENT,PERIOD_SECONDS (e.g. 1,50,60), got {value!r}"
            ) from None
        if rule.pods < 0 or rule.percent < 0 or not rule.period_s > 0:
            raise argparse.ArgumentTypeError(f"{flag}: pods and percent must be >= 0 and the period > 0")
        return rule

    return parse


def add_behavior_arguments(parser: argparse.ArgumentParser) -> None:
    """The policy knobs that are not in the CRD (spec.Behavior); defaults in docs/autoscaler.md."""
    d = Behavior()
    g = parser.add_argument_group("policy behavior (not in the CRD)")

    def show(r: ScalingRule) -> str:
        return f"{r.pods},{r.percent:g},{r.period_s:g}"

    g.add_argument(
        "--scale-up-rule",
        type=_rule("--scale-up-rule"),
        default=d.scale_up,
        metavar="PODS,PERCENT,PERIOD",
        help=f"at most max(+PODS, +PERCENT%%) per PERIOD seconds (default {show(d.scale_up)})",
    )
    g.add_argument(
        "--scale-down-rule",
        type=_rule("--scale-down-rule"),
        default=d.scale_down,
        metavar="PODS,PERCENT,PERIOD",
        help=f"at most max(-PODS, -PERCENT%%) per PERIOD seconds (default {show(d.scale_down)})",
    )
    g.add_argument(
        "--scale-down-surplus-share",
        type=_fraction("--scale-down-surplus-share", zero=True),
        default=d.scale_down_surplus_share,
        metavar="SHARE",
        help="... or this share of the surplus over the size the recommendations ask, whichever is more "
        f"(default {d.scale_down_surplus_share:g}; 0: --scale-down-rule alone)",
    )
    g.add_argument(
        "--tolerance", type=_fraction("--tolerance"), default=d.tolerance, help="relative dead band"
    )
    g.add_argument(
        "--scale-down-exponent",
        type=_fraction("--scale-down-exponent"),
        default=d.scale_down_exponent,
        help=f"below target: n * (u / target) ** EXP replicas (default {d.scale_down_exponent:g}; 1: HPA)",
    )
    g.add_argument(
        "--queue-recommendation",
        choices=("absorb", "least-loaded", "average"),
        default=d.queue_recommendation,
        help=f"how waiting requests become replicas (default {d.queue_recommendation})",
    )
    g.add_argument(
        "--arrival-rate",
        action=argparse.BooleanOptionalAction,
        default=d.arrival_rate,
        help="also size for the forecast arrival rate (needs the request_success counter; "
        f"default {'on' if d.arrival_rate else 'off'})",
    )
    g.add_argument(
        "--arrival-lead",
        type=_nonneg_float("--arrival-lead"),
        default=d.arrival_lead_s,
        metavar="SECONDS",
        help=f"forecast the arrival rate this far ahead (default {d.arrival_lead_s:g}: about pod startup)",
    )
    g.add_argument(
        "--arrival-trend-window",
        type=_nonneg_float("--arrival-trend-window"),
        default=d.arrival_trend_window_s,
        metavar="SECONDS",
        help=f"fit the arrival trend over this window (default {d.arrival_trend_window_s:g})",
    )
    g.add_argument(
        "--arrival-headroom",
        type=_positive_float("--arrival-headroom"),
        default=d.arrival_headroom,
        help=f"multiply the forecast arrival rate by this (default {d.arrival_headroom:g})",
    )
    g.add_argument(
        "--redundancy-replicas",
        type=_positive_int("--redundancy-replicas"),
        default=d.redundancy_replicas,
        metavar="N",
        help="while the forecast load needs at least --redundancy-load of one replica, keep at least N "
        f"replicas (default {d.redundancy_replicas}; 1: off)",
    )
    g.add_argument(
        "--redundancy-load",
        type=_nonneg_float("--redundancy-load"),
        default=d.redundancy_load,
        metavar="SHARE",
        help=f"the share of one replica's capacity from which --redundancy-replicas applies (default {d.redundancy_load:g})",
    )


def behavior_from_args(args: argparse.Namespace) -> Behavior:
    d = Behavior()
    return replace(
        d,
        scale_up=getattr(args, "scale_up_rule", d.scale_up),
        scale_down=getattr(args, "scale_down_rule", d.scale_down),
        scale_down_surplus_share=getattr(args, "scale_down_surplus_share", d.scale_down_surplus_share),
        tolerance=getattr(args, "tolerance", d.tolerance),
        scale_down_exponent=getattr(args, "scale_down_exponent", d.scale_down_exponent),
        queue_recommendation=getattr(args, "queue_recommendation", d.queue_recommendation),
        arrival_rate=getattr(args, "arrival_rate", d.arrival_rate),
        arrival_lead_s=getattr(args, "arrival_lead", d.arrival_lead_s),
        arrival_trend_window_s=getattr(args, "arrival_trend_window", d.arrival_trend_window_s),
        arrival_headroom=getattr(args, "arrival_headroom", d.arrival_headroom),
        redundancy_replicas=getattr(args, "redundancy_replicas", d.redundancy_replicas),
        redundancy_load=getattr(args, "redundancy_load", d.redundancy_load),
    )


def run(args: argparse.Namespace) -> int:
    handler = getattr(args, "_autoscaler_run", None)
    if handler is None:
        print("kvpilot autoscaler: choose a command: run or simulate", file=sys.stderr)
        return 2
    result: int = handler(args)
    return result


# -- simulate ------------------------------------------------------------------------------------------


def default_targets(
    args: argparse.Namespace, max_num_seqs: int | None = None, slo: SloTargets | None = None
) -> ScalingTargets:
    spec: dict[str, Any] = {"minReplicas": args.min_replicas, "maxReplicas": args.max_replicas}
    for key, attr in (
        ("targetKVCacheUtilization", "target_kv"),
        ("targetQueueDepth", "target_queue"),
        ("scaleUpStabilizationSeconds", "scale_up_window"),
        ("scaleDownStabilizationSeconds", "scale_down_window"),
    ):
        value = getattr(args, attr, None)
        if value is not None:
            spec[key] = value
    targets = ScalingTargets.from_spec(spec, behavior_from_args(args), max_num_seqs=max_num_seqs)
    return targets if slo is None else targets.with_overrides(slo=slo)


def _fail(message: str) -> int:
    print(f"kvpilot autoscaler simulate: {message}", file=sys.stderr)
    return 2


def _run_simulate(args: argparse.Namespace) -> int:
    from kvpilot.autoscaler.fleet_policies import KvpilotPolicy, MovingAveragePolicy, StaticPolicy
    from kvpilot.autoscaler.replica_model import resolve_calibration
    from kvpilot.autoscaler.simulator import ROUTERS, simulate, size_static_for_slo
    from kvpilot.autoscaler.slo import Slo

    if args.max_replicas < max(1, args.min_replicas):
        return _fail("--max-replicas must be >= 1 and >= --min-replicas")
    if args.startup_sweep and args.startup_s is not None:
        return _fail("--startup-sweep runs its own startup times; drop --startup-s")
    try:
        trace = scale_trace(load_trace(args.trace), args.time_scale, args.rate_scale)
    except TraceError as exc:
        return _fail(f"--trace: {exc}")
    except ValueError as exc:
        return _fail(f"--rate-scale: {exc}")
    try:
        cal = resolve_calibration(args.calibration, args.startup_s)
    except ValueError as exc:
        return _fail(f"--calibration: {exc}")
    slo = Slo(args.slo_ttft, args.slo_tpot, args.slo_ttft_prefill_factor)
    router_cls = ROUTERS[args.router]
    common: dict[str, Any] = {
        "sync_interval_s": args.sync_interval,
        "slo": slo,
        "warmup_s": float(args.warmup),
    }

    def run_once(startup_s: float | None) -> dict[str, Any]:
        from dataclasses import replace as dc_replace

        c = cal if startup_s is None else dc_replace(cal, startup_s=startup_s)
        policy: Any
        if args.policy == "kvpilot":
            planner = (
                SloTargets(c, args.calibration, slo.ttft_s, slo.tpot_s, slo.ttft_prefill_factor)
                if args.slo_planner
                else None
            )
            policy = KvpilotPolicy(
                default_targets(args, c.max_num_seqs, planner), initial=args.initial_replicas
            )
        elif args.policy == "moving-average":
            policy = MovingAveragePolicy(
                args.target_requests,
                window_s=args.window,
                min_replicas=args.min_replicas,
                max_replicas=args.max_replicas,
                initial=args.initial_replicas,
            )
        elif args.replicas is not None:
            policy = StaticPolicy(args.replicas)
        else:
            n = size_static_for_slo(
                trace, c, args.slo_target, args.max_replicas, router_factory=router_cls, **common
            )
            policy = StaticPolicy(
                n, sizing=f"smallest fleet meeting {args.slo_target:g} SLO attainment (search)"
            )
        return simulate(trace, policy, c, router=router_cls(), **common).to_dict()

    if args.startup_sweep:
        sweep = [{"startup_s": s_, **run_once(s_)} for s_ in STARTUP_SWEEP_S]
        out = {k: v for k, v in sweep[-1].items() if k in ("policy", "settings")}
        out["startup_sweep"] = [{k: v for k, v in r.items() if k != "settings"} for r in sweep]
    else:
        out = run_once(None)
    out["trace"] = args.trace
    out["settings"].update(
        {
            "calibration_name": args.calibration,
            "startup_s": None if args.startup_sweep else cal.startup_s,
            "min_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "time_scale": args.time_scale,
            "rate_scale": args.rate_scale,
        }
    )
    out["load_per_minute"] = load_per_minute(trace)
    print(json.dumps(out, indent=2))
    return 0


# -- run -----------------------------------------------------------------------------------------------


def _run_controller(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.metrics_source == "prometheus" and not args.prometheus_url:
        log.warning("--metrics-source prometheus without --prometheus-url: specs must give prometheus.url")
    from kvpilot.kube.client import load_api_client

    try:
        api_client = load_api_client(args.kubeconfig)
    except Exception as exc:
        where = (
            f"--kubeconfig {args.kubeconfig}" if args.kubeconfig else "in-cluster config or ~/.kube/config"
        )
        print(
            f"kvpilot autoscaler run: cannot load Kubernetes credentials from {where}: {exc}", file=sys.stderr
        )
        return 2
    return asyncio.run(_serve(args, api_client))


async def _serve(args: argparse.Namespace, api_client: Any) -> int:
    from prometheus_client import REGISTRY, start_http_server

    from kvpilot.autoscaler.controller import ControllerConfig, ScalingController
    from kvpilot.autoscaler.election import AlwaysLeader, LeaseElection, lease_election
    from kvpilot.autoscaler.kube import KubernetesApi
    from kvpilot.autoscaler.liveness import LoopHealth
    from kvpilot.autoscaler.metrics import AutoscalerMetrics
    from kvpilot.kube.health import start_health_server
    from kvpilot.kube.lease import default_identity

    identity = args.identity or default_identity()
    elector: Any = AlwaysLeader()
    election: LeaseElection | None = None
    if not args.no_leader_elect:
        election = lease_election(api_client, args.leader_namespace, identity)
        elector = election.start()
        log.info("campaigning for Lease %s/kvpilot-autoscaler as %s", args.leader_namespace, identity)
    cfg = ControllerConfig(
        namespace=None if args.all_namespaces else args.namespace,
        interval_s=args.interval,
        default_metrics_source=args.metrics_source,
        prometheus_url=args.prometheus_url,
        router_urls=tuple(args.router_url),
        scrape_timeout_s=args.scrape_timeout,
        behavior=behavior_from_args(args),
        identity=identity,
    )
    health = LoopHealth(cfg.interval_s)
    metrics = AutoscalerMetrics(REGISTRY)
    servers: list[Any] = []
    try:
        if args.health_port:
            servers.append(start_health_server(args.health_port, health.checks()))
        if args.metrics_port:
            servers.append(start_http_server(args.metrics_port, registry=metrics.registry)[0])
        controller = ScalingController(
            KubernetesApi(api_client), cfg, elector=elector, observers=[metrics, health]
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        log.info(
            "autoscaler started (scope %s, every %gs)", cfg.namespace or "all namespaces", cfg.interval_s
        )
        try:
            await controller.run(stop)
        finally:
            await controller.close()
    finally:
        if election is not None:
            # Releases the Lease when held, so a standby takes over without waiting for it to expire.
            await asyncio.to_thread(election.stop)
        for server in servers:
            server.shutdown()
    return 0


__all__ = ["ScalingRule", "add_arguments", "run"]
