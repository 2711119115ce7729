"""Pure builders: InferenceModel -> desired children (table tests on the fields that matter)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kvpilot.api.models import InferenceModel, OOMOverrides
from kvpilot.operator.builders import (
    APPLIED_HASH_ANNOTATION,
    CONFIG_HASH_ANNOTATION,
    HfSource,
    OperatorSettings,
    adapter_claim_volume,
    config_hash,
    desired_replicas,
    hf_source,
    model_path,
    render_children,
    render_config_yaml,
    render_deployment,
    termination_grace_seconds,
)
from kvpilot.runtime.config import EXIT_GRACE_S, EngineConfig
from tests.operator.fakes import make_body

SETTINGS = OperatorSettings(image="kvpilot/kvpilot:test")


def im(**spec: Any) -> InferenceModel:
    return InferenceModel.model_validate(make_body(**spec))


def children(model: InferenceModel, settings: OperatorSettings = SETTINGS) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in render_children(model, settings)}


def pod_spec(model: InferenceModel) -> dict[str, Any]:
    return children(model)["Deployment"]["spec"]["template"]["spec"]


def container(model: InferenceModel) -> dict[str, Any]:
    return pod_spec(model)["containers"][0]


@pytest.mark.parametrize(
    ("source", "path"),
    [
        ("builtin://smollm2-135m-instruct", "smollm2-135m-instruct"),
        ("pvc://models/llama/8b", "/models/llama/8b"),
        ("pvc://models", "/models"),
        ("hf://Qwen/Qwen2.5-7B-Instruct@v1", "/models/Qwen--Qwen2.5-7B-Instruct"),
        (
            "hf://bartowski/Llama-3.2-1B-Instruct-GGUF@refs/pr/3:Q4_K_M",
            "/models/bartowski--Llama-3.2-1B-Instruct-GGUF",
        ),
        ("file:///opt/m.gguf", "/opt/m.gguf"),
    ],
)
def test_model_path(source: str, path: str) -> None:
    assert model_path(source) == path


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        ("hf://org/name", HfSource("org/name", "", "")),
        ("hf://org/name@v1.2", HfSource("org/name", "v1.2", "")),
        ("hf://org/name:Q4_K_M", HfSource("org/name", "", "Q4_K_M")),
        ("hf://org/name@refs/pr/3:q8_0", HfSource("org/name", "refs/pr/3", "q8_0")),
    ],
)
def test_hf_source(source: str, parsed: HfSource) -> None:
    assert hf_source(source) == parsed


def test_children_kinds_names_labels_and_owner() -> None:
    model = im()
    out = children(model)
    assert set(out) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    assert out["ConfigMap"]["metadata"]["name"] == "llama-config"
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        assert out[kind]["metadata"]["name"] == "llama"
    for child in out.values():
        md = child["metadata"]
        assert md["namespace"] == "ml"
        assert md["labels"]["app.kubernetes.io/name"] == "kvpilot"
        assert md["labels"]["app.kubernetes.io/instance"] == "llama"
        assert md["labels"]["kvpilot.dev/model"] == "llama"
        assert md["ownerReferences"] == [
            {
                "apiVersion": "kvpilot.dev/v1alpha1",
                "kind": "InferenceModel",
                "name": "llama",
                "uid": "uid-llama",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert APPLIED_HASH_ANNOTATION not in (md.get("annotations") or {})  # apply.stamp adds it


def test_service_monitor_only_when_available() -> None:
    out = children(im(), OperatorSettings(service_monitor=True))
    sm = out["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["endpoints"][0]["port"] == "http"


def test_config_map_is_the_runtime_schema() -> None:
    model = im(
        model={"source": "pvc://models/llama", "servedName": "llama-3"},
        runtime={"maxModelLen": 4096, "maxNumSeqs": 32, "kvCacheDtype": "fp8", "shutdownTimeoutSeconds": 45},
    )
    text = children(model)["ConfigMap"]["data"]["config.yaml"]
    cfg = EngineConfig.model_validate(yaml.safe_load(text))
    assert cfg.model == "/models/llama"
    assert cfg.served_model_name == "llama-3"
    assert (cfg.port, cfg.host, cfg.device) == (8000, "0.0.0.0", "cuda")
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.kv_cache_dtype) == (4096, 32, "fp8")
    assert cfg.shutdown_timeout == 45.0
    assert text == render_config_yaml(model)


def test_cpu_model_gets_cpu_device_and_no_gpu_resources() -> None:
    model = im(resources={"gpus": 0, "cpu": "2", "memory": "4Gi"})
    c = container(model)
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    assert "tolerations" not in pod_spec(model)
    assert yaml.safe_load(children(model)["ConfigMap"]["data"]["config.yaml"])["device"] == "cpu"


def test_gpu_requests_limits_toleration_and_node_selector() -> None:
    model = im(
        resources={"gpus": 2, "gpuType": "h100"},
        runtime={"tensorParallelSize": 2},
        nodeSelector={"zone": "a"},
    )
    c = container(model)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    ps = pod_spec(model)
    assert ps["nodeSelector"] == {"zone": "a", "kvpilot.dev/gpu-type": "h100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in ps["tolerations"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in ps["volumes"]


def test_expert_parallel_is_rendered_into_the_runtime_config() -> None:
    model = im(resources={"gpus": 2}, runtime={"tensorParallelSize": 2, "enableExpertParallel": True})
    rendered = yaml.safe_load(children(model)["ConfigMap"]["data"]["config.yaml"])
    assert rendered["tensor_parallel_size"] == 2
    assert rendered["enable_expert_parallel"] is True
    assert (
        yaml.safe_load(children(im())["ConfigMap"]["data"]["config.yaml"])["enable_expert_parallel"] is False
    )


def test_command_probes_lifecycle_and_grace() -> None:
    model = im(runtime={"shutdownTimeoutSeconds": 60}, extraArgs=["--enforce-eager"])
    c = container(model)
    assert c["command"] == ["kvpilot", "serve", "--config", "/etc/kvpilot/config.yaml", "--enforce-eager"]
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 30 * 60
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod_spec(model)["terminationGracePeriodSeconds"]
    # the runtime ends itself at most EXIT_GRACE_S after its shutdown timeout, stuck engine or not:
    # before the kubelet's SIGKILL
    assert grace == termination_grace_seconds(model) and grace > pre_stop + 60 + EXIT_GRACE_S
    assert termination_grace_seconds(im()) > pre_stop + 30 + EXIT_GRACE_S  # the default shutdown timeout


def test_rolling_update_needs_no_spare_gpu() -> None:
    dep = children(im())["Deployment"]["spec"]
    assert dep["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert dep["selector"] == {"matchLabels": {"kvpilot.dev/model": "llama"}}
    assert dep["progressDeadlineSeconds"] > 30 * 60


def test_security_context() -> None:
    ps = pod_spec(im())
    assert ps["securityContext"]["runAsNonRoot"] is True
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = ps["containers"][0]["securityContext"]
    assert sc == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {m["mountPath"] for m in ps["containers"][0]["volumeMounts"]}
    assert {"/etc/kvpilot", "/tmp"} <= mounts  # writable /tmp with a read-only root


def test_pvc_volume_is_read_only() -> None:
    ps = pod_spec(im(model={"source": "pvc://weights/llama"}))
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in ps[
        "volumes"
    ]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in ps["containers"][0]["volumeMounts"]


def test_hf_source_gets_cache_volume_token_and_fetch_init_container() -> None:
    model = im(model={"source": "hf://Qwen/Qwen2.5-7B@abc", "hfTokenSecret": {"name": "hf", "key": "tok"}})
    ps = pod_spec(model)
    assert {"name": "model", "emptyDir": {}} in ps["volumes"]
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}}}
    assert token in ps["containers"][0]["env"]
    init = ps["initContainers"][0]
    assert token in init["env"]
    assert init["command"][:2] == ["python", "-c"]
    assert init["command"][3:] == ["Qwen/Qwen2.5-7B", "/models/Qwen--Qwen2.5-7B", "abc", ""]
    compile(init["command"][2], "fetch", "exec")  # the script is valid Python


def test_adapters_are_mounted_fetched_and_rendered_as_lora_modules() -> None:
    model = im(
        model={"source": "pvc://weights/llama"},
        adapters=[
            {"name": "sql", "source": "pvc://adapters/sql-lora"},
            {"name": "chat", "source": "hf://org/chat-lora@v2"},
            {"name": "tone", "source": "file:///opt/adapters/tone"},
            {"name": "whole", "source": "pvc://whole"},
        ],
        runtime={"maxLoras": 2, "maxLoraRank": 32},
    )
    cfg = EngineConfig.model_validate(yaml.safe_load(render_config_yaml(model)))
    assert cfg.lora_modules == {
        "sql": "/adapters/.pvc/adapters/sql-lora",
        "chat": "/adapters/chat",
        "tone": "/opt/adapters/tone",
        "whole": "/adapters/.pvc/whole",
    }
    assert cfg.enable_lora and cfg.enable_lora_runtime_updates
    assert cfg.allow_lora_updates_without_api_key  # no KVPILOT_API_KEY in spec.env: the live loads need it
    assert cfg.max_loras == 2 and cfg.max_lora_rank == 32
    ps = pod_spec(model)
    mounts = ps["containers"][0]["volumeMounts"]
    claim_volume = adapter_claim_volume("adapters")
    assert {"name": claim_volume, "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} in ps[
        "volumes"
    ]
    assert {"name": claim_volume, "mountPath": "/adapters/.pvc/adapters", "readOnly": True} in mounts
    whole = adapter_claim_volume("whole")
    assert {"name": whole, "mountPath": "/adapters/.pvc/whole", "readOnly": True} in mounts
    assert {"name": "adapters", "emptyDir": {}} in ps["volumes"]
    assert {"name": "adapters", "mountPath": "/adapters"} in mounts
    (fetch,) = ps["initContainers"]  # the model itself comes from a PVC
    assert fetch["name"] == "fetch-adapter-1"
    assert fetch["command"][3:] == ["org/chat-lora", "/adapters/chat", "v2", ""]
    assert {"name": "adapters", "mountPath": "/adapters"} in fetch["volumeMounts"]
    no_adapters = im(model={"source": "pvc://weights/llama"})
    assert not yaml.safe_load(render_config_yaml(no_adapters))["lora_modules"]
    assert not yaml.safe_load(render_config_yaml(no_adapters))["enable_lora_runtime_updates"]
    assert not any(v["name"].startswith("adapter") for v in pod_spec(no_adapters)["volumes"])
    assert not yaml.safe_load(render_config_yaml(no_adapters))["allow_lora_updates_without_api_key"]


@pytest.mark.parametrize(
    ("env", "without_key"),
    [
        ([], True),
        ([{"name": "KVPILOT_API_KEY", "value": "k"}], False),
        ([{"name": "KVPILOT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}], False),
        ([{"name": "KVPILOT_API_KEY", "value": ""}], True),  # an empty key is no key (runtime/config.py)
        ([{"name": "OTHER", "value": "k"}], True),
    ],
)
def test_adapter_updates_need_the_pods_api_key_or_the_opt_in(
    env: list[dict[str, Any]], without_key: bool
) -> None:
    """The operator loads adapters into running pods: with an API key in spec.env it sends the key, and
    without one the runtime must be told to answer without a key (its default is 403)."""
    model = im(env=env, adapters=[{"name": "tone", "source": "file:///opt/adapters/tone"}])
    cfg = EngineConfig.model_validate(yaml.safe_load(render_config_yaml(model)))
    assert cfg.enable_lora_runtime_updates
    assert cfg.allow_lora_updates_without_api_key is without_key


def test_prometheus_annotations_and_config_hash() -> None:
    model = im()
    ann = children(model)["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert ann[CONFIG_HASH_ANNOTATION] == config_hash(render_config_yaml(model))


def test_adapter_changes_that_running_pods_can_load_leave_the_pod_template_alone() -> None:
    def template(adapters: list[dict[str, str]]) -> dict[str, Any]:
        return children(im(adapters=adapters))["Deployment"]["spec"]["template"]

    sql = {"name": "sql", "source": "pvc://adapters/sql"}
    base = template([sql])
    # Same claim, another folder; a file:// path: loaded live, no roll.
    assert template([sql, {"name": "tone", "source": "pvc://adapters/tone"}]) == base
    assert template([{"name": "tone", "source": "file:///opt/tone"}, sql]) == base
    # The ConfigMap does carry the new list (a pod that starts later starts with it).
    more = im(adapters=[sql, {"name": "tone", "source": "pvc://adapters/tone"}])
    assert "tone" in yaml.safe_load(children(more)["ConfigMap"]["data"]["config.yaml"])["lora_modules"]
    # A new claim needs a volume, an hf:// adapter an init container; the first adapter turns LoRA on.
    assert template([sql, {"name": "x", "source": "pvc://other/x"}]) != base
    assert template([sql, {"name": "x", "source": "hf://org/x"}]) != base
    assert template([]) != base


def test_config_change_changes_pod_template_hash_but_replicas_do_not() -> None:
    def template(model: InferenceModel) -> dict[str, Any]:
        return render_deployment(model, SETTINGS, render_config_yaml(model))["spec"]["template"]

    base = template(im(replicas=1))
    assert template(im(replicas=5)) == base
    assert template(im(runtime={"maxNumSeqs": 8})) != base


@pytest.mark.parametrize(
    ("spec", "replicas"),
    [
        ({}, 1),
        ({"replicas": 0}, 0),
        ({"replicas": 3}, 3),
        ({"autoscaling": {"maxReplicas": 5}}, 1),
        ({"autoscaling": {"minReplicas": 2, "maxReplicas": 5}}, 2),
        ({"autoscaling": {"minReplicas": 0, "maxReplicas": 5}}, 0),
        ({"autoscaling": {"minReplicas": 1, "maxReplicas": 5}, "replicas": 4}, 4),
        ({"autoscaling": {"minReplicas": 1, "maxReplicas": 3}, "replicas": 7}, 3),  # clamped
    ],
)
def test_desired_replicas(spec: dict[str, Any], replicas: int) -> None:
    model = im(**spec)
    assert desired_replicas(model) == replicas
    assert children(model)["Deployment"]["spec"]["replicas"] == replicas


def test_oom_overrides_cap_the_runtime_config() -> None:
    model = im(runtime={"gpuMemoryUtilization": 0.9, "maxNumSeqs": 64})
    text = render_config_yaml(
        model, OOMOverrides(gpu_memory_utilization=0.85, max_num_seqs=32, max_num_batched_tokens=1024)
    )
    cfg = yaml.safe_load(text)
    assert (cfg["gpu_memory_utilization"], cfg["max_num_seqs"], cfg["max_num_batched_tokens"]) == (
        0.85,
        32,
        1024,
    )


def test_spec_image_and_pull_policy_win_over_settings() -> None:
    c = container(im(image="me/kvpilot:dev", imagePullPolicy="Always"))
    assert (c["image"], c["imagePullPolicy"]) == ("me/kvpilot:dev", "Always")
    c = container(im())
    assert (c["image"], c["imagePullPolicy"]) == ("kvpilot/kvpilot:test", "IfNotPresent")


def test_user_env_tolerations_affinity_priority_pass_through() -> None:
    model = im(
        env=[
            {"name": "A", "value": "1"},
            {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        tolerations=[{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {"x": 1}},
        priorityClassName="inference",
    )
    ps = pod_spec(model)
    env = ps["containers"][0]["env"]
    assert {"name": "A", "value": "1"} in env
    assert {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in env
    assert {"key": "spot", "operator": "Exists", "effect": "NoSchedule"} in ps["tolerations"]
    assert ps["affinity"] == {"nodeAffinity": {"x": 1}}
    assert ps["priorityClassName"] == "inference"


def test_service_and_pdb() -> None:
    out = children(im())
    svc = out["Service"]["spec"]
    assert svc["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["selector"] == {"kvpilot.dev/model": "llama"}
    assert out["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"kvpilot.dev/model": "llama"}},
    }


def test_builders_are_deterministic() -> None:
    assert render_children(im(), SETTINGS) == render_children(im(), SETTINGS)


def test_unset_tensor_parallel_size_uses_every_gpu() -> None:
    cfg = yaml.safe_load(children(im(resources={"gpus": 4}))["ConfigMap"]["data"]["config.yaml"])
    assert cfg["tensor_parallel_size"] == 4
    assert any(v["name"] == "dshm" for v in pod_spec(im(resources={"gpus": 4}))["volumes"])
    cpu = yaml.safe_load(children(im(resources={"gpus": 0}))["ConfigMap"]["data"]["config.yaml"])
    assert cpu["tensor_parallel_size"] == 1
