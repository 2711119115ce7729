"""Pure builders: an InferenceModel (plus operator settings) -> the desired child manifests.

Nothing here talks to the API server; every function is a plain function of its arguments so the
manifests can be table-tested. `render_children()` is the one entry point the reconciler uses.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvpilot.api.models import (
    API_VERSION,
    GPU_TYPE_LABEL,
    KIND,
    MODEL_LABEL,
    InferenceModel,
    InferenceModelSpec,
    LoRAAdapter,
    OOMOverrides,
    RuntimeSettings,
)
from kvpilot.operator.quantity import parse_bytes
from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig

FIELD_MANAGER = "kvpilot-operator"
CONFIG_MOUNT_DIR = "/etc/kvpilot"
CONFIG_FILE = "config.yaml"
CONFIG_PATH = f"{CONFIG_MOUNT_DIR}/{CONFIG_FILE}"
MODELS_DIR = "/models"
ADAPTERS_DIR = "/adapters"  # LoRA adapters: /adapters/<name> (fetched from hf://)
ADAPTER_CLAIMS_DIR = f"{ADAPTERS_DIR}/.pvc"  # each adapter claim mounted once: /adapters/.pvc/<claim>
HTTP_PORT = 8000
API_KEY_ENV = "KVPILOT_API_KEY"  # the runtime's API key; spec.env may set it
GPU_RESOURCE = "nvidia.com/gpu"
CONFIG_HASH_ANNOTATION = "kvpilot.dev/config-hash"
APPLIED_HASH_ANNOTATION = "kvpilot.dev/applied-hash"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvpilot-operator"
RUN_AS_USER = 10001  # the runtime images (deploy/docker) run as this uid

# Probes: a 70B model can take many minutes to load, so startup gets 30 minutes
# (failureThreshold * periodSeconds) before liveness takes over.
STARTUP_PERIOD_S = 10
STARTUP_FAILURE_THRESHOLD = 180
PRESTOP_SLEEP_S = 5  # let endpoints controllers and load balancers drop the pod before SIGTERM
# After the shutdown timeout: more than the runtime's EXIT_GRACE_S, so `kvpilot serve` always ends
# itself (logging why, if its engine is stuck) before the kubelet's SIGKILL.
TERMINATION_MARGIN_S = 15
# Liveness: /health itself fails only once the engine loop has made no progress for
# --engine-stall-timeout (default 60 s) while it has work, so the probe's own window (3 x 10 s) only
# rides out a slow answer or two: a stuck engine is restarted within stall timeout + 30 s. Readiness
# (/ready, 3 x 5 s) takes a draining, loading or stuck pod out of the Service.
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURE_THRESHOLD = 3
DEFAULT_SHUTDOWN_TIMEOUT_S = int(EngineConfig.model_fields["shutdown_timeout"].default)
# spec.engine: vllm without spec.image (`kvpilot operator --vllm-image / --vllm-cpu-image`): vLLM's
# release images, the CUDA one for GPU pods and the x86 CPU build for pods with resources.gpus 0.
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
DEFAULT_VLLM_CPU_IMAGE = "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator adds to every InferenceModel (from its command line)."""

    image: str = "kvpilot/kvpilot:0.1.0"
    vllm_image: str = DEFAULT_VLLM_IMAGE
    vllm_cpu_image: str = DEFAULT_VLLM_CPU_IMAGE
    image_pull_policy: str = "IfNotPresent"
    service_monitor: bool = False  # render a ServiceMonitor (the monitoring.coreos.com CRD exists)
    extra_labels: dict[str, str] = field(default_factory=dict)
    # namespace -> base URL of the `kvpilot router` serving that namespace's models (status.routerEndpoint)
    router_endpoints: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# names, labels, hashes
# ---------------------------------------------------------------------------------------------


