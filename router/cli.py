"""`kvpilot router`: the fleet router, from a static endpoint list or watching a namespace's pods."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from aiohttp import web

from kvpilot.api.models import (
    DEFAULT_KV_TRANSFER_TIMEOUT_S,
    DEFAULT_PD_MIN_PROMPT_TOKENS,
    DEFAULT_TPOT_S,
    DEFAULT_TTFT_S,
)
from kvpilot.api.slo import SloTargets
from kvpilot.router.outlier import OutlierSettings
from kvpilot.router.pd import PdSettings
from kvpilot.router.policy import DEFAULT_POLICY, POLICIES
from kvpilot.router.pool import PRIORITIES, QueueSettings
from kvpilot.router.server import Router, RouterSettings

log = logging.getLogger("kvpilot.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoints",
        action="append",
        default=[],
        metavar="MODEL=URL[,URL...]",
        help="a model's pods (repeatable); without it the router watches Kubernetes (--namespace)",
    )
    pd = parser.add_argument_group(
        "prefill/decode disaggregation, static mode (docs/disaggregation.md; with Kubernetes: "
        "spec.disaggregation and the pods' kvpilot.dev/kv-role label)"
    )
    pd.add_argument(
        "--prefill-endpoints",
        action="append",
        default=[],
        metavar="MODEL=URL[,URL...]",
        help="a model's prefill pods (repeatable; MODEL's --endpoints are then its decode pods): a "
        "prompt runs on a prefill pod first and its decode pod pulls the prompt's KV from there",
    )
    pd.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=None,
        help="prompts shorter than this many tokens (estimated at 4 characters a token) go straight to "
        f"a decode pod (default {DEFAULT_PD_MIN_PROMPT_TOKENS}; needs --prefill-endpoints)",
    )
    pd.add_argument(
        "--pd-transfer-timeout",
        type=float,
        default=None,
        help="seconds the prefill leg may wait for a prefill pod with room (its run may take this plus 4x "
        "what the prefill pool's measured speed gives the prompt); past it, or when it fails, the decode "
        "pod runs the whole request (default "
        f"{DEFAULT_KV_TRANSFER_TIMEOUT_S:g}; needs --prefill-endpoints)",
    )
    parser.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY, help="default routing policy")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--pod-capacity",
        type=int,
        default=64,
        help="requests a pod runs at once (its --max-num-seqs), static mode",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="requests held per model before 429")
    parser.add_argument(
        "--queue-timeout", type=float, default=30.0, help="seconds a request waits for a free pod"
    )
    parser.add_argument(
        "--cold-start-timeout",
        type=float,
        default=300.0,
        help="seconds a request waits for a model with no Ready pod (scale from zero)",
    )
    parser.add_argument("--max-retries", type=int, default=2, help="other pods tried before the first byte")
    flow = parser.add_argument_group("flow control (docs/router.md, Flow control)")
    flow.add_argument(
        "--max-queue-per-priority",
        action="append",
        default=[],
        metavar="CLASS=N[,CLASS=N...]",
        help=f"a priority class's own bound on queued requests ({', '.join(PRIORITIES)}); more get 429 "
        "queue_full (default: --max-queue alone)",
    )
    flow.add_argument(
        "--queue-timeout-per-priority",
        action="append",
        default=[],
        metavar="CLASS=SECONDS[,CLASS=SECONDS...]",
        help="a priority class's time to live in the queue (default: --queue-timeout); a client may "
        "ask for less with the X-Kvpilot-Queue-Timeout header",
    )
    flow.add_argument(
        "--tenant-header",
        default=None,
        help="fair queueing between tenants named by this header (Authorization: by API key): each "
        "priority class serves its tenants in turn (default: off, one FIFO per class)",
    )
    flow.add_argument(
        "--max-queue-per-tenant",
        type=int,
        default=None,
        help="requests one tenant may hold in a model's queue (needs --tenant-header); more get 429 "
        "tenant_queue_full",
    )
    slo = parser.add_argument_group("the measured SLO (docs/router.md, Measured SLO)")
    slo.add_argument(
        "--slo-ttft-seconds",
        type=float,
        default=DEFAULT_TTFT_S,
        help="TTFT target of models whose InferenceModel sets no spec.autoscaling.slo",
    )
    slo.add_argument(
        "--slo-tpot-seconds",
        type=float,
        default=DEFAULT_TPOT_S,
        help="TPOT target of models whose InferenceModel sets no spec.autoscaling.slo",
    )
    slo.add_argument(
        "--slo-window",
        type=float,
        default=300.0,
        help="seconds of requests behind the attainment and quantile gauges",
    )
    parser.add_argument(
        "--stream-migration",
        choices=("on", "off"),
        default="on",
        help="continue a plain stream (n=1, not guided) on another pod when its pod dies mid-stream",
    )
    deadlines = parser.add_argument_group(
        "deadlines to the pods (docs/router.md, Deadlines and outlier ejection)"
    )
    deadlines.add_argument(
        "--connect-timeout", type=float, default=5.0, help="seconds to open a connection to a pod"
    )
    deadlines.add_argument(
        "--first-byte-timeout",
        type=float,
        default=10.0,
        help="seconds to a pod's response headers (a stream's come at once, a whole answer's at its "
        "end); past it the pod must answer GET /health within --probe-timeout or the request is retried "
        "on another pod, and one that answers gets another period",
    )
    deadlines.add_argument(
        "--idle-timeout",
        type=float,
        default=10.0,
        help="seconds between two chunks of a pod's answer, with the same health probe; a stream whose "
        "pod failed it ends with an error event",
    )
    deadlines.add_argument(
        "--probe-timeout",
        type=float,
        default=2.0,
        help="seconds a pod past one of those deadlines has to answer GET /health",
    )
    deadlines.add_argument(
        "--silence-limit",
        type=float,
        default=600.0,
        help="the longest a pod that passes its probes may send nothing (response headers, next chunk)",
    )
    ejection = parser.add_argument_group("outlier ejection")
    ejection.add_argument(
        "--eject-after",
        type=int,
        default=3,
        help="failures in a row (connection errors, missed deadlines, 5xx) that take a pod out of routing",
    )
    ejection.add_argument(
        "--ejection-base",
        type=float,
        default=10.0,
        help="seconds a pod stays out, times the number of its ejections in a row",
    )
    ejection.add_argument(
        "--ejection-max", type=float, default=300.0, help="the longest a pod stays out (seconds)"
    )
    ejection.add_argument(
        "--max-ejection-percent",
        type=float,
        default=50.0,
        help="the most of a model's pods out at once (at least one, never the last); 0 turns ejection off",
    )
    parser.add_argument(
        "--fallback",
        action="append",
        default=[],
        metavar="MODEL=OTHER",
        help="OTHER takes MODEL's requests instead of a 429 when it has room (repeatable; "
        "spec.routing.fallbackModel with Kubernetes)",
    )
    parser.add_argument(
        "--adapters",
        action="append",
        default=[],
        metavar="MODEL=ADAPTER[,ADAPTER...]",
        help="LoRA adapters MODEL's pods serve (their --lora-modules names; repeatable; static mode, "
        "spec.adapters with Kubernetes): a request naming one goes to MODEL's pods",
    )
    parser.add_argument(
        "--adapter-slots",
        type=int,
        default=4,
        help="adapters a pod is taken to hold (the runtime's --max-loras): the last ones sent to it",
    )
    parser.add_argument(
        "--adapter-affinity-eps",
        type=float,
        default=0.25,
        help="an adapter sticks to the pods holding it while within (1+eps) x average load",
    )
    parser.add_argument("--session-header", default="X-Session-ID", help="header that keys prefix affinity")
    parser.add_argument(
        "--priority-header",
        default="X-Kvpilot-Priority",
        help="header naming a request's class in the central queue: high, normal (default) or low",
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=2.0, help="seconds between pod /metrics scrapes; 0 disables"
    )
    parser.add_argument(
        "--prefix-affinity-eps", type=float, default=0.25, help="bounded-load slack (1+eps) x avg"
    )
    parser.add_argument(
        "--namespace", default=None, help="Kubernetes namespace to watch (without --endpoints)"
    )
    parser.add_argument("--kubeconfig", default=None)
    parser.add_argument("--log-level", default="info")


def parse_class_values(flag: str, specs: list[str], kind: type[int] | type[float]) -> dict[str, float]:
    """`CLASS=VALUE[,CLASS=VALUE...]` (repeatable) -> {class: value}; ValueError naming the flag."""
    out: dict[str, float] = {}
    for spec in specs:
        for item in spec.split(","):
            name, sep, value = item.partition("=")
            name = name.strip().lower()
            try:
                number = kind(value)
            except ValueError:
                number = 0
            if not sep or name not in PRIORITIES or not number > 0:
                raise ValueError(
                    f"{flag} {item!r}: expected CLASS=VALUE with CLASS one of {', '.join(PRIORITIES)} "
                    "and VALUE > 0"
                )
            out[name] = number
    return out


def build_router(args: argparse.Namespace) -> Router:
    """The router the flags describe; raises ValueError naming a bad flag."""
    from kvpilot.router.discovery import (
        StaticSource,
        add_prefill_endpoints,
        parse_adapters,
        parse_endpoints,
    )

    for flag, value in (("--pod-capacity", args.pod_capacity), ("--max-queue", args.max_queue)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, fvalue in (
        ("--queue-timeout", args.queue_timeout),
        ("--cold-start-timeout", args.cold_start_timeout),
    ):
        if fvalue <= 0:
            raise ValueError(f"{flag} must be > 0, got {fvalue}")
    if args.max_retries < 0 or args.scrape_interval < 0 or args.prefix_affinity_eps < 0:
        raise ValueError("--max-retries, --scrape-interval and --prefix-affinity-eps must be >= 0")
    for flag, fvalue in (
        ("--connect-timeout", args.connect_timeout),
        ("--first-byte-timeout", args.first_byte_timeout),
        ("--idle-timeout", args.idle_timeout),
        ("--probe-timeout", args.probe_timeout),
        ("--ejection-base", args.ejection_base),
    ):
        if not fvalue > 0:
            raise ValueError(f"{flag} must be > 0, got {fvalue}")
    if not args.silence_limit >= max(args.first_byte_timeout, args.idle_timeout):
        raise ValueError(
            f"--silence-limit ({args.silence_limit:g}) must be >= --first-byte-timeout and --idle-timeout"
        )
    if args.eject_after < 1:
        raise ValueError(f"--eject-after must be >= 1, got {args.eject_after}")
    if not args.ejection_max >= args.ejection_base:
        raise ValueError(
            f"--ejection-max ({args.ejection_max:g}) must be >= --ejection-base ({args.ejection_base:g})"
        )
    if not 0 <= args.max_ejection_percent <= 100:
        raise ValueError(f"--max-ejection-percent must be in 0..100, got {args.max_ejection_percent:g}")
    if args.adapter_slots < 1:
        raise ValueError(f"--adapter-slots must be >= 1, got {args.adapter_slots}")
    if args.adapter_affinity_eps < 0:
        raise ValueError(f"--adapter-affinity-eps must be >= 0, got {args.adapter_affinity_eps}")
    if args.adapters and not args.endpoints:
        raise ValueError("--adapters needs --endpoints (with Kubernetes the adapters are spec.adapters)")
    class_max = parse_class_values("--max-queue-per-priority", args.max_queue_per_priority, int)
    class_ttl = parse_class_values("--queue-timeout-per-priority", args.queue_timeout_per_priority, float)
    if args.max_queue_per_tenant is not None:
        if args.max_queue_per_tenant < 1:
            raise ValueError(f"--max-queue-per-tenant must be >= 1, got {args.max_queue_per_tenant}")
        if not args.tenant_header:
            raise ValueError("--max-queue-per-tenant needs --tenant-header (what names a tenant)")
    for flag, fvalue in (
        ("--slo-ttft-seconds", args.slo_ttft_seconds),
        ("--slo-tpot-seconds", args.slo_tpot_seconds),
        ("--slo-window", args.slo_window),
    ):
        if not 0 < fvalue < float("inf"):
            raise ValueError(f"{flag} must be > 0, got {fvalue:g}")
    endpoints = parse_endpoints(args.endpoints, args.pod_capacity) if args.endpoints else {}
    adapters = parse_adapters(args.adapters, list(endpoints))
    pd = pd_settings(args)
    if args.prefill_endpoints:
        endpoints = add_prefill_endpoints(endpoints, args.prefill_endpoints, args.pod_capacity)
    disaggregated = {m: pd for m, eps in endpoints.items() if any(e.role == "prefill" for e in eps)}
    options = {"eps": args.prefix_affinity_eps} if args.policy == "prefix-affinity" else {}
    fallbacks: dict[str, str] = {}
    for spec in args.fallback:
        model, sep, other = spec.partition("=")
        if not sep or not model or not other or model == other:
            raise ValueError(f"--fallback {spec!r}: expected MODEL=OTHER with two different models")
        fallbacks[model] = other
    settings = RouterSettings(
        policy=args.policy,
        policy_options=options,
        queue=QueueSettings(
            max_queue=args.max_queue,
            queue_timeout_s=args.queue_timeout,
            cold_start_timeout_s=args.cold_start_timeout,
            class_max_queue={k: int(v) for k, v in class_max.items()},
            class_timeout_s=class_ttl,
            max_queue_per_tenant=args.max_queue_per_tenant,
        ),
        tenant_header=args.tenant_header or None,
        slo=SloTargets(ttft_s=args.slo_ttft_seconds, tpot_s=args.slo_tpot_seconds),
        slo_window_s=args.slo_window,
        migrate_streams=args.stream_migration == "on",
        max_retries=args.max_retries,
        fallbacks=fallbacks,
        adapters=adapters,
        adapter_eps=args.adapter_affinity_eps,
        adapter_slots=args.adapter_slots,
        session_header=args.session_header,
        priority_header=args.priority_header,
        scrape_interval_s=args.scrape_interval,
        connect_timeout_s=args.connect_timeout,
        first_byte_timeout_s=args.first_byte_timeout,
        idle_timeout_s=args.idle_timeout,
        probe_timeout_s=args.probe_timeout,
        silence_limit_s=args.silence_limit,
        outliers=OutlierSettings(
            consecutive_failures=args.eject_after,
            base_ejection_s=args.ejection_base,
            max_ejection_s=args.ejection_max,
            max_ejection_percent=args.max_ejection_percent,
        ),
    )
    router = Router(settings)
    if args.endpoints:
        if args.namespace:
            raise ValueError("--endpoints and --namespace exclude each other")
        for model, other in fallbacks.items():
            for name in (model, other):
                if name not in endpoints:
                    raise ValueError(f"--fallback {model}={other}: {name!r} is not a model of --endpoints")
        router.add_source(StaticSource(endpoints, disaggregation=disaggregated))
    else:
        from kvpilot.router.kube_discovery import kube_source

        router.add_source(kube_source(args.namespace, args.kubeconfig))
    return router


def pd_settings(args: argparse.Namespace) -> PdSettings:
    """The static disaggregated models' settings; ValueError naming a flag that is out of range or
    given without --prefill-endpoints (it would do nothing)."""
    for flag, value in (
        ("--pd-min-prompt-tokens", args.pd_min_prompt_tokens),
        ("--pd-transfer-timeout", args.pd_transfer_timeout),
    ):
        if value is not None and not args.prefill_endpoints:
            raise ValueError(f"{flag} needs --prefill-endpoints (with Kubernetes: spec.disaggregation)")
    if args.prefill_endpoints and not args.endpoints:
        raise ValueError("--prefill-endpoints needs --endpoints (the model's decode pods)")
    tokens = DEFAULT_PD_MIN_PROMPT_TOKENS if args.pd_min_prompt_tokens is None else args.pd_min_prompt_tokens
    timeout = DEFAULT_KV_TRANSFER_TIMEOUT_S if args.pd_transfer_timeout is None else args.pd_transfer_timeout
    if tokens < 0:
        raise ValueError(f"--pd-min-prompt-tokens must be >= 0, got {tokens}")
    if not 0 < timeout < float("inf"):
        raise ValueError(f"--pd-transfer-timeout must be > 0, got {timeout:g}")
    return PdSettings(tokens, timeout)


async def serve(router: Router, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(router.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("kvpilot router listening on http://%s:%d/v1", host, port)
        await stop.wait()
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        router = build_router(args)
    except ValueError as e:
        print(f"kvpilot router: error: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(router, args.host, args.port))
    return 0
