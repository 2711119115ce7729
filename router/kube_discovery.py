"""Kubernetes discovery: each InferenceModel's Ready pods in a namespace, and its routing policy.

`model_endpoints()` is the pure part: InferenceModels + pods -> {served name: (endpoints, policy,
fallback model, LoRA adapter names, SLO targets, P/D settings)}. A pod labelled `kvpilot.dev/kv-role`
is an endpoint of that role; a model with spec.disaggregation gets its P/D settings (the router then
runs its long prompts on its prefill pods, docs/disaggregation.md).
`KubeSource` lists both through the Kube adapter and tells the router what changed. With watches
(`Watch`: the namespace's pods and InferenceModels; `ApiWatch` on the API server's watch) it lists again
as soon as either changes, and every `resync_s` in any case; while a watch fails (API server down, a
410 Gone, a dropped connection) it lists every `interval_s` until the watch is back. Without watches
it lists every `interval_s`. The state always comes from a full list, so a missed or repeated event
cannot leave a stale endpoint behind, and a failed list keeps every endpoint already known: an
API-server hiccup never empties a model.
The adapter sits behind the `Kube`-like `Lister` protocol so it can move to a shared layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from kvpilot.api.models import (
    API_VERSION,
    KIND,
    KV_ROLE_LABEL,
    KV_ROLES,
    MODEL_LABEL,
    PLURAL,
    Disaggregation,
    KvRole,
)
from kvpilot.api.slo import SloTargets
from kvpilot.router.pd import PdSettings
from kvpilot.router.pool import Endpoint
from kvpilot.router.source import UpdateEndpoints

log = logging.getLogger("kvpilot.router.kube")

HTTP_PORT = 8000
DEFAULT_CAPACITY = 64  # the runtime's default --max-num-seqs

ModelTable = dict[
    str,
    tuple[list[Endpoint], str | None, str | None, tuple[str, ...], SloTargets | None, PdSettings | None],
]


class Lister(Protocol):
    def list(
        self, api_version: str, kind: str, namespace: str | None, selector: str = ""
    ) -> list[dict[str, Any]]: ...


def _is_ready(pod: Mapping[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False  # terminating: draining, takes no new requests
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _port(pod: Mapping[str, Any]) -> int:
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return HTTP_PORT


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def slo_targets(im: Mapping[str, Any]) -> SloTargets | None:
    """The model's SLO: spec.autoscaling.slo's targets with the prefill terms the autoscaler
    publishes in status.autoscaler.slo (absent: 0). None without spec.autoscaling.slo (the router's
    --slo-* flags then), or when the values are not valid targets (logged)."""
    slo = ((im.get("spec") or {}).get("autoscaling") or {}).get("slo")
    if not isinstance(slo, Mapping):
        return None
    published = ((im.get("status") or {}).get("autoscaler") or {}).get("slo")
    published = published if isinstance(published, Mapping) else {}
    fields = {
        "ttft_s": _number(slo.get("ttftSeconds")),
        "tpot_s": _number(slo.get("tpotSeconds")),
        "ttft_prefill_factor": _number(slo.get("ttftPrefillFactor")),
        "prefill_s_per_token": _number(published.get("prefillSecondsPerToken")),
        "prefill_s_per_token_sq": _number(published.get("prefillSecondsPerTokenSquared")),
    }
    try:
        return SloTargets(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as e:
        log.warning(
            "InferenceModel %s: %s; judged with the router's --slo-* targets", im["metadata"]["name"], e
        )
        return None


def disaggregation(im: Mapping[str, Any]) -> Disaggregation | None:
    """spec.disaggregation with its defaults; None without it. A value the CRD should have refused
    is logged and read with the defaults (the model stays disaggregated: its pods have roles)."""
    raw = (im.get("spec") or {}).get("disaggregation")
    if not isinstance(raw, Mapping):
        return None
    try:
        return Disaggregation.model_validate(raw)
    except ValidationError as e:
        log.warning(
            "InferenceModel %s: spec.disaggregation: %s; read with its defaults", im["metadata"]["name"], e
        )
        return Disaggregation.model_validate({})


def _role(pod: Mapping[str, Any]) -> KvRole | None:
    """The pod's P/D role label (another value: no role, an aggregated pod)."""
    role = (pod.get("metadata", {}).get("labels") or {}).get(KV_ROLE_LABEL)
    return next((r for r in KV_ROLES if r == role), None)


