"""What a metric source reports: one sample per replica that answered, plus the ready count.

A ready replica without a sample is "not reporting"; the policy holds its share of the fleet instead
of reading the gap as zero load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.autoscaler.attainment import SloCounts


class MetricsParseError(ValueError):
    """A /metrics page that is not Prometheus text format."""


@dataclass(frozen=True)
class ReplicaSample:
    """Load of one replica at one moment."""

    pod: str
    kv_cache_usage: float  # 0..1, share of the KV block pool in use
    num_waiting: int  # requests queued, not yet admitted to the batch
    num_running: int = 0  # requests in the running batch (slot use, deletion cost, queue absorption)
    # Requests this replica has finished since its process started (a counter: kvpilot's
    # kvpilot_request_success_total, vLLM's vllm:request_success_total). The policy turns the
    # difference between two syncs, plus the change in waiting + running, into an arrival rate.
    completed_total: float | None = None
    # Or the completion rate itself (requests/s), when the source computes it (Prometheus rate()).
    # Preferred over completed_total when both are set.
    completion_rate: float | None = None
    # Prompt and generated tokens of the requests this replica has finished (the length histograms'
    # sums, kvpilot_request_prompt_tokens_sum / kvpilot_request_generation_tokens_sum or vLLM's
    # vllm:request_*_tokens_sum; else the token counters, kvpilot_prompt_tokens_total /
    # kvpilot_generation_tokens_total or vLLM's, which run ahead of finishing while the load changes):
    # the token mix the SLO planner sizes for. None when not exported.
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    # The generations behind those two where they are the length histograms' sums: the histograms'
    # count (kvpilot_request_prompt_tokens_count, vLLM's), which leaves aborted generations out where
    # completed_total counts them; None with the counters (the mix then divides by completed_total).
    finished_lengths_total: float | None = None
    # Generations this replica admitted and their prompt tokens (the count and sum of kvpilot's
    # kvpilot_admitted_prompt_tokens histogram, observed per choice as it is submitted): the prompts
    # arriving, which lead the finished ones above by a request's duration when the mix shifts. None
    # when not exported (vLLM has no such metric: its prompt counter counts prefills done).
    admitted_total: float | None = None
    admitted_prompt_tokens_total: float | None = None
    # The replica's histogram of generated tokens per finished request (kvpilot's
    # kvpilot_request_generation_tokens, vLLM's vllm:request_generation_tokens): cumulative
    # (le, count) pairs since the process started, +Inf included. None when not exported. The TPOT
    # tail rule (spec.autoscaling.slo.tpotTailBudget) reads the output-length distribution from it.
    output_tokens_buckets: tuple[tuple[float, float], ...] | None = None
    # Its latency histograms (cumulative (le, count) pairs, +Inf included): kvpilot's
    # kvpilot_time_to_first_token_seconds and kvpilot_inter_token_latency_seconds, vLLM's
    # time_to_first_token_seconds and inter_token_latency_seconds. The measured-attainment fallback
    # when no router reports the model (attainment.py: a bound). None when not exported.
    ttft_buckets: tuple[tuple[float, float], ...] | None = None
    itl_buckets: tuple[tuple[float, float], ...] | None = None
    # A P/D decode pod's KV pulls (docs/disaggregation.md): kvpilot_kv_transfer_seconds' sum and count
    # (one pull each, from its start to its blocks checked) and kvpilot_kv_transfer_bytes_total
    # {direction="received"}; counters since the process started, None when not exported.
    kv_transfer_seconds_total: float | None = None
    kv_transfers_total: float | None = None
    kv_transfer_bytes_total: float | None = None

    @property
    def load(self) -> float:
        """One number to rank replicas by for scale-down: in-flight requests, then KV use."""
        return (self.num_running + self.num_waiting) + self.kv_cache_usage


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything the policy knows about the fleet at one sync.

    ready_replicas counts pods that are Ready; samples holds those that answered. Pods still starting
    (spec replicas - ready) neither report nor count as idle.
    """

    ready_replicas: int
    samples: tuple[ReplicaSample, ...] = field(default_factory=tuple)
    # True when the operator's ScalingLimited condition says pods are Unschedulable.
    scaling_limited: bool = False
    # Requests held in `kvpilot router`'s central queue for this model (kvpilot_router_queue_depth),
    # None when no router serves the model or it did not answer. They wait as surely as a pod's queue,
    # and they are the only signal a model scaled to zero has.
    router_queue: int | None = None
    # Replica startup (pod created -> Ready), seconds: the median over the model's recent pods
    # (startup.pod_startup_seconds), None when no pod's is known. The policy plans one startup ahead.
    startup_s: float | None = None
    # The routers' kvpilot_router_slo_requests_total for this model, by outcome, summed over the router
    # replicas (cumulative counters); None when no router reports the model.
    router_slo: SloCounts | None = None

    @property
    def reporting(self) -> int:
        return len(self.samples)

    @property
    def missing(self) -> int:
        """Ready replicas that did not report."""
        return max(0, self.ready_replicas - len(self.samples))

    @property
    def total_waiting(self) -> int:
        """Requests waiting on the pods plus those held by the router."""
        return sum(s.num_waiting for s in self.samples) + (self.router_queue or 0)

    @property
    def output_tokens_buckets(self) -> tuple[tuple[float, float], ...]:
        """The replicas' output-length histograms summed bucket by bucket (cumulative (le, count));
        empty when none exports one."""
        total: dict[float, float] = {}
        for s in self.samples:
            for le, count in s.output_tokens_buckets or ():
                total[le] = total.get(le, 0.0) + count
        return tuple(sorted(total.items()))

    @property
    def avg_kv_cache_usage(self) -> float | None:
        if not self.samples:
            return None
        return sum(s.kv_cache_usage for s in self.samples) / len(self.samples)
