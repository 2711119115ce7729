"""The fleet router's policies in the fleet simulator: one adapter from the simulator's views to
`kvpilot.router.policy`, so a trace is routed by the same decision code as `kvpilot router`.

    router = PolicyRouter("prefix-affinity")        # the simulator's `--router router:prefix-affinity`
    i = router(request_view, replica_views)         # index, or None = hold in the central queue

What the policy is shown is what the router would know of each pod, not the simulator's inside view:
- the routing key: the trace's hash_ids (512-token blocks) chained like the router's block hashes
  (block i's hash covers blocks 0..i); the request's footprint is its prompt and output in blocks;
- a pod: its requests in flight (the router's own count: queued on the pod plus in its batch) against
  a capacity of maxNumSeqs, its waiting count and KV use (what the router scrapes), and the KV blocks
  in use as the estimate of the blocks its in-flight requests hold.
A pod without a free slot is never chosen, so the request waits in the simulator's central queue,
exactly as in the router; the policy is not told a pod's free KV (the router does not know it), so a
pod may queue a request its KV cannot take yet.

Defaults scaled to the trace's blocks: prefix-affinity keys on the first block (512 tokens; the
router's default 8 blocks of 64 characters are about 128 tokens, so one trace block is the nearest);
kv-aware remembers as many blocks per pod as the replica's KV holds (as the router bounds its LRU
like a pod's cache). Both can be set through `options`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from kvpilot.autoscaler.trace import HASH_BLOCK_TOKENS
from kvpilot.router.keys import chain_hashes
from kvpilot.router.policy import POLICIES, PodView, Policy, RouteKey, make_policy, route

if TYPE_CHECKING:
    from kvpilot.autoscaler.sim_replica import ReplicaView, RequestView

PREFIX = "router:"
ROUTER_POLICY_NAMES = tuple(PREFIX + p for p in POLICIES)


@lru_cache(maxsize=8192)
def chained(hash_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The router's chained block hashes of a trace request's hash_ids (cached: the head of the
    central queue is offered again at every step)."""
    return chain_hashes([h.to_bytes(8, "big", signed=True) for h in hash_ids])


def route_key(request: RequestView) -> RouteKey:
    size = -(-(request.prompt_tokens + request.output_tokens) // HASH_BLOCK_TOKENS)
    return RouteKey(blocks=chained(request.hash_ids), size_blocks=max(1, size))


def pod_view(replica: ReplicaView) -> PodView:
    cap = max(1, replica.kv_capacity_tokens)
    used = min(cap, max(0, cap - replica.free_kv_tokens))
    return PodView(
        name=f"r{replica.replica_id}",
        in_flight=replica.in_flight,
        capacity=replica.max_num_seqs,
        kv_usage=used / cap,
        waiting=replica.waiting,
        active_blocks=-(-used // HASH_BLOCK_TOKENS),
    )


class PolicyRouter:
    """A simulator router (`router(request, replicas) -> index | None`) running a router policy."""

    def __init__(self, policy: str, **options: float) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        make_policy(policy, **options)  # refuses unknown options now, not at the first request
        self.name = PREFIX + policy
        self.policy_name = policy
        self.options = dict(options)
        self.policy: Policy | None = None  # made at the first request (sized from the replicas)
        self._pods: set[str] = set()

    def _make(self, replicas: Sequence[ReplicaView]) -> Policy:
        options = dict(self.options)
        if self.policy_name == "prefix-affinity":
            options.setdefault("affinity_blocks", 1)
        elif self.policy_name == "kv-aware":
            blocks = max(r.kv_capacity_tokens for r in replicas) // HASH_BLOCK_TOKENS
            options.setdefault("max_blocks_per_pod", max(1, blocks))
        return make_policy(self.policy_name, **options)

    def __call__(self, request: RequestView, replicas: Sequence[ReplicaView]) -> int | None:
        if not replicas:
            return None
        if self.policy is None:
            self.policy = self._make(replicas)
        pods = [pod_view(r) for r in replicas]
        names = {p.name for p in pods}
        if names != self._pods:  # replicas left (drained, deleted): forget what was sent there
            for gone in self._pods - names:
                self.policy.forget(gone)
            self._pods = names
        key = route_key(request)
        return route(self.policy, key, pods)