def selector_labels(name: str) -> dict[str, str]:
    """Labels that select a model's pods (immutable Deployment selector; Service; PDB; scale)."""
    return {MODEL_LABEL: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def common_labels(im: InferenceModel, settings: OperatorSettings | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "kvpilot",
        "app.kubernetes.io/instance": im.name,
        "app.kubernetes.io/component": "inference",
        MANAGED_BY_LABEL: MANAGED_BY,
        **selector_labels(im.name),
    }
    if settings:
        labels = {**settings.extra_labels, **labels}
    return labels


def config_map_name(name: str) -> str:
    return f"{name}-config"


def endpoint(name: str, namespace: str) -> str:
    return f"http://{name}.{namespace}.svc:{HTTP_PORT}/v1"


def stable_hash(obj: Any, length: int = 16) -> str:
    """A short content hash of a JSON-able object (key order does not matter)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(data).hexdigest()[:length]


def owner_reference(im: InferenceModel) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": im.name,
        "uid": im.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(im: InferenceModel, name: str, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": im.namespace,
        "labels": common_labels(im, settings),
        "ownerReferences": [owner_reference(im)],
    }


# ---------------------------------------------------------------------------------------------
# runtime config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HfSource:
    """hf://ORG/NAME[@REVISION][:QUANT], parsed (the API's pattern has validated it)."""

    repo: str
    revision: str  # "" for the default branch
    quant: str  # "" for the whole repository


def hf_source(source: str) -> HfSource:
    rest, _, quant = source.removeprefix("hf://").partition(":")  # neither repo nor revision has one
    repo, _, revision = rest.partition("@")
    return HfSource(repo, revision, quant)


def model_path(source: str) -> str:
    """Where the runtime finds the weights inside the pod, for each source scheme."""
    scheme, _, rest = source.partition("://")
    if scheme == "builtin":
        return rest or DEFAULT_MODEL
    if scheme == "pvc":
        _claim, _, path = rest.partition("/")
        return f"{MODELS_DIR}/{path}".rstrip("/") if path else MODELS_DIR
    if scheme == "hf":
        return f"{MODELS_DIR}/{hf_source(source).repo.replace('/', '--')}"
    if scheme == "file":
        return rest  # file:///abs -> /abs
    raise ValueError(f"unsupported model source {source!r}")


def adapter_path(adapter: LoRAAdapter) -> str:
    """Where the runtime finds a LoRA adapter's folder inside the pod, for each source scheme."""
    scheme, _, rest = adapter.source.partition("://")
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        base = f"{ADAPTER_CLAIMS_DIR}/{claim}"
        return f"{base}/{path}".rstrip("/") if path else base
    if scheme == "hf":
        return f"{ADAPTERS_DIR}/{adapter.name}"
    if scheme == "file":
        return rest
    raise ValueError(f"unsupported adapter source {adapter.source!r}")


def effective_runtime(runtime: RuntimeSettings, overrides: OOMOverrides | None) -> dict[str, Any]:
    """spec.runtime (snake_case, set fields only) capped by the OOM adaptation overrides (all but
    `memory`, which is the pod's, not the runtime's)."""
    rt = runtime.model_dump(exclude_none=True)
    if overrides is not None:
        for key, value in overrides.model_dump(exclude_none=True, exclude={"memory"}).items():
            default = EngineConfig.model_fields[key].default
            rt[key] = value if rt.get(key, default) is None else min(rt.get(key, default), value)
    return rt


def adapter_claims(im: InferenceModel) -> list[str]:
    """The claims that pvc:// adapters live on, each once, sorted (one pod volume each)."""
    claims = {
        a.source.removeprefix("pvc://").partition("/")[0]
        for a in im.spec.adapters or []
        if a.source.startswith("pvc://")
    }
    return sorted(claims)


def adapter_claim_volume(claim: str) -> str:
    """The pod volume of one adapter claim: named after the claim, never after a list position, so
    adding or removing another adapter leaves the pod template alone."""
    return f"adapters-{stable_hash(claim, 10)}"


def render_engine_config(im: InferenceModel, overrides: OOMOverrides | None = None) -> EngineConfig:
    """The runtime's EngineConfig for this model (validated by the runtime's own schema)."""
    if overrides is not None and overrides.kv_cache_memory is not None and im.spec.resources.gpus > 0:
        # Made for a CPU pod's host memory; a GPU pod sizes its pool from gpuMemoryUtilization.
        overrides = overrides.model_copy(update={"kv_cache_memory": None})
    rt = effective_runtime(im.spec.runtime, overrides)
    shutdown = rt.pop("shutdown_timeout_seconds", None)
    values: dict[str, Any] = {
        "model": model_path(im.spec.model.source),
        "served_model_name": im.spec.model.served_name or im.name,
        "host": "0.0.0.0",
        "port": HTTP_PORT,
        "device": "cuda" if im.spec.resources.gpus > 0 else "cpu",
        **rt,
        # Unset tensorParallelSize shards over every GPU the pod gets (the CRD refuses a mismatch).
        "tensor_parallel_size": im.spec.effective_tensor_parallel_size(),
    }
    if shutdown is not None:
        values["shutdown_timeout"] = float(shutdown)
    if im.spec.adapters:
        values["lora_modules"] = {a.name: adapter_path(a) for a in im.spec.adapters}
        # The operator loads and unloads adapters in running pods (operator/adapters.py), with the
        # pods' API key; a model without one opts in to updates without a key, or its loads would get 403.
        values["enable_lora_runtime_updates"] = True
        if not sets_api_key(im):
            values["allow_lora_updates_without_api_key"] = True
    return EngineConfig.model_validate(values)


def sets_api_key(im: InferenceModel) -> bool:
    """Whether spec.env gives the runtime an API key: KVPILOT_API_KEY with a value or a valueFrom."""
    return any(
        var.name == API_KEY_ENV and (var.value_from is not None or bool(var.value))
        for var in im.spec.env or []
    )


def render_config_yaml(im: InferenceModel, overrides: OOMOverrides | None = None) -> str:
    """The model server's config file: kvpilot's EngineConfig, or vLLM's (engine vllm)."""
    if im.spec.engine == "vllm":
        from kvpilot.operator.vllm_pod import vllm_config_yaml  # it builds on this module

        return vllm_config_yaml(im, overrides)
    return render_engine_config(im, overrides).to_yaml()


def rollout_config_yaml(im: InferenceModel, overrides: OOMOverrides | None = None) -> str:
    """The part of the runtime config that rolls the pods when it changes: all of it but the adapter
    list, which the operator brings running pods in line with through the runtime's API (the ConfigMap
    still carries the list, so a pod that starts later starts with it)."""
    if im.spec.engine == "vllm":
        from kvpilot.operator.vllm_pod import vllm_config_yaml  # it builds on this module

        return vllm_config_yaml(im, overrides, adapters=False)
    config = render_engine_config(im, overrides)
    return config.model_copy(update={"lora_modules": {}}).to_yaml()


def config_hash(config_yaml: str, overrides: OOMOverrides | None = None) -> str:
    """What the pods of one config share (their config-hash annotation): the runtime's config file, and
    the memory an OOM adaptation gave them (left out when there is none, so such hashes never moved)."""
    memory = overrides.memory if overrides is not None else None
    text = config_yaml if memory is None else f"{config_yaml}\n# resources.memory: {memory}\n"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def effective_memory(spec: InferenceModelSpec, overrides: OOMOverrides | None) -> str | None:
    """spec.resources.memory, raised to the OOM adaptation's value when that is larger."""
    spec_memory = spec.resources.memory
    raised = overrides.memory if overrides is not None else None
    if raised is None or (spec_memory is not None and parse_bytes(spec_memory) >= parse_bytes(raised)):
        return spec_memory
    return raised


def render_config_map(im: InferenceModel, settings: OperatorSettings, config_yaml: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(im, config_map_name(im.name), settings),
        "data": {CONFIG_FILE: config_yaml},
    }


def desired_replicas(im: InferenceModel) -> int:
    """The Deployment's replicas: spec.replicas, else autoscaling.minReplicas, else 1; clamped to bounds."""
    spec = im.spec
    if spec.autoscaling is None:
        return 1 if spec.replicas is None else spec.replicas
    a = spec.autoscaling
    replicas = a.min_replicas if spec.replicas is None else spec.replicas
    return max(a.min_replicas, min(a.max_replicas, replicas))


def termination_grace_seconds(im: InferenceModel) -> int:
    shutdown = im.spec.runtime.shutdown_timeout_seconds
    if shutdown is None:
        shutdown = DEFAULT_SHUTDOWN_TIMEOUT_S
    return PRESTOP_SLEEP_S + shutdown + TERMINATION_MARGIN_S


def _env(im: InferenceModel) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
        {"name": "HF_HOME", "value": f"{MODELS_DIR}/.hf" if _is_hf(im) else "/tmp/.cache/huggingface"},
    ]
    secret = im.spec.model.hf_token_secret
    if secret is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}
        )
    for var in im.spec.env or []:
        env.append(var.dump())
    return env


