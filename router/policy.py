"""Routing decisions: which pod gets a request, or hold it in the central queue.

Pure code (no I/O, no aiohttp), so the router and the fleet simulator run the same decisions:

    policy = make_policy("prefix-affinity")
    i = policy.choose(key, pods)       # index into pods, or None = hold in the model's central queue
    if i is not None:
        policy.dispatched(pods[i].name, key)   # the request was sent there (kv-aware learns from it)

`key` is a `RouteKey` (chained hashes of the prompt's leading blocks, an optional session id; see
`kvpilot.router.keys`), `pods` are `PodView`s of the model's Ready pods in a stable order (the caller
sorts them by name). A policy never returns a pod without room (`in_flight >= capacity`): when no pod
has room, every policy returns None and the caller queues the request, so a pod that frees a slot or
a replica that just became Ready takes the head of the queue.

Policies:
- `round-robin`: the next pod with room after the last one chosen.
- `least-loaded`: the lowest (load + 1) per slot times the pod's slowness (below), load being the
  router's in-flight count plus the pod's scraped waiting count; the scraped KV use breaks ties, then
  rotation.
- `prefix-affinity`: consistent hashing with bounded loads (CHWBL): the key's affinity hash (session
  id, else the prompt's first `affinity_blocks` blocks) picks a point on a ring of virtual nodes; the
  first pod clockwise whose load after taking the request stays within ceil((1 + eps) x average load)
  gets it. Some pod always meets the bound, so the walk ends; pods out of room are passed over.
- `kv-aware`: estimates each pod's cached prefix from the blocks the router itself sent there (an LRU
  of block hashes per pod, bounded like a pod's cache) and picks the lowest
  cost = prefill_weight x (prompt blocks not cached there) + (KV blocks its in-flight requests hold),
  like Dynamo's KV router (prefill blocks to compute + decode blocks in use), plus the request's own
  blocks, times the pod's slowness.

Slowness (`slowness()`): what the router measured of each pod, moving averages of its TTFT and TPOT
and of its failed exchanges (router/measure.py): the larger of its TTFT and TPOT over the median of
the model's measured pods, divided by its success rate, within [1/4, 8]; 1 for a pod not measured
yet. So a pod that answers twice as slowly as its peers takes a request only when it has half
their load, and an equally fast fleet is routed exactly as by load alone.

LoRA adapters (`AdapterAffinity`, wrapped around every model's policy by the router): a request whose
key names an adapter goes to the least loaded pod that holds it (the router sent that adapter there
among the pod's last `slots` adapters: what its device slots, `--max-loras`, most likely still hold)
as long as that pod's load after taking it stays within the same bound as prefix-affinity's,
ceil((1 + eps) x average load); when no holder is within the bound (or none has room) the model's
own policy picks, and that pod becomes a holder too, so a hot adapter spreads only under load.
Requests for the base model go to the model's policy unchanged.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("round-robin", "least-loaded", "prefix-affinity", "kv-aware")
# kv-aware: the one that measures best at the fleet level (docs/router.md, "Which policy by default").
DEFAULT_POLICY = "kv-aware"


def stable_hash(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (router replicas must agree on the ring)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True)
class RouteKey:
    """What routing knows of a request.

    `blocks[i]` is the hash of the prompt's blocks 0..i (chained, so equal hashes mean equal
    prefixes); `session` is a client-given conversation id (a header) that overrides the prompt for
    affinity; `size_blocks` is the request's KV footprint estimate (prompt blocks when not given);
    `adapter` the LoRA adapter of the model that the request names.
    """

    blocks: tuple[int, ...] = ()
    session: str | None = None
    size_blocks: int | None = None
    adapter: str | None = None  # the LoRA adapter the request names (None: the base model)

    def affinity_hash(self, affinity_blocks: int) -> int:
        if self.session is not None:
            return stable_hash(b"session\x00" + self.session.encode("utf-8", "replace"))
        if not self.blocks:
            return 0
        return self.blocks[min(len(self.blocks), max(1, affinity_blocks)) - 1]

    @property
    def footprint(self) -> int:
        return self.size_blocks if self.size_blocks is not None else max(1, len(self.blocks))


@dataclass(frozen=True)
class PodView:
    """One Ready pod as routing sees it.

    in_flight: requests the router has running there; capacity: its batch size (maxNumSeqs);
    kv_usage / waiting: last scraped KV use (0..1) and waiting count, None when unknown;
    active_blocks: KV blocks the router's in-flight requests there hold (its own estimate).
    """

    name: str
    in_flight: int
    capacity: int
    kv_usage: float | None = None
    waiting: int | None = None
    active_blocks: int = 0
    ttft_s: float | None = None  # moving averages of what the router measured (None: not yet)
    tpot_s: float | None = None
    error_rate: float = 0.0

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.capacity

    @property
    def load(self) -> int:
        return self.in_flight + (self.waiting or 0)


SLOWNESS_RANGE = (0.25, 8.0)


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def slowness(pods: Sequence[PodView]) -> list[float]:
    """Each pod's measured slowness relative to its peers (see the module docstring)."""
    ttft_ref = _median([p.ttft_s for p in pods if p.ttft_s is not None and p.ttft_s > 0])
    tpot_ref = _median([p.tpot_s for p in pods if p.tpot_s is not None and p.tpot_s > 0])
    out: list[float] = []
    for p in pods:
        ratios = [v / ref for v, ref in ((p.ttft_s, ttft_ref), (p.tpot_s, tpot_ref)) if v is not None and ref]
        ratio = max(ratios, default=1.0) / max(0.05, 1.0 - min(1.0, max(0.0, p.error_rate)))
        out.append(min(SLOWNESS_RANGE[1], max(SLOWNESS_RANGE[0], ratio)))
    return out