def pod_capacity(im: Mapping[str, Any], pd: Disaggregation | None, role: KvRole | None, default: int) -> int:
    """A pod's batch size: its role's maxNumSeqs (spec.disaggregation.<role>.runtime over
    spec.runtime), capped by an OOM adaptation in status (what the pods run now)."""
    own = int(((im.get("spec") or {}).get("runtime") or {}).get("maxNumSeqs") or default)
    runtime = pd.role(role).runtime if pd is not None and role is not None else None
    if runtime is not None and runtime.max_num_seqs:
        own = runtime.max_num_seqs
    oom = ((im.get("status") or {}).get("oomAdaptation") or {}).get("overrides") or {}
    return min(own, int(oom["maxNumSeqs"])) if oom.get("maxNumSeqs") else own


def model_endpoints(
    models: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    default_capacity: int = DEFAULT_CAPACITY,
) -> ModelTable:
    """{served model name: (Ready pods as endpoints, spec.routing.policy, spec.routing.fallbackModel,
    the names of spec.adapters in order, the SLO targets or None, the P/D settings or None)}."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for pod in pods:
        owner = (pod.get("metadata", {}).get("labels") or {}).get(MODEL_LABEL)
        if owner and _is_ready(pod):
            by_model.setdefault(owner, []).append(pod)
    table: ModelTable = {}
    for im in models:
        name = im["metadata"]["name"]
        spec = im.get("spec") or {}
        served = (spec.get("model") or {}).get("servedName") or name
        pd = disaggregation(im)
        endpoints = sorted(
            (
                Endpoint(
                    p["metadata"]["name"],
                    f"http://{p['status']['podIP']}:{_port(p)}",
                    pod_capacity(im, pd, _role(p), default_capacity),
                    _role(p),
                )
                for p in by_model.get(name, [])
            ),
            key=lambda e: e.name,
        )
        routing = spec.get("routing") or {}
        adapters = tuple(str(a["name"]) for a in spec.get("adapters") or [] if a.get("name"))
        table[served] = (
            endpoints,
            routing.get("policy"),
            routing.get("fallbackModel"),
            adapters,
            slo_targets(im),
            None if pd is None else PdSettings(pd.min_prompt_tokens, pd.transfer_timeout_seconds),
        )
    return table


class Watch(Protocol):
    """Change notifications for one kind in the namespace."""

    name: str

    def events(self, timeout_s: float) -> Iterator[str]:
        """Block and yield each event's type (ADDED, MODIFIED, DELETED, BOOKMARK) until timeout_s
        has passed, then return (the caller watches again); raise on any API or connection error."""
        ...


class KubeSource:
    def __init__(
        self,
        kube: Lister,
        namespace: str,
        interval_s: float = 1.0,
        watches: Sequence[Watch] = (),
        resync_s: float = 30.0,
        watch_timeout_s: float = 60.0,
    ) -> None:
        self.kube = kube
        self.namespace = namespace
        self.interval_s = interval_s
        self.watches = tuple(watches)
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.known: ModelTable = {}
        self.lists = 0  # lists done (tests and logs)
        self.watch_events = 0
        self._watch_failing: set[str] = set()
        self._stopping = threading.Event()

    def _list(self) -> ModelTable:
        models = self.kube.list(API_VERSION, KIND, self.namespace)
        pods = self.kube.list("v1", "Pod", self.namespace, MODEL_LABEL) if models else []
        return model_endpoints(models, pods)

    def apply(self, table: ModelTable, update: UpdateEndpoints) -> None:
        for model, entry in table.items():
            if self.known.get(model) != entry:
                update(model, *entry)
        for model in self.known.keys() - table.keys():
            update(model, None)  # the InferenceModel was deleted
        self.known = table

    @property
    def watching(self) -> bool:
        """Every watch is connected: changes come as events, lists only every resync_s."""
        return bool(self.watches) and not self._watch_failing

    def _watch_loop(self, watch: Watch, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        """One watch, in its own thread: every event wakes the lister; an error switches the source
        to polling (and wakes it: what changed during the outage is listed now) until it reconnects.
        Returns when the source stops (at the next event or watch timeout)."""

        def woken() -> bool:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the event loop closed: the router stopped
                return False
            return not self._stopping.is_set()

        while not self._stopping.is_set():
            # optimistic: a watch that connects blocks until an event; one that cannot raises at once
            self._watch_failing.discard(watch.name)
            try:
                for _ in watch.events(self.watch_timeout_s):
                    self.watch_events += 1
                    if not woken():
                        return
            except Exception as e:
                if self._stopping.is_set():
                    return
                if watch.name not in self._watch_failing:
                    log.warning(
                        "watching %s in %s failed (%s); listing every %gs",
                        watch.name,
                        self.namespace,
                        e,
                        self.interval_s,
                    )
                self._watch_failing.add(watch.name)
                if not woken():
                    return
                self._stopping.wait(self.interval_s)

    async def run(self, update: UpdateEndpoints, synced: Callable[[], None]) -> None:
        first = True
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        self._stopping.clear()
        threads = [
            threading.Thread(
                target=self._watch_loop, args=(w, loop, wake), name=f"watch-{w.name}", daemon=True
            )
            for w in self.watches
        ]
        for t in threads:
            t.start()
        try:
            while True:
                wake.clear()  # before the list: an event during it brings another list
                try:
                    table = await asyncio.to_thread(self._list)
                    self.lists += 1
                except Exception as e:  # the adapter already retried; keep what is known and try again
                    log.warning(
                        "listing %s failed (%s); keeping %d models' endpoints",
                        self.namespace,
                        e,
                        len(self.known),
                    )
                    await asyncio.sleep(self.interval_s)
                    continue
                self.apply(table, update)
                if first:
                    synced()
                    first = False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.resync_s if self.watching else self.interval_s)
        finally:
            self._stopping.set()


class ApiWatch:
    """The API server's watch on the namespace's pods of InferenceModels, or its InferenceModels."""

    def __init__(self, api_client: Any, namespace: str, kind: str) -> None:
        from kubernetes import client

        if kind not in ("Pod", KIND):
            raise ValueError(f"cannot watch {kind!r}")
        self.api_client = api_client
        self.namespace = namespace
        self.name = kind
        if kind == "Pod":
            core = client.CoreV1Api(api_client)
            self._list: Callable[..., Any] = core.list_namespaced_pod
            self._args: tuple[Any, ...] = (namespace,)
            self._kwargs: dict[str, Any] = {"label_selector": MODEL_LABEL}
        else:
            group, version = API_VERSION.split("/")
            self._list = client.CustomObjectsApi(api_client).list_namespaced_custom_object
            self._args = (group, version, namespace, PLURAL)
            self._kwargs = {}

    def events(self, timeout_s: float) -> Iterator[str]:
        from kubernetes import watch

        w = watch.Watch()
        try:
            for event in w.stream(
                self._list,
                *self._args,
                timeout_seconds=max(1, int(timeout_s)),
                _request_timeout=timeout_s + 10,
                deserialize=False,  # only the event's type is used
                **self._kwargs,
            ):
                if event.get("type") == "ERROR":  # e.g. 410 Gone: the resource version is too old
                    raise RuntimeError(f"watch error: {event.get('raw_object') or event.get('object')}")
                yield str(event.get("type"))
        finally:
            w.stop()


def kube_source(namespace: str | None, kubeconfig: str | None = None, watch: bool = True) -> KubeSource:
    """A KubeSource on the shared Kube adapter (in-cluster or kubeconfig), watching the namespace's
    pods and InferenceModels unless watch=False (then it lists every second)."""
    from kvpilot.kube.client import ApiKube, load_api_client

    if not namespace:
        raise ValueError("--namespace is required without --endpoints (which namespace's models to route)")
    api_client = load_api_client(kubeconfig)
    watches = [ApiWatch(api_client, namespace, "Pod"), ApiWatch(api_client, namespace, KIND)] if watch else []
    return KubeSource(ApiKube(api_client), namespace, watches=watches)