def _is_hf(im: InferenceModel) -> bool:
    return im.spec.model.source.startswith("hf://")


def _resources(im: InferenceModel, overrides: OOMOverrides | None) -> dict[str, Any]:
    r = im.spec.resources
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    memory = effective_memory(im.spec, overrides)
    if r.cpu:
        requests["cpu"] = r.cpu
    if memory:
        requests["memory"] = memory
        limits["memory"] = memory
    if r.gpus > 0:
        requests[GPU_RESOURCE] = str(r.gpus)
        limits[GPU_RESOURCE] = str(r.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _volumes(im: InferenceModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts of the runtime container)."""
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(im.name)}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    scheme, _, rest = im.spec.model.source.partition("://")
    if scheme == "pvc":
        claim = rest.partition("/")[0]
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR, "readOnly": True})
    elif scheme == "hf":
        volumes.append({"name": "model", "emptyDir": {}})
        mounts.append({"name": "model", "mountPath": MODELS_DIR})
    adapters = im.spec.adapters or []
    if any(a.source.startswith("hf://") for a in adapters):
        volumes.append({"name": "adapters", "emptyDir": {}})
        mounts.append({"name": "adapters", "mountPath": ADAPTERS_DIR})
    for claim in adapter_claims(im):
        volume = adapter_claim_volume(claim)
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": volume, "mountPath": f"{ADAPTER_CLAIMS_DIR}/{claim}", "readOnly": True})
    if im.spec.effective_tensor_parallel_size() > 1 or im.spec.engine == "vllm":
        # NCCL and torch.distributed need a larger /dev/shm than the container default of 64 MiB, and
        # so do vLLM's processes (its engine and workers talk through shared memory).
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probe(path: str, period: int, failure: int, timeout: int = 5) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failure,
        "timeoutSeconds": timeout,
    }


# Runs in the runtime image, whose tokenizers dependency brings huggingface_hub; the Python API is
# stable across huggingface_hub versions (its CLI was renamed from huggingface-cli to hf). A GGUF
# repository (no config.json, several .gguf files, often tens of GB of quantizations) is fetched one
# model at a time: QUANT (hf://ORG/NAME:QUANT) picks the file whose name ends in -QUANT.gguf or
# .QUANT.gguf, case aside, or every part of a split one (-QUANT-00001-of-00003.gguf, ...); without QUANT
# a repository of several models is refused before anything is downloaded, the message naming its files.
# A fetch that writes nothing for KVPILOT_FETCH_STALL_S (spec.env; default 120 s) exits 1 saying so: the
# client's listing calls have no timeout of their own, and a mirror or proxy that accepts and never
# answers held the pod in Init forever (the kubelet retries a failed init container with backoff).
# Exit status 1 with the message on stderr: the pod's init container fails.
FETCH_SCRIPT = """\
import os, re, sys, threading, time
from huggingface_hub import HfApi, snapshot_download
repo, dest, revision, quant = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4]
try:
    stall = float(os.environ.get('KVPILOT_FETCH_STALL_S') or 120)
