"""The router's settings (flags in cli.py, defaults here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.api.slo import SloTargets
from kvpilot.router.keys import BLOCK_CHARS
from kvpilot.router.outlier import OutlierSettings
from kvpilot.router.policy import DEFAULT_POLICY
from kvpilot.router.pool import QueueSettings

SESSION_HEADER = "X-Session-ID"
PRIORITY_HEADER = "X-Kvpilot-Priority"  # high | normal | low: the request's class in the central queue


@dataclass(frozen=True)
class RouterSettings:
    policy: str = DEFAULT_POLICY
    policy_options: dict[str, float] = field(default_factory=dict)
    queue: QueueSettings = field(default_factory=QueueSettings)
    max_retries: int = 2  # other pods tried after a refused/reset connection or a 503
    # model -> model that takes its requests instead of a 429 (static mode; spec.routing.fallbackModel)
    fallbacks: dict[str, str] = field(default_factory=dict)
    # model -> its LoRA adapters' names (static mode; spec.adapters with Kubernetes)
    adapters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    adapter_eps: float = 0.25  # an adapter's holder keeps it while within ceil((1 + eps) x avg load)
    adapter_slots: int = 4  # adapters remembered per pod (the runtime's --max-loras default)
    session_header: str = SESSION_HEADER
    priority_header: str = PRIORITY_HEADER
    tenant_header: str | None = (
        None  # fairness between tenants named by this header (Authorization: API keys)
    )
    block_chars: int = BLOCK_CHARS
    scrape_interval_s: float = 2.0  # pods' /metrics for KV use and waiting counts; 0 turns it off
    # Deadlines of a request to a pod (docs/router.md, "Deadlines and outlier ejection"):
    connect_timeout_s: float = 5.0  # the TCP connection
    first_byte_timeout_s: float = 10.0  # the response headers, from sending the request
    idle_timeout_s: float = 10.0  # between two chunks of the response body
    probe_timeout_s: float = 2.0  # a pod past one of those two deadlines must answer GET /health by then
    silence_limit_s: float = 600.0  # the most a pod that answers its probes may stay silent
    outliers: OutlierSettings = field(default_factory=OutlierSettings)
    # The SLO (docs/router.md, "Measured SLO"): targets of models that name none, the window of the
    # attainment and quantile gauges, the weight of a new sample in a pod's latency averages
    slo: SloTargets = field(default_factory=SloTargets)
    slo_window_s: float = 300.0
    latency_alpha: float = 0.2
    migrate_streams: bool = True  # continue a plain stream on another pod when its pod dies
