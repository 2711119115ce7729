"""The metric names a model server's /metrics page carries and the control plane reads: the contract
between a pod (kvpilot's runtime, or vLLM) and the router and autoscaler. The runtime registers its
metrics under the `kvpilot` names below (runtime/serving/metrics.py), the router reads a pod's load
with them (router/load.py) and the autoscaler scrapes or queries them (autoscaler/sources.py).
docs/runtime.md's metrics table is the full list a pod exposes; this module holds the ones read by
other parts, each with the vLLM names that mean the same (so the fleet works with vLLM pods too).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PodMetric:
    """One signal: kvpilot's name and vLLM's equivalents, in order of preference (the first family a
    pod exports wins). Counters carry `_total`; histograms are named without `_bucket`."""

    kvpilot: str
    vllm: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return (self.kvpilot, *self.vllm)

    @property
    def buckets(self) -> tuple[str, ...]:
        """A histogram's bucket series names."""
        return tuple(f"{n}_bucket" for n in self.names)

    @property
    def sums(self) -> tuple[str, ...]:
        """A histogram's sum series names."""
        return tuple(f"{n}_sum" for n in self.names)

    @property
    def counts(self) -> tuple[str, ...]:
        """A histogram's count series names."""
        return tuple(f"{n}_count" for n in self.names)

    @property
    def counter_base(self) -> str:
        """kvpilot's name as prometheus_client registers a counter (it appends `_total` itself)."""
        return self.kvpilot.removesuffix("_total")


KV_CACHE_USAGE = PodMetric(
    "kvpilot_kv_cache_usage_ratio", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
)
REQUESTS_WAITING = PodMetric("kvpilot_num_requests_waiting", ("vllm:num_requests_waiting",))
REQUESTS_RUNNING = PodMetric("kvpilot_num_requests_running", ("vllm:num_requests_running",))
# finished requests (one series per finish reason; summed)
REQUEST_SUCCESS = PodMetric("kvpilot_request_success_total", ("vllm:request_success_total",))
PROMPT_TOKENS = PodMetric("kvpilot_prompt_tokens_total", ("vllm:prompt_tokens_total",))
GENERATION_TOKENS = PodMetric("kvpilot_generation_tokens_total", ("vllm:generation_tokens_total",))
# histograms: prompt and output length per finished request (observed when it finishes: their sums over
# their count are the token mix of the requests finished, which the token counters above, counted as
# prompts arrive and tokens stream, are not while the load changes), and the latencies
REQUEST_PROMPT_TOKENS = PodMetric("kvpilot_request_prompt_tokens", ("vllm:request_prompt_tokens",))
REQUEST_GENERATION_TOKENS = PodMetric(
    "kvpilot_request_generation_tokens", ("vllm:request_generation_tokens",)
)
# prompt length per generation *admitted* (observed as it is submitted, one per choice): its sum over its
# count is the mix of the prompts arriving, which leads the finished requests' by a request's duration.
# vLLM has no such histogram (its prompt counter counts prefills done, not arrivals).
ADMITTED_PROMPT_TOKENS = PodMetric("kvpilot_admitted_prompt_tokens", ())
TIME_TO_FIRST_TOKEN = PodMetric("kvpilot_time_to_first_token_seconds", ("vllm:time_to_first_token_seconds",))
# vLLM renamed its inter-token histogram: vllm:inter_token_latency_seconds (0.32 exports only this),
# vllm:time_per_output_token_seconds before.
INTER_TOKEN_LATENCY = PodMetric(
    "kvpilot_inter_token_latency_seconds",
    ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
)
# Read by the dashboard and the alert rules (deploy/), which show both engines' pods.
REQUEST_QUEUE_TIME = PodMetric("kvpilot_request_queue_time_seconds", ("vllm:request_queue_time_seconds",))
E2E_REQUEST_LATENCY = PodMetric("kvpilot_e2e_request_latency_seconds", ("vllm:e2e_request_latency_seconds",))
PREFIX_CACHE_QUERIES = PodMetric("kvpilot_prefix_cache_queries_total", ("vllm:prefix_cache_queries_total",))
PREFIX_CACHE_HITS = PodMetric("kvpilot_prefix_cache_hits_total", ("vllm:prefix_cache_hits_total",))
PREEMPTIONS = PodMetric("kvpilot_num_preemptions_total", ("vllm:num_preemptions_total",))

TWINS = (
    KV_CACHE_USAGE,
    REQUESTS_WAITING,
    REQUESTS_RUNNING,
    REQUEST_SUCCESS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    REQUEST_QUEUE_TIME,
    E2E_REQUEST_LATENCY,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    PREEMPTIONS,
)
_BY_KVPILOT_NAME = {m.kvpilot: m for m in TWINS}


def names_of(kvpilot_name: str) -> tuple[str, ...]:
    """kvpilot's name and the vLLM names that mean the same, or the name alone when vLLM has no such
    metric (the engine watchdog's, say): what a query over both engines' pods reads."""
    twin = _BY_KVPILOT_NAME.get(kvpilot_name)
    return twin.names if twin is not None else (kvpilot_name,)


# prefill/decode disaggregation (docs/disaggregation.md): the KV transfer between a prefill and a decode
# pod, and each pod's role (`kvpilot_engine_info{kv_role}`, value 1). vLLM has no equivalents.
KV_TRANSFER_BYTES = PodMetric("kvpilot_kv_transfer_bytes_total", ())  # direction: sent | received
KV_TRANSFER_SECONDS = PodMetric("kvpilot_kv_transfer_seconds", ())  # histogram, decode side, one pull
KV_TRANSFER_FAILURES = PodMetric("kvpilot_kv_transfer_failures_total", ())  # reason
KV_TRANSFER_FALLBACKS = PodMetric("kvpilot_kv_transfer_fallbacks_total", ())  # reason; decode pod recomputed
KV_TRANSFERS_PENDING = PodMetric("kvpilot_kv_transfers_pending", ())  # prefill side, pinned transfers
ENGINE_INFO = PodMetric("kvpilot_engine_info", ())  # kv_role: prefill | decode | both
KV_ROLE_INFO_LABEL = "kv_role"

# The output-length histogram's bounds (tokens per finished generation): powers of two, the points the
# autoscaler's TPOT tail rule reads the distribution at (autoscaler/slo.output_share_at_most).
OUTPUT_TOKENS_BUCKETS = tuple(float(2**k) for k in range(16))  # 1 .. 32768
# The prompt-length histogram's (tokens per finished generation): powers of two to 128k tokens. The
# autoscaler reads only its sum and count (the token mix of the requests finished).
PROMPT_TOKENS_BUCKETS = tuple(float(2**k) for k in range(18))  # 1 .. 131072


def promql_any(names: tuple[str, ...], select: str, around: str = "{}") -> str:
    """`around` applied to each name's selected series, joined with `or` (the first family a pod
    exports wins): promql_any(("a", "b"), '{pod="x"}', "rate({}[1m])") is
    'rate(a{pod="x"}[1m]) or rate(b{pod="x"}[1m])'."""
    return " or ".join(around.replace("{}", n + select) for n in names)