class Policy(Protocol):
    name: str

    def choose(self, key: RouteKey, pods: Sequence[PodView]) -> int | None:
        """Index of the pod to send to, or None to hold the request (no pod has room)."""
        ...

    def dispatched(self, pod: str, key: RouteKey) -> None:
        """The request with `key` was sent to `pod`."""
        ...

    def forget(self, pod: str) -> None:
        """`pod` left the model (deleted, replaced): drop what is remembered about it."""
        ...


class _Base:
    name = ""

    def __init__(self) -> None:
        self._cursor = 0

    def dispatched(self, pod: str, key: RouteKey) -> None:
        return None

    def forget(self, pod: str) -> None:
        return None

    def _rotation(self, i: int, n: int) -> int:
        """Distance from the rotating cursor: spreads ties instead of always taking pod 0."""
        return (i - self._cursor) % n

    def _least_loaded(self, pods: Sequence[PodView], measured: bool = False) -> int | None:
        """The pod with the least load per slot (`measured`: times its slowness)."""
        n = len(pods)
        best: tuple[float, float, int] | None = None
        choice: int | None = None
        slow = slowness(pods) if measured else [1.0] * n
        for i, p in enumerate(pods):
            if not p.has_room:
                continue
            load = (p.load + 1) * slow[i] if measured else p.load
            score = (load / max(1, p.capacity), p.kv_usage or 0.0, self._rotation(i, n))
            if best is None or score < best:
                best, choice = score, i
        if choice is not None:
            self._cursor = (choice + 1) % n
        return choice


class RoundRobin(_Base):
    name = "round-robin"

    def choose(self, key: RouteKey, pods: Sequence[PodView]) -> int | None:
        n = len(pods)
        for step in range(n):
            i = (self._cursor + step) % n
            if pods[i].has_room:
                self._cursor = (i + 1) % n
                return i
        return None


class LeastLoaded(_Base):
    name = "least-loaded"

    def choose(self, key: RouteKey, pods: Sequence[PodView]) -> int | None:
        return self._least_loaded(pods, measured=True)


def load_bound(pods: Sequence[PodView], eps: float) -> int:
    """The most load a pod may have after taking one more request: ceil((1 + eps) x average)."""
    total = sum(p.load for p in pods) + 1
    return max(1, math.ceil((1.0 + eps) * total / max(1, len(pods))))


