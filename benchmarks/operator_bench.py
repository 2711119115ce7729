"""How fast does the operator reconcile, and how fast does leadership move on SIGTERM? Both run
against the local control plane (`e2e/cluster up`); each prints one JSON object with the machine.

    python benchmarks/operator_bench.py reconcile --kubeconfig e2e/.state/kubeconfig [--models 50 --cold 300]
    eval "$(e2e/cluster env)"; python benchmarks/operator_bench.py handover --kubeconfig e2e/.state/kubeconfig --runs 3
"""

from __future__ import annotations

from harness import dispatch

COMMANDS = {
    "reconcile": "fleet.operator_reconcile",
    "handover": "fleet.leader_handover",
}

if __name__ == "__main__":
    dispatch(__doc__ or "", COMMANDS)
