"""Service-level objectives, as the serving anchors (Dynamo's planner, Mooncake, DistServe) define them,
and what one replica can serve while meeting them. Pure functions over a Calibration.

A request meets the SLO when
    TTFT <= ttft_target(prompt) = ttft_s + ttft_prefill_factor x solo_prefill_s(prompt)
    TPOT <= tpot_s          (time per output token after the first: (finish - first token) / (out - 1))
and a rejected request misses. Attainment = the share of requests that meet both.

Why the TTFT target grows with the prompt: a 40k-token prompt takes ~1.6 s to prefill on an idle
H100 for an 8B model, so a fixed 2 s target would judge the fleet on work no fleet size can speed up
(one replica prefills one prompt; adding replicas does not shorten it). The target adds the prompt's
own prefill time on an idle replica (the floor), times a factor (default 2, leaving the same room for
queueing and batching as for the computation itself) to the base target; for the short prompts of
chat traffic the base dominates. Set the factor to 0 for a fixed target. Mooncake and DistServe
scale their SLOs on the same single-request baseline.

`replica_capacity` is the throughput planner's number (Dynamo's idea): the request rate one replica
sustains for a given token mix with its mean step (what a decoding sequence sees, prefill chunks
included) within the TPOT target and a prompt's prefill plus its queueing within the TTFT target,
from the step-time model (see _fits), and with the TPOT tail of short outputs within a budget (see
tpot_tail_share): a request that generates a few tokens misses its TPOT target when one prefill burst
lands among its few decode steps, however short the mean step.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpilot.api.models import DEFAULT_TPOT_S, DEFAULT_TTFT_PREFILL_FACTOR, DEFAULT_TTFT_S
from kvpilot.api.slo import SloTargets as JudgeTargets
from kvpilot.autoscaler.calibration import Calibration


@dataclass(frozen=True)
class Slo:
    """The targets of spec.autoscaling.slo. Requests are judged by kvpilot.api.slo.judge (the router's
    judgement) with `judge_targets(cal)`: the prefill floor's terms fitted to this calibration."""

    ttft_s: float = DEFAULT_TTFT_S
    tpot_s: float = DEFAULT_TPOT_S
    ttft_prefill_factor: float = DEFAULT_TTFT_PREFILL_FACTOR

    def __post_init__(self) -> None:
        if not self.ttft_s > 0 or not self.tpot_s > 0 or self.ttft_prefill_factor < 0:
            raise ValueError("SLO: ttft_s and tpot_s must be > 0, ttft_prefill_factor >= 0")

    def judge_targets(self, cal: Calibration) -> JudgeTargets:
        """What api/slo.judge needs, the prefill terms from the calibration (prefill_terms)."""
        per_token, per_token_sq = prefill_terms(cal) if self.ttft_prefill_factor > 0 else (0.0, 0.0)
        return JudgeTargets(self.ttft_s, self.tpot_s, self.ttft_prefill_factor, per_token, per_token_sq)

    def ttft_target(self, prompt_tokens: int, cal: Calibration) -> float:
        return self.judge_targets(cal).ttft_target(prompt_tokens)


def solo_prefill_s(cal: Calibration, prompt_tokens: int) -> float:
    """Time to the first token of this prompt on an idle replica: chunked prefill, chunk by chunk."""
    t, done = 0.0, 0
    while done < prompt_tokens:
        n = min(cal.max_num_batched_tokens, prompt_tokens - done)
        t += cal.step_seconds(0, n, done + n, n * (done + (n + 1) / 2.0))
        done += n
    return t


# The prompt lengths the prefill fit is made over: log-spaced from 256 tokens to the KV pool (at most
# 128k), every point weighted by its relative error.
_FIT_MIN_TOKENS = 256
_FIT_MAX_TOKENS = 131072
_FIT_POINTS = 40


