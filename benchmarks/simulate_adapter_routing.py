"""Adapter swaps by routing policy: the router's decision code on a simulated fleet of LoRA pods.

Each pod runs `--capacity` requests at once and keeps `--max-loras` adapters on its device (an LRU,
like the runtime's LoRA manager: a request whose adapter is not resident swaps it in, evicting the
least recently used). Requests arrive as a Poisson process at `--load` x the fleet's capacity, each
naming one of `--adapters` adapters with Zipf(`--zipf`) popularity (a share `--base` names the base
model), and run an exponential time (mean 1). Every request is routed by `kvpilot.router.policy`
exactly as `kvpilot router` routes it (the model's policy alone, or behind `AdapterAffinity`); with no
room anywhere it waits in the central queue (FIFO). Deterministic for a seed; prints JSON.

    python benchmarks/simulate_adapter_routing.py                       # defaults below, ~2 s
    python benchmarks/simulate_adapter_routing.py --pods 8 --adapters 64 --max-loras 8

It counts device swaps (what affinity saves) and the spread of requests over pods and the batch a
request joins on its pod (what it must not cost); the cost of a swap itself is the runtime's, not
modelled.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import OrderedDict, deque
from typing import Any

from kvpilot.router.policy import AdapterAffinity, PodView, Policy, RouteKey, make_policy, route


def simulate(policy: Policy, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.adapters)]
    names = [f"a{k}" for k in range(args.adapters)]
    in_flight = [0] * args.pods
    device: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(args.pods)]
    served = [0] * args.pods
    swaps = 0
    waits: list[float] = []
    joined: list[int] = []  # requests already running on the pod a request starts on (its batch)
    queue: deque[tuple[float, RouteKey]] = deque()
    events: list[tuple[float, int, int]] = []  # (time, seq, pod): a request finishes
    rate = args.load * args.pods * args.capacity  # mean service time 1
    now, seq = 0.0, 0

    def views() -> list[PodView]:
        return [PodView(f"pod-{i}", in_flight[i], args.capacity) for i in range(args.pods)]

    def start(i: int, key: RouteKey, arrived: float) -> None:
        nonlocal swaps, seq
        joined.append(in_flight[i])
        in_flight[i] += 1
        served[i] += 1
        waits.append(now - arrived)
        if key.adapter is not None:
            lru = device[i]
            if key.adapter not in lru:
                swaps += 1
                lru[key.adapter] = None
                while len(lru) > args.max_loras:
                    lru.popitem(last=False)
            lru.move_to_end(key.adapter)
        seq += 1
        heapq.heappush(events, (now + rng.expovariate(1.0), seq, i))

    next_arrival = rng.expovariate(rate)
    arrived = 0
    while arrived < args.requests or events:
        if arrived < args.requests and (not events or next_arrival <= events[0][0]):
            now = next_arrival
            arrived += 1
            next_arrival = now + rng.expovariate(rate)
            adapter = None if rng.random() < args.base else rng.choices(names, weights)[0]
            key = RouteKey(adapter=adapter)
            i = None if queue else route(policy, key, views())
            if i is None:
                queue.append((now, key))
            else:
                start(i, key, now)
        else:
            now, _, pod = heapq.heappop(events)
            in_flight[pod] -= 1
            while queue:
                i = route(policy, queue[0][1], views())
                if i is None:
                    break
                when, key = queue.popleft()
                start(i, key, when)
    waits.sort()
    joined.sort()
    return {
        "device_swaps": swaps,
        "swaps_per_request": round(swaps / args.requests, 4),
        "requests_per_pod": served,
        "max_over_mean_requests": round(max(served) / (sum(served) / len(served)), 3),
        "batch_joined_mean": round(sum(joined) / len(joined), 3),
        "batch_joined_p99": joined[int(0.99 * (len(joined) - 1))],
        # every policy here starts a request at once when any pod has a free slot, so the central
        # queue (and its wait) is the same for all of them by construction
        "queue_wait_mean": round(sum(waits) / len(waits), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pods", type=int, default=4)
    p.add_argument("--capacity", type=int, default=8, help="requests a pod runs at once (maxNumSeqs)")
    p.add_argument("--max-loras", type=int, default=4, help="adapters resident on a pod's device")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent (0: uniform)")
    p.add_argument("--base", type=float, default=0.2, help="share of requests for the base model")
    p.add_argument("--load", type=float, default=0.7, help="arrival rate as a share of the fleet's slots")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--policies", default="round-robin,least-loaded,prefix-affinity")
    args = p.parse_args()
    out: dict[str, Any] = {"settings": vars(args), "results": {}}
    for name in args.policies.split(","):
        out["results"][name] = simulate(make_policy(name), args)
        affinity = AdapterAffinity(make_policy(name), eps=0.25, slots=args.max_loras)
        out["results"][f"{name} + adapter affinity"] = simulate(affinity, args)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
