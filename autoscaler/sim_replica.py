"""The fleet simulator's replica: one continuous-batching engine on a calibrated cost model, stepped by
the simulator's event loop (simulator.py has the whole story), and the views routers get of requests
and replicas.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvpilot.api.pod_metrics import OUTPUT_TOKENS_BUCKETS
from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.samples import ReplicaSample
from kvpilot.autoscaler.trace import HASH_BLOCK_TOKENS


@dataclass(frozen=True)
class RequestView:
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplicaView:
    """One Ready, non-draining replica as a router sees it."""

    replica_id: int
    waiting: int  # queued on the replica, not yet in the batch
    running: int  # in the batch
    max_num_seqs: int
    free_kv_tokens: int  # free KV minus what its waiting requests' prompts will take
    kv_capacity_tokens: int
    prefix_hit_tokens: int  # of this request's prompt, cached on this replica

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running


@dataclass(eq=False)
class SimRequest:
    arrival: float
    prompt: int
    output: int
    hash_ids: tuple[int, ...] = ()
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    generated: int = 0
    computed: int = 0  # tokens whose KV is in the cache
    prefill_target: int = 0  # tokens to have computed before the next token comes out
    blocks: int = 0
    first_token: float | None = None
    finish: float | None = None
    rejected: bool = False
    preemptions: int = 0


@dataclass(eq=False)
class Replica:
    rid: int
    cal: Calibration
    created: float
    ready_at: float
    free_blocks: int
    ready: bool = False
    draining: bool = False
    gone_at: float | None = None
    # There at the start, Ready at once: a pod started before the trace, whose creation and Ready
    # times still give the controller its startup (Replica.startup_s)
    started_ready: bool = False
    role: str = "both"  # "prefill" or "decode" in a P/D fleet (pd_simulator.py)
    waiting: deque[SimRequest] = field(default_factory=deque)
    running: list[SimRequest] = field(default_factory=list)
    # The step (or jump of `jump` decode steps) in progress.
    busy: bool = False
    step_start: float = 0.0
    step_dur: float = 0.0
    jump: int = 0  # > 0: a decode-only jump of this many steps; 0: one mixed step (`batch`)
    batch: list[tuple[SimRequest, int]] = field(default_factory=list)
    version: int = 0
    preemptions: int = 0
    completed: int = 0  # requests finished: the runtime's request_success counter
    prompt_tokens_done: int = 0  # prompt and output tokens of the finished requests (counters)
    output_tokens_done: int = 0
    # Requests routed to it and their prompt tokens, counted as they arrive: the runtime's
    # kvpilot_admitted_prompt_tokens histogram's count and sum (a preempted request is not counted again).
    admitted: int = 0
    admitted_prompt_tokens: int = 0
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)  # prompt block ids, LRU first
    waiting_tokens: int = 0  # prompt tokens of the waiting requests (for routers' free-KV view)
    # Finished requests per output-length bucket (OUTPUT_TOKENS_BUCKETS), as the runtime's
    # kvpilot_request_generation_tokens histogram counts them.
    output_hist: list[int] = field(default_factory=lambda: [0] * (len(OUTPUT_TOKENS_BUCKETS) + 1))

    @property
    def startup_s(self) -> float:
        """Creation -> Ready as the controller reads it from the pod: a pod there at the start
        started before the trace, as long as any other (the calibration's startup)."""
        return self.cal.startup_s if self.started_ready else self.ready_at - self.created

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.cal.num_kv_blocks

    def sample(self) -> ReplicaSample:
        return ReplicaSample(
            f"r{self.rid}",
            self.kv_usage,
            len(self.waiting),
            len(self.running),
            float(self.completed),
            prompt_tokens_total=float(self.prompt_tokens_done),
            generation_tokens_total=float(self.output_tokens_done),
            admitted_total=float(self.admitted),
            admitted_prompt_tokens_total=float(self.admitted_prompt_tokens),
            output_tokens_buckets=self._buckets(),
        )

    def _buckets(self) -> tuple[tuple[float, float], ...]:
        cumulative, out = 0, []
        for le, n in zip((*OUTPUT_TOKENS_BUCKETS, math.inf), self.output_hist, strict=True):
            cumulative += n
            out.append((le, float(cumulative)))
        return tuple(out)

    def view(self, req: SimRequest) -> ReplicaView:
        return ReplicaView(
            self.rid,
            len(self.waiting),
            len(self.running),
            self.cal.max_num_seqs,
            self.free_blocks * self.cal.block_size - self.waiting_tokens,
            self.cal.kv_capacity_tokens,
            min(req.prompt, self.prefix_hit(req.hash_ids) * HASH_BLOCK_TOKENS) if req.hash_ids else 0,
        )

    # -- scheduling ----------------------------------------------------------------------------------

    def prefix_hit(self, hash_ids: tuple[int, ...]) -> int:
        """Cached blocks at the start of this prompt."""
        n = 0
        for h in hash_ids:
            if h not in self.cache:
                break
            n += 1
        return n

    def _admit_prefix(self, req: SimRequest) -> None:
        """On admission with nothing computed: skip the cached leading blocks, record the prompt's."""
        if not req.hash_ids:
            if req.cached_tokens is None:
                req.cached_tokens = 0
            return
        hit = min(self.prefix_hit(req.hash_ids) * HASH_BLOCK_TOKENS, req.prompt - 1)
        if req.cached_tokens is None:
            req.cached_tokens = hit
        req.computed = hit
        self.remember_prefix(req.hash_ids)

    def remember_prefix(self, hash_ids: tuple[int, ...]) -> None:
        """Record a prompt's blocks as cached here (most recent last), evicting the oldest over capacity."""
        cache = self.cache
        for h in hash_ids:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
        cap = max(1, self.cal.kv_capacity_tokens // HASH_BLOCK_TOKENS)
        while len(cache) > cap:
            cache.popitem(last=False)

    def _admissible(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.cal.max_num_seqs and self.free_blocks >= 1

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.cal.block_size)

    def _jump_blocks(self, k: int) -> int:
        return sum(self._blocks_for(r.computed + k) - r.blocks for r in self.running)

    def plan(self, now: float) -> float | None:
        """Start the next step at `now`; returns its end time, or None when idle."""
        self.busy = False
        if not self.running and not self.waiting:
            return None
        if (
            self.running
            and not self._admissible()
            and all(r.computed >= r.prefill_target for r in self.running)
        ):
            cap = min(r.output - r.generated for r in self.running)
            if cap >= 1 and self._jump_blocks(1) <= self.free_blocks:
                k = cap
                if self._jump_blocks(k) > self.free_blocks:
                    lo, hi = 1, k  # largest k that fits: needed(k) is monotone
                    while lo < hi:
                        mid = (lo + hi + 1) // 2
                        if self._jump_blocks(mid) <= self.free_blocks:
                            lo = mid
                        else:
                            hi = mid - 1
                    k = lo
                self.jump = k
                self.batch = []
                self.step_start = now
                d = len(self.running)
                ctx = sum(r.computed for r in self.running) + d + d * (k - 1) / 2.0
                self.step_dur = self.cal.step_seconds(d, 0, ctx, ctx)
                self.busy = True
                return now + k * self.step_dur
        return self._plan_mixed(now)

    def _preempt_last(self) -> SimRequest:
        victim = self.running.pop()
        self.free_blocks += victim.blocks
        victim.blocks = 0
        victim.computed = 0
        victim.prefill_target = victim.prompt + victim.generated
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        self.waiting_tokens += victim.prompt
        return victim

    def _plan_mixed(self, now: float) -> float | None:
        cal = self.cal
        budget = cal.max_num_batched_tokens
        batch: list[tuple[SimRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = 1 if req.computed >= req.prefill_target else min(req.prefill_target - req.computed, budget)
            need = self._blocks_for(req.computed + n) - req.blocks
            victim = None
            while need > self.free_blocks and self.running:
                preempted = True
                victim = self._preempt_last()
                if victim is req:
                    break
            if victim is req:
                break
            self.free_blocks -= need
            req.blocks += need
            batch.append((req, n))
            budget -= n
            i += 1
        if not preempted:
            while self._admissible() and budget > 0:
                req = self.waiting[0]
                if req.prefill_target == 0:
                    req.prefill_target = req.prompt
                if req.computed == 0 and req.blocks == 0:
                    self._admit_prefix(req)
                n = min(req.prefill_target - req.computed, budget)
                need = self._blocks_for(req.computed + n) - req.blocks
                if need > self.free_blocks:
                    break
                self.waiting.popleft()
                self.waiting_tokens -= req.prompt
                self.running.append(req)
                self.free_blocks -= need
                req.blocks += need
                batch.append((req, n))
                budget -= n
        if not batch:
            return None  # nothing fits (cannot happen with requests that fit the pool); stay idle
        decoding = prefill = 0
        context = pairs = 0.0
        for r, n in batch:
            if r.computed >= r.prefill_target:
                decoding += 1
            else:
                prefill += n
            context += r.computed + n
            pairs += n * (r.computed + (n + 1) / 2.0)
        self.jump = 0
        self.batch = batch
        self.step_start = now
        self.step_dur = cal.step_seconds(decoding, prefill, context, pairs)
        self.busy = True
        return now + self.step_dur

    def _advance_jump(self, steps: int) -> None:
        for r in self.running:
            r.computed += steps
            r.generated += steps
            nb = self._blocks_for(r.computed)
            self.free_blocks -= nb - r.blocks
            r.blocks = nb

    def _finish_done(self, now: float) -> list[SimRequest]:
        done = [r for r in self.running if r.generated >= r.output]
        if done:
            self.running = [r for r in self.running if r.generated < r.output]
            self.completed += len(done)
            for r in done:
                r.finish = now
                self.prompt_tokens_done += r.prompt
                self.output_tokens_done += r.output
                self.output_hist[bisect.bisect_left(OUTPUT_TOKENS_BUCKETS, r.output)] += 1
                self.free_blocks += r.blocks
                r.blocks = 0
        return done

    def end_step(self, now: float) -> list[SimRequest]:
        """Apply the finished step (or jump); returns the requests that completed."""
        if self.jump:
            self._advance_jump(self.jump)
            self.jump = 0
        else:
            for r, n in self.batch:
                r.computed += n
                if r.computed >= r.prefill_target:
                    r.generated += 1
                    if r.first_token is None:
                        r.first_token = now
            self.batch = []
        self.busy = False
        return self._finish_done(now)

    def materialize(self, now: float, truncate: bool) -> float | None:
        """Bring a jump up to `now` (whole steps); with truncate, replan at the next step boundary.
        Returns the new end time of the step in progress, or None if nothing changed."""
        if not self.busy or not self.jump:
            return None
        done = min(self.jump - 1, int((now - self.step_start) / self.step_dur))
        if done > 0:
            self._advance_jump(done)
            self.step_start += done * self.step_dur
            self.jump -= done
        if truncate and self.jump > 1:
            self.jump = 1
        elif done == 0:
            return None
        return self.step_start + self.jump * self.step_dur
