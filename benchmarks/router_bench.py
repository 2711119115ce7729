"""What does the fleet router cost per request, and what do its policies buy? One subcommand per
setting; each prints one JSON object with the machine.

    python benchmarks/router_bench.py overhead --requests 400 --seconds 5 --concurrency 32   # added latency, CPU per request
    python benchmarks/router_bench.py prefix --conversations 12 --turns 3                    # 3 local pods: prefix-cache hits, TTFT per policy
    python benchmarks/router_bench.py pd --requests 400 --seconds 5 --concurrency 32        # what the P/D prefill leg costs the router
    python benchmarks/router_bench.py e2e wake|burst|prefix|all                              # on the local control plane (e2e/cluster)

The router's policies on a simulated fleet: benchmarks/simulate_routing.py and
benchmarks/simulate_adapter_routing.py.
"""

from __future__ import annotations

from harness import dispatch

COMMANDS = {
    "overhead": "fleet.router_local",
    "prefix": "fleet.router_local",
    "pd": "fleet.router_pd",
    "e2e": "fleet.router_e2e",
}

if __name__ == "__main__":
    # fleet/router_local.py's own parser has `overhead` and `prefix`
    dispatch(__doc__ or "", COMMANDS, own_name=("overhead", "prefix"))