except ValueError:
    stall = 0.0
if not stall > 0:
    sys.exit(f'KVPILOT_FETCH_STALL_S: expected seconds > 0, got {os.environ["KVPILOT_FETCH_STALL_S"]!r}')
def written():  # the download's files, and the client's own cache (HF_HOME: the Xet chunks)
    return sum(os.path.getsize(os.path.join(d, n)) for top in {dest, os.environ.get('HF_HOME') or dest}
               for d, _, names in os.walk(top) for n in names if os.path.isfile(os.path.join(d, n)))
def watchdog():  # the Hub client's listing calls have no timeout: a mirror that never answers hangs them
    last, since = -1, time.monotonic()
    while True:
        time.sleep(min(5.0, stall / 4))
        size = written()
        if size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since > stall:
            print(f'hf://{repo}: no progress for {stall:g}s from {os.environ.get("HF_ENDPOINT") or "https://huggingface.co"} '
                  f'({size} bytes written); giving up (KVPILOT_FETCH_STALL_S sets the limit)', file=sys.stderr, flush=True)
            os._exit(1)
threading.Thread(target=watchdog, daemon=True).start()
patterns = None
files = HfApi().list_repo_files(repo, revision=revision)
ggufs = sorted(f for f in files if f.lower().endswith('.gguf'))
part = re.compile('-[0-9]{5}-of-[0-9]{5}[.]gguf$', re.IGNORECASE)
def models(names):  # a split model's parts (NAME-00001-of-00003.gguf, ...) are one model
    return sorted({part.sub('.gguf', n) for n in names})