@functools.lru_cache(maxsize=256)
def prefill_terms(cal: Calibration) -> tuple[float, float]:
    """(seconds per prompt token, seconds per prompt token squared), both >= 0: the least-squares fit
    of a x n + b x n^2 to solo_prefill_s(cal, n) in relative error over the prompt range above. The
    router cannot run the step-time model, so the autoscaler publishes these two numbers in
    status.autoscaler.slo and everything (router, simulator, planner) judges TTFT with them. The
    chunked prefill's fixed per-step cost is not linear in n; on the calibrations shipped the fit is
    within a few percent of solo_prefill_s from 1k tokens up (tests/autoscaler/test_slo_planner.py)."""
    top = max(_FIT_MIN_TOKENS * 2, min(_FIT_MAX_TOKENS, cal.kv_capacity_tokens))
    ratio = (top / _FIT_MIN_TOKENS) ** (1.0 / (_FIT_POINTS - 1))
    grid = sorted({round(_FIT_MIN_TOKENS * ratio**i) for i in range(_FIT_POINTS)})
    # Minimise sum ((a n + b n^2 - y) / y)^2: normal equations in x1 = n / y, x2 = n^2 / y.
    s11 = s12 = s22 = t1 = t2 = 0.0
    for n in grid:
        y = solo_prefill_s(cal, n)
        if y <= 0:
            continue
        x1, x2 = n / y, n * n / y
        s11, s12, s22 = s11 + x1 * x1, s12 + x1 * x2, s22 + x2 * x2
        t1, t2 = t1 + x1, t2 + x2
    det = s11 * s22 - s12 * s12
    if s11 <= 0:
        return 0.0, 0.0
    a, b = ((t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det) if det > 0 else (t1 / s11, 0.0)
    if b < 0:
        a, b = t1 / s11, 0.0
    if a < 0:
        a, b = 0.0, (t2 / s22 if s22 > 0 else 0.0)
    return max(0.0, a), max(0.0, b)


P99_WAIT_FACTOR = 4.6  # ln(100): the 99th percentile of an exponential-tailed wait over its mean
# Squared coefficient of variation of prefill times: prompt lengths vary about as much as an
# exponential's (1); the Mooncake and chat traces' prompts do (a 40k prompt behind a 2k one).
PREFILL_CV2 = 1.0


# Output lengths: cumulative shares P(output <= tokens) at increasing token counts, ((tokens, share), ...).
OutputCdf = tuple[tuple[int, float], ...]
# Share of requests the TPOT tail may cost (half of a 99% goal's 1%; TTFT misses use the rest).
DEFAULT_TPOT_TAIL_BUDGET = 0.005
_TAIL_MAX_OUTPUT = 4096  # outputs longer than this are not looked at (their miss chance is ~0)


def output_share_at_most(mean_output: float, cdf: OutputCdf | None) -> Callable[[int], float]:
    """P(output <= o) as a function of o: from `cdf` (linear between its points, from (0, 0); past
    its last point the share stays at its last value, so longer outputs are not counted), or, when
    no distribution is known, geometric with the observed mean (the maximum-entropy guess from the
    mean alone; it underestimates the short share of bimodal traffic: Mooncake's is 21% at <= 8
    tokens against the geometric 5%)."""
    if cdf is None:
        p = 1.0 / max(1.0, mean_output)
        return lambda o: 1.0 - (1.0 - p) ** o
    points = ((0, 0.0), *cdf)
    for (a, fa), (b, fb) in itertools.pairwise(points):
        if not (b > a and 0.0 <= fa <= fb <= 1.0):
            raise ValueError(f"output CDF must rise in tokens and share within [0, 1]: {cdf!r}")

    def share(o: int) -> float:
        for (a, fa), (b, fb) in itertools.pairwise(points):
            if o <= b:
                return fa + (fb - fa) * (o - a) / (b - a)
        return points[-1][1]

    return share


# The measured output-length distribution is used once this many generations have finished.
MIN_OUTPUT_CDF_REQUESTS = 200


def output_cdf_from_buckets(
    buckets: Iterable[tuple[float, float]], min_requests: float = MIN_OUTPUT_CDF_REQUESTS
) -> OutputCdf | None:
    """The output-length distribution from a Prometheus histogram of generated tokens per request
    (cumulative (le, count) pairs, e.g. kvpilot_request_generation_tokens summed over the replicas):
    ((tokens, P(output <= tokens)), ...) at its finite bucket bounds of at least 1 token, shares
    rounded to 3 decimals (so the capacity's memo hits from sync to sync). None with fewer than
    `min_requests` observations (the +Inf bucket, else the largest count) or no finite bucket."""
    counts: dict[float, float] = {}
    for le, count in buckets:
        if math.isnan(le) or not math.isfinite(count) or count < 0:
            continue
        counts[le] = counts.get(le, 0.0) + count
    if not counts:
        return None
    total = counts.get(math.inf, max(counts.values()))
    if total < min_requests or total <= 0:
        return None
    out: list[tuple[int, float]] = []
    running = 0.0
    for le in sorted(k for k in counts if math.isfinite(k) and k >= 1):
        tokens = int(le)
        running = max(running, min(1.0, round(counts[le] / total, 3)))  # cumulative: never down
        if out and out[-1][0] == tokens:
            out[-1] = (tokens, running)
        else:
            out.append((tokens, running))
    return tuple(out) or None


def _poisson_at_least(k: int, mean: float) -> float:
    """P(N >= k) for N ~ Poisson(mean)."""
    if k <= 0:
        return 1.0
    term = math.exp(-mean)
    below = term
    for i in range(1, k):
        term *= mean / i
        below += term
    return max(0.0, 1.0 - below)


def tpot_tail_share(
    prefill_step_share: float,
    burst_steps: float,
    prefill_step_s: float,
    decode_step_s: float,
    tpot_s: float,
    share_at_most: Callable[[int], float],
) -> float:
    """Share of requests whose TPOT misses the target because prefill steps land among their decode
    steps. A request with o output tokens waits o - 1 steps after its first token; it misses when k
    of them are prefill steps with (k x prefill_step_s + (o - 1 - k) x decode_step_s) / (o - 1) >
    tpot_s. Prefill steps come in bursts of `burst_steps` (a prompt's chunks, back to back), so the
    bursts in a window of w steps are Poisson with mean w x prefill_step_share / burst_steps and k
    prefill steps take ceil(k / burst_steps) bursts. Summed over the output-length distribution.
    0 when a prefill step is within the target (then only the mean step matters)."""
    if prefill_step_s <= tpot_s or prefill_step_share <= 0.0:
        return 0.0
    burst = max(1.0, burst_steps)
    ratio = (tpot_s - decode_step_s) / (prefill_step_s - decode_step_s)
    total, below = 0.0, share_at_most(1)
    for o in range(2, _TAIL_MAX_OUTPUT + 1):
        at = share_at_most(o)
        p_o, below = at - below, at
        w = o - 1
        k = math.floor(w * ratio) + 1  # prefill steps in the window that make it miss
        if k > w:
            continue
        miss = _poisson_at_least(math.ceil(k / burst - 1e-9), w * prefill_step_share / burst)
        total += p_o * miss
        if miss < 1e-7 and o > 64:
            break
    return total


def _fits(
    cal: Calibration,
    slo: Slo,
    rate: float,
    prompt: float,
    output: float,
    limit: float,
    tail_budget: float | None = None,
    output_cdf: OutputCdf | None = None,
) -> bool:
    """Whether one replica serves `rate` requests/s of this mix within the SLO.

    The engine runs prefill steps (a chunk of C = min(max_num_batched_tokens, prompt) prompt tokens,
    the decoding batch riding along) and decode-only steps. Per second: n_p = rate x prompt / C
    prefill steps of s_p seconds, and the rest of the second in decode steps of s_d, so a decoding
    sequence sees a mean step (its TPOT) of 1 / (n_p + n_d). The batch follows Little's law,
    B = rate x output x mean step (a fixed point, iterated). Holds when the mean step is within
    `limit`, the batch and KV pool hold B, and the prefill queue (M/G/1 at utilization
    rho = n_p x s_p, Pollaczek-Khinchine mean wait rho x S x (1 + cv^2) / (2 (1 - rho)) with
    cv^2 = PREFILL_CV2, its 99th percentile taken as P99_WAIT_FACTOR x the mean) leaves the
    prompt's TTFT within its target. With `tail_budget`, the TPOT tail of short outputs
    (tpot_tail_share, prefill steps being n_p / (n_p + n_d) of all steps, in bursts of prompt / C)
    must also stay within that share of requests."""
    ctx = prompt + output / 2.0
    chunk = min(float(cal.max_num_batched_tokens), prompt)
    n_p = rate * prompt / chunk
    batch = 0.0
    mean_step = limit
    for _ in range(40):
        s_p = cal.step_seconds(batch, chunk, batch * ctx + prompt / 2.0, chunk * prompt / 2.0)
        s_d = cal.step_seconds(max(batch, 1.0), 0, max(batch, 1.0) * ctx, max(batch, 1.0) * ctx)
        rho = n_p * s_p
        if rho >= 1.0:
            return False
        n_d = (1.0 - rho) / s_d
        new = 1.0 / (n_p + n_d)
        batch = rate * output * new
        if abs(new - mean_step) <= 1e-9:
            break
        mean_step = new
    if mean_step > limit or batch > cal.max_num_seqs or batch * (prompt + output) > cal.kv_capacity_tokens:
        return False
    service = prompt / chunk * s_p  # the prompt's own prefill, at this load
    wait_p99 = P99_WAIT_FACTOR * rho * service * (1.0 + PREFILL_CV2) / (2.0 * (1.0 - rho))
    if wait_p99 + service > slo.ttft_target(int(prompt), cal):
        return False
    if tail_budget is None:
        return True
    tail = tpot_tail_share(
        n_p / (n_p + n_d), prompt / chunk, s_p, s_d, slo.tpot_s, output_share_at_most(output, output_cdf)
    )
    return tail <= tail_budget


def replica_capacity(
    cal: Calibration,
    slo: Slo,
    mean_prompt: float,
    mean_output: float,
    utilization: float = 0.85,
    tail_budget: float | None = None,
    output_cdf: OutputCdf | None = None,
) -> float:
    """Requests/s one replica serves at this token mix with steps within slo.tpot_s x utilization
    (the rest is headroom for bursts within a sync interval) and, with `tail_budget`, at most that
    share of requests missing TPOT through prefill steps among their decode steps (output lengths
    from `output_cdf`, or geometric with mean_output). 0 when even one request misses."""
    prompt = max(1.0, mean_prompt)
    output = max(1.0, mean_output)
    limit = slo.tpot_s * utilization
    if solo_prefill_s(cal, int(prompt)) > slo.ttft_target(int(prompt), cal):
        return 0.0

    def ok(rate: float) -> bool:
        return _fits(cal, slo, rate, prompt, output, limit, tail_budget, output_cdf)

    lo, hi = 0.0, 1.0
    if not ok(1e-6):
        return 0.0
    while ok(hi) and hi < 1e6:
        lo, hi = hi, hi * 2.0
    for _ in range(40):
        mid = (lo + hi) / 2.0
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def replicas_needed(rate: float, capacity: float) -> int:
    """ceil(rate / capacity), 0 for no traffic; a capacity of 0 needs as many as there are (inf)."""
    if rate <= 0:
        return 0
    if capacity <= 0:
        return 1 << 30
    return math.ceil(rate / capacity - 1e-9)
