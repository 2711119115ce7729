"""Pure rendering of a disaggregated InferenceModel (spec.disaggregation): one set of pods per P/D role.

Each role is rendered as the aggregated model would be, from the role's spec (api/disaggregation.py
`role_spec`: its resources and runtime over spec's, its own replicas), then made the role's own:

- names `<name>-<role>` (Deployment, PodDisruptionBudget) and `<name>-<role>-config` (ConfigMap);
- the role label `kvpilot.dev/kv-role` on every object, in the Deployment's selector and on its pods,
  next to the model label, so the model's one Service (and the router, and the autoscaler) covers both
  roles while each Deployment and budget selects only its own pods;
- `kvpilot serve --kv-role <role>` and, for decode pods, the transfer deadline.

The model-wide children (the Service, the ServiceMonitor) are the aggregated model's. Switching a
model between aggregated and disaggregated leaves the other mode's children behind: `stale_children`
names them so the reconciler deletes them (only those this InferenceModel controls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.api import disaggregation as pd
from kvpilot.api.models import API_VERSION, KIND, KV_ROLE_LABEL, InferenceModel, KvRole, OOMOverrides
from kvpilot.operator.adapters import AdapterSync
from kvpilot.operator.builders import (
    CONFIG_PATH,
    OperatorSettings,
    config_map_name,
    render_config_map,
    render_config_yaml,
    render_deployment,
    render_pdb,
    render_service,
    render_service_monitor,
)

# The children whose names and selectors differ between the two modes (the Service and ServiceMonitor
# are the model's in both); the reconciler lists these kinds to remove what the other mode left.
ROLE_KINDS = (("apps/v1", "Deployment"), ("policy/v1", "PodDisruptionBudget"), ("v1", "ConfigMap"))


def role_name(name: str, role: KvRole) -> str:
    return f"{name}-{role}"


def role_config_map_name(name: str, role: KvRole) -> str:
    return config_map_name(role_name(name, role))


def role_model(im: InferenceModel, role: KvRole) -> InferenceModel:
    """The model as one role's pods see it (its metadata unchanged: the model label stays the name)."""
    return im.model_copy(update={"spec": pd.role_spec(im.spec, role)})


def role_args(im: InferenceModel, role: KvRole) -> list[str]:
    """`kvpilot serve` flags of a role's pods (docs/disaggregation.md, runtime section)."""
    d = im.spec.disaggregation
    assert d is not None
    args = ["--kv-role", role]
    if role == "decode":  # the side that pulls: past the deadline it recomputes the prompt
        args += ["--kv-transfer-timeout", f"{d.transfer_timeout_seconds:g}"]
    return args


def _label(obj: dict[str, Any], role: KvRole) -> None:
    obj["metadata"]["labels"] = {**obj["metadata"]["labels"], KV_ROLE_LABEL: role}


def _role_deployment(deployment: dict[str, Any], im: InferenceModel, role: KvRole) -> dict[str, Any]:
    deployment["metadata"]["name"] = role_name(im.name, role)
    _label(deployment, role)
    spec = deployment["spec"]
    spec["selector"]["matchLabels"] = {**spec["selector"]["matchLabels"], KV_ROLE_LABEL: role}
    _label(spec["template"], role)
    pod = spec["template"]["spec"]
    for volume in pod["volumes"]:
        if "configMap" in volume:
            volume["configMap"]["name"] = role_config_map_name(im.name, role)
    container = pod["containers"][0]
    command = container["command"]
    at = command.index(CONFIG_PATH) + 1  # after `--config PATH`, before spec.extraArgs
    container["command"] = [*command[:at], *role_args(im, role), *command[at:]]
    return deployment


def render_role(
    im: InferenceModel, role: KvRole, settings: OperatorSettings, overrides: OOMOverrides | None
) -> list[dict[str, Any]]:
    """One role's ConfigMap, Deployment and PodDisruptionBudget."""
    rim = role_model(im, role)
    config_yaml = render_config_yaml(rim, overrides)
    config_map = render_config_map(rim, settings, config_yaml)
    config_map["metadata"]["name"] = role_config_map_name(im.name, role)
    _label(config_map, role)
    deployment = _role_deployment(render_deployment(rim, settings, config_yaml, overrides), im, role)
    pdb = render_pdb(rim, settings)
    pdb["metadata"]["name"] = role_name(im.name, role)
    _label(pdb, role)
    pdb["spec"]["selector"]["matchLabels"] = {**pdb["spec"]["selector"]["matchLabels"], KV_ROLE_LABEL: role}
    return [config_map, deployment, pdb]


def render_role_children(
    im: InferenceModel, settings: OperatorSettings, overrides: dict[KvRole, OOMOverrides | None]
) -> list[dict[str, Any]]:
    """Every child of a disaggregated model, in apply order (each role's config before its pods)."""
    children = [c for role in pd.ROLES for c in render_role(im, role, settings, overrides.get(role))]
    children.append(render_service(im, settings))
    if settings.service_monitor:
        children.append(render_service_monitor(im, settings))
    return children


def controlled_by(obj: dict[str, Any], im: InferenceModel) -> bool:
    return any(
        ref.get("controller") and ref.get("uid") == im.uid
        for ref in obj["metadata"].get("ownerReferences") or []
    )


def controller_elsewhere(obj: dict[str, Any] | None, im: InferenceModel) -> str | None:
    """The name of another InferenceModel that controls `obj` (a name clash: model `a` with roles makes
    Deployment `a-prefill`, which is also model `a-prefill`'s), else None."""
    for ref in (obj or {}).get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == KIND and ref.get("apiVersion") == API_VERSION:
            return None if ref.get("uid") == im.uid else str(ref.get("name"))
    return None


def stale_children(
    im: InferenceModel, live: list[dict[str, Any]], desired: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The live children of ROLE_KINDS (listed by the model label) that this InferenceModel controls
    and no longer renders: the other mode's Deployments, budgets and ConfigMaps."""
    keep = {(c["kind"], c["metadata"]["name"]) for c in desired}
    return [
        obj for obj in live if (obj["kind"], obj["metadata"]["name"]) not in keep and controlled_by(obj, im)
    ]


def pod_role(pod: dict[str, Any]) -> str | None:
    return (pod.get("metadata", {}).get("labels") or {}).get(KV_ROLE_LABEL)


def merge_adapter_syncs(syncs: list[AdapterSync]) -> AdapterSync:
    """The roles' adapter syncs as one (every pod of both roles serves every adapter)."""
    out = AdapterSync()
    for sync in syncs:
        out.loaded.update(sync.loaded)
        out.failures += sync.failures
        out.pending.update(sync.pending)
        out.changed += sync.changed
    return out


@dataclass(frozen=True)
class RoleCounts:
    """One role's Deployment, as status.roles reports it."""

    replicas: int
    ready: int
    updated: int
    desired: int

    def dump(self) -> dict[str, int]:
        return {"replicas": self.replicas, "readyReplicas": self.ready, "desiredReplicas": self.desired}


def role_counts(im: InferenceModel, role: KvRole, deployment: dict[str, Any] | None) -> RoleCounts:
    st = (deployment or {}).get("status", {})
    return RoleCounts(
        replicas=int(st.get("replicas") or 0),
        ready=int(st.get("readyReplicas") or 0),
        updated=int(st.get("updatedReplicas") or 0),
        desired=pd.role_replicas(im.spec, role),
    )