if quant:
    tag = re.compile('[-.]' + re.escape(quant) + '(-[0-9]{5}-of-[0-9]{5})?[.]gguf$', re.IGNORECASE)
    patterns = [f for f in ggufs if tag.search(f)]
    if len(models(patterns)) != 1:
        sys.exit(f'hf://{repo}: {len(models(patterns))} .gguf models end in -{quant}.gguf or .{quant}.gguf '
                 f'({", ".join(patterns) or "none"}); the repository has: {", ".join(ggufs) or "no .gguf file"}')
elif 'config.json' not in files and len(models(ggufs)) > 1:
    sys.exit(f'hf://{repo} holds {len(models(ggufs))} .gguf models ({", ".join(ggufs)}): '
             f'name one as hf://{repo}:QUANT, e.g. :Q4_K_M for *-Q4_K_M.gguf')
snapshot_download(repo_id=repo, local_dir=dest, revision=revision, allow_patterns=patterns)
print('fetched', repo, revision or 'main', *(patterns or []), 'into', dest)
"""


def _fetch_init_container(
    im: InferenceModel,
    image: str,
    pull_policy: str,
    source: str | None = None,
    name: str = "fetch-model",
    volume: tuple[str, str, str] | None = None,
    python: str = "python",
) -> dict[str, Any]:
    """Download hf:// weights (the model's, or `source` into `dest` for an adapter) into their volume
    before the runtime starts. `volume`: (volume name, mount path, destination). The container gets the
    runtime's environment, spec.env included: that is where a cluster names its Hub mirror
    (HF_ENDPOINT), its proxy (HTTPS_PROXY, NO_PROXY) and its CA bundle (REQUESTS_CA_BUNDLE), which the
    download needs more than the runtime does."""
    hf = hf_source(source or im.spec.model.source)
    volume_name, mount, dest = volume or ("model", MODELS_DIR, model_path(im.spec.model.source))
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": [python, "-c", FETCH_SCRIPT, hf.repo, dest, hf.revision, hf.quant],
        "terminationMessagePolicy": "FallbackToLogsOnError",  # its error, in the status (podstate.py)
        "env": _env(im),
        "volumeMounts": [
            {"name": volume_name, "mountPath": mount},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": _container_security(),
    }


def _init_containers(im: InferenceModel, image: str, pull_policy: str) -> list[dict[str, Any]]:
    """One fetch per hf:// source: the model's, then each adapter's (in the pod's image: vLLM's images
    have huggingface_hub too, and name their interpreter python3)."""
    python = "python3" if im.spec.engine == "vllm" else "python"
    out = []
    if _is_hf(im):
        out.append(_fetch_init_container(im, image, pull_policy, python=python))
    for i, adapter in enumerate(im.spec.adapters or []):
        if adapter.source.startswith("hf://"):
            volume = ("adapters", ADAPTERS_DIR, adapter_path(adapter))
            out.append(
                _fetch_init_container(
                    im, image, pull_policy, adapter.source, f"fetch-adapter-{i}", volume, python
                )
            )
    return out


def render_deployment(
    im: InferenceModel, settings: OperatorSettings, config_yaml: str, overrides: OOMOverrides | None = None
) -> dict[str, Any]:
    spec = im.spec
    image = spec.image or settings.image
    pull_policy = spec.image_pull_policy or settings.image_pull_policy
    volumes, mounts = _volumes(im)
    labels = common_labels(im, settings)
    if spec.engine == "vllm":
        from kvpilot.operator import vllm_pod  # it builds on this module

        image = vllm_pod.vllm_image(im, settings.vllm_image, settings.vllm_cpu_image)

    container: dict[str, Any] = {
        "name": "kvpilot",
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": ["kvpilot", "serve", "--config", CONFIG_PATH, *(spec.extra_args or [])],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": _env(im),
        "resources": _resources(im, overrides),
        "volumeMounts": mounts,
        "startupProbe": _http_probe("/health", STARTUP_PERIOD_S, STARTUP_FAILURE_THRESHOLD),
        "readinessProbe": _http_probe("/ready", 5, 3),
        "livenessProbe": _http_probe("/health", LIVENESS_PERIOD_S, LIVENESS_FAILURE_THRESHOLD),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        # The last log lines become the termination message, so a CUDA OOM at start is visible in status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
    }
    if spec.engine == "vllm":
        # `vllm serve --config` (the ConfigMap's file), vLLM's environment; its /health is the probe
        # of all three (it answers only once the model is loaded, and fails when the engine died).
        container.update(
            name=vllm_pod.CONTAINER_NAME,
            command=vllm_pod.vllm_command(im),
            env=vllm_pod.vllm_env(im, container["env"]),
            readinessProbe=_http_probe("/health", 5, 3),
        )

    node_selector = dict(spec.node_selector or {})
    if spec.resources.gpu_type:
        node_selector[GPU_TYPE_LABEL] = spec.resources.gpu_type
    tolerations = [t.dump() for t in spec.tolerations or []]
    if spec.resources.gpus > 0:
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(im),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    init_containers = _init_containers(im, image, pull_policy)
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name

    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(im, im.name, settings),
        "spec": {
            "replicas": desired_replicas(im),
            "selector": {"matchLabels": selector_labels(im.name)},
            "strategy": {
                # Replace in place: a rollout never needs a spare GPU.
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
            },
            "revisionHistoryLimit": 3,
            # Longer than the startup probe's window, so a slow load is not called a failed rollout.
            "progressDeadlineSeconds": STARTUP_PERIOD_S * STARTUP_FAILURE_THRESHOLD + 600,
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: config_hash(rollout_config_yaml(im, overrides), overrides),
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(HTTP_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def render_service(im: InferenceModel, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(im, im.name, settings),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(im.name),
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def render_pdb(im: InferenceModel, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(im, im.name, settings),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(im.name)}},
    }


def render_service_monitor(im: InferenceModel, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(im, im.name, settings),
        "spec": {
            "selector": {"matchLabels": {**selector_labels(im.name), MANAGED_BY_LABEL: MANAGED_BY}},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def render_children(
    im: InferenceModel, settings: OperatorSettings, overrides: OOMOverrides | None = None
) -> list[dict[str, Any]]:
    """Every child of one InferenceModel, in apply order (config before the pods that mount it)."""
    config_yaml = render_config_yaml(im, overrides)
    children = [
        render_config_map(im, settings, config_yaml),
        render_deployment(im, settings, config_yaml, overrides),
        render_service(im, settings),
        render_pdb(im, settings),
    ]
    if settings.service_monitor:
        children.append(render_service_monitor(im, settings))
    return children


def manifest_yaml(children: list[dict[str, Any]]) -> str:
    """Multi-document YAML (for `kvpilot operator --dry-run`-style inspection and docs)."""
    return yaml.safe_dump_all(children, sort_keys=False)