class PrefixAffinity(_Base):
    """Consistent hashing with bounded loads over the key's affinity hash."""

    name = "prefix-affinity"

    def __init__(self, eps: float = 0.25, vnodes: int = 64, affinity_blocks: int = 8) -> None:
        super().__init__()
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if vnodes < 1 or affinity_blocks < 1:
            raise ValueError("vnodes and affinity_blocks must be >= 1")
        self.eps = eps
        self.vnodes = vnodes
        self.affinity_blocks = affinity_blocks
        self._ring_for: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []
        self._points: list[int] = []

    def _build(self, names: tuple[str, ...]) -> None:
        if names == self._ring_for:
            return
        ring = [(stable_hash(f"{name}#{v}".encode()), name) for name in names for v in range(self.vnodes)]
        ring.sort()
        self._ring_for, self._ring, self._points = names, ring, [h for h, _ in ring]

    def ring_order(self, key: RouteKey, pods: Sequence[PodView]) -> list[int]:
        """Pod indexes in the order the ring walk visits them for this key (each pod once)."""
        self._build(tuple(p.name for p in pods))
        index = {p.name: i for i, p in enumerate(pods)}
        start = bisect.bisect_left(self._points, key.affinity_hash(self.affinity_blocks))
        order: list[int] = []
        seen: set[str] = set()
        for step in range(len(self._ring)):
            _, name = self._ring[(start + step) % len(self._ring)]
            if name not in seen:
                seen.add(name)
                order.append(index[name])
                if len(order) == len(pods):
                    break
        return order

    def choose(self, key: RouteKey, pods: Sequence[PodView]) -> int | None:
        if not pods:
            return None
        bound = load_bound(pods, self.eps)
        for i in self.ring_order(key, pods):
            p = pods[i]
            if p.has_room and p.load + 1 <= bound:
                return i
        # Every pod within the bound is out of room (capacities differ): the least loaded with room.
        return self._least_loaded(pods)


class KvAware(_Base):
    """Lowest prefill_weight x uncached prompt blocks + KV blocks in use, from what was sent where."""

    name = "kv-aware"

    def __init__(self, prefill_weight: float = 1.0, max_blocks_per_pod: int = 4096) -> None:
        super().__init__()
        if prefill_weight < 0 or max_blocks_per_pod < 1:
            raise ValueError("prefill_weight must be >= 0 and max_blocks_per_pod >= 1")
        self.prefill_weight = prefill_weight
        self.max_blocks_per_pod = max_blocks_per_pod
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def cached_blocks(self, pod: str, key: RouteKey) -> int:
        """How many of the key's leading blocks the router believes `pod` holds."""
        seen = self._sent.get(pod)
        if not seen:
            return 0
        n = 0
        for h in key.blocks:
            if h not in seen:
                break
            n += 1
        return n

    def cost(self, pod: PodView, key: RouteKey) -> float:
        uncached = len(key.blocks) - self.cached_blocks(pod.name, key)
        # A pod's own waiting queue (scraped) delays this request as much as blocks in use do.
        queued = (pod.waiting or 0) * key.footprint
        return self.prefill_weight * uncached + pod.active_blocks + queued

    def choose(self, key: RouteKey, pods: Sequence[PodView]) -> int | None:
        n = len(pods)
        choice: int | None = None
        best_kv: tuple[float, int, float, int] | None = None
        slow = slowness(pods)
        for i, p in enumerate(pods):
            if not p.has_room:
                continue
            # equal cost: the pod holding more of the prefix (its cache stays warm), then the lighter
            score = (
                (self.cost(p, key) + key.footprint) * slow[i],
                -self.cached_blocks(p.name, key),
                p.load / max(1, p.capacity),
                self._rotation(i, n),
            )
            if best_kv is None or score < best_kv:
                best_kv, choice = score, i
        if choice is not None:
            self._cursor = (choice + 1) % n
        return choice

    def dispatched(self, pod: str, key: RouteKey) -> None:
        seen = self._sent.setdefault(pod, OrderedDict())
        for h in key.blocks:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_blocks_per_pod:
            seen.popitem(last=False)

    def forget(self, pod: str) -> None:
        self._sent.pop(pod, None)


