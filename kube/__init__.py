"""kvpilot.kube: the Kubernetes platform layer that the operator, the autoscaler and the router share.

- `client`: one adapter to the API server (plain dicts, tenacity retries on conflicts, throttling and
  transient errors), behind the `Kube` Protocol that tests fake in memory;
- `lease`: leader election on a coordination.k8s.io/v1 Lease (client-go semantics);
- `events`: core/v1 Events about an InferenceModel;
- `times`: the RFC 3339 timestamps Kubernetes objects carry;
- `health`: the /healthz, /livez, /readyz server of the control-plane processes.
"""

if __name__ == "kube":  # the checkout's root is on sys.path: see kvpilot/source_tree.py
    from kvpilot.source_tree import defer_to_installed

    defer_to_installed(__name__, __file__)