def choose_adapter_holder(holders: Sequence[bool], pods: Sequence[PodView], eps: float) -> int | None:
    """The pod for an adapter request among those that hold the adapter (`holders[i]`): the least
    loaded per slot with room whose load after taking the request stays within load_bound(pods, eps);
    None when no holder qualifies (the model's policy then picks among all pods). Ties: lower index."""
    bound = load_bound(pods, eps)
    best: tuple[float, int] | None = None
    choice: int | None = None
    for i, (p, held) in enumerate(zip(pods, holders, strict=True)):
        if not held or not p.has_room or p.load + 1 > bound:
            continue
        score = (p.load / max(1, p.capacity), i)
        if best is None or score < best:
            best, choice = score, i
    return choice


class AdapterAffinity:
    """A model's policy with LoRA adapter affinity in front (see the module docstring).

    Which pod holds which adapter is the router's own record of what it sent where: per pod the last
    `slots` distinct adapters (an LRU, like the runtime's device slots), forgotten with the pod.
    """

    def __init__(self, base: Policy, eps: float = 0.25, slots: int = 4) -> None:
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.base = base
        self.name = base.name
        self.eps = eps
        self.slots = slots
        self._held: dict[str, OrderedDict[str, None]] = {}

    def holds(self, pod: str, adapter: str) -> bool:
        return adapter in self._held.get(pod, ())

    def choose(self, key: RouteKey, pods: Sequence[PodView]) -> int | None:
        if key.adapter is not None and pods:
            holders = [self.holds(p.name, key.adapter) for p in pods]
            i = choose_adapter_holder(holders, pods, self.eps)
            if i is not None:
                return i
        return self.base.choose(key, pods)

    def dispatched(self, pod: str, key: RouteKey) -> None:
        if key.adapter is not None:
            held = self._held.setdefault(pod, OrderedDict())
            held[key.adapter] = None
            held.move_to_end(key.adapter)
            while len(held) > self.slots:
                held.popitem(last=False)
        self.base.dispatched(pod, key)

    def forget(self, pod: str) -> None:
        self._held.pop(pod, None)
        self.base.forget(pod)

    def lacks(self, pod: str, adapter: str) -> None:
        """`pod` answered that it does not serve `adapter` (a pod from before the adapter was added)."""
        held = self._held.get(pod)
        if held is not None:
            held.pop(adapter, None)


def route(policy: Policy, key: RouteKey, pods: Sequence[PodView]) -> int | None:
    """choose() and, when a pod is chosen, dispatched(): one call for a caller that sends at once
    (the fleet simulator). None: hold the request in the central queue and ask again later."""
    i = policy.choose(key, pods)
    if i is not None:
        policy.dispatched(pods[i].name, key)
    return i


_OPTIONS: dict[str, set[str]] = {
    "round-robin": set(),
    "least-loaded": set(),
    "prefix-affinity": {"eps", "vnodes", "affinity_blocks"},
    "kv-aware": {"prefill_weight", "max_blocks_per_pod"},
}


def make_policy(name: str, **options: float) -> Policy:
    """A fresh policy by its CLI/CRD name; options are the policy's own keyword arguments."""
    allowed = _OPTIONS.get(name)
    if allowed is not None and not set(options) <= allowed:
        unknown = ", ".join(sorted(set(options) - allowed))
        raise ValueError(f"routing policy {name!r} takes no option {unknown}")
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "prefix-affinity":
        return PrefixAffinity(
            eps=float(options.get("eps", 0.25)),
            vnodes=int(options.get("vnodes", 64)),
            affinity_blocks=int(options.get("affinity_blocks", 8)),
        )
    if name == "kv-aware":
        return KvAware(
            prefill_weight=float(options.get("prefill_weight", 1.0)),
            max_blocks_per_pod=int(options.get("max_blocks_per_pod", 4096)),
        )
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
