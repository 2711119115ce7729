"""One reconcile of one InferenceModel: read the world, render, apply what differs, derive status.

Level-triggered: the outcome depends only on the InferenceModel, its children and its pods as they
are now, never on which event woke us, so running it twice in a row is the same as running it once
(the second run writes nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from kvpilot.api.models import (
    API_VERSION,
    KIND,
    KV_ROLES,
    InferenceModel,
    InferenceModelSpec,
    KvRole,
    OOMAdaptation,
    name_problems,
)
from kvpilot.kube.client import Kube
from kvpilot.kube.events import event_manifest
from kvpilot.operator import inferencepool as pool
from kvpilot.operator import metrics, oom
from kvpilot.operator.adapters import AdapterClient, AdapterSync, HttpAdapterClient, api_key_of, sync_adapters
from kvpilot.operator.apply import apply_child
from kvpilot.operator.builders import (
    OperatorSettings,
    config_hash,
    render_children,
    rollout_config_yaml,
    selector_string,
)
from kvpilot.operator.podstate import PodProblem, all_problems, fetching
from kvpilot.operator.roles import (
    ROLE_KINDS,
    controller_elsewhere,
    merge_adapter_syncs,
    pod_role,
    render_role_children,
    role_model,
    role_name,
    stale_children,
)
from kvpilot.operator.rolestatus import compute_roles_status
from kvpilot.operator.status import (
    Cond,
    EventSpec,
    compute_status,
    condition_events,
    invalid_status,
    status_patch,
)

log = logging.getLogger(__name__)
SERVICE_MONITOR_API = "monitoring.coreos.com/v1"
API_RECHECK_S = 300.0  # how long a discovery answer (an optional API exists or not) is trusted


def utcnow() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


@dataclass
class Outcome:
    """What one reconcile did (for logs, metrics and tests)."""

    applied: list[str] = field(default_factory=list)  # "Kind/name" written
    skipped: list[str] = field(default_factory=list)  # "Kind/name" already as desired
    deleted: list[str] = field(default_factory=list)  # "Kind/name" removed (a disabled InferencePool)
    status_patch: dict[str, Any] | None = None
    events: list[EventSpec] = field(default_factory=list)
    invalid: str | None = None

    @property
    def wrote(self) -> bool:
        return bool(self.applied or self.deleted or self.status_patch or self.events)


def spec_problem(spec: dict[str, Any]) -> tuple[InferenceModelSpec | None, str | None]:
    """Parse spec; (spec, None) when usable, (None, why) when not."""
    try:
        parsed = InferenceModelSpec.model_validate(spec)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return None, f"spec.{where}: {first['msg']}"
    problems = parsed.check()
    if problems:
        return None, "; ".join(problems)
    return parsed, None


def api_message(e: ApiException) -> str:
    """The API server's own message from an error response."""
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except (ValueError, AttributeError):
        return str(e.reason)


def oom_events(decision: oom.OOMDecision) -> list[EventSpec]:
    if decision.adapted:
        metrics.OOM_ADAPTATIONS.inc()
        return [EventSpec("Warning", "OOMAdapted", oom.describe(decision))]
    if decision.exhausted:
        return [EventSpec("Warning", "OOMAdaptationExhausted", oom.describe(decision))]
    return []


@dataclass
class Applied:
    """The children one reconcile applied (live objects), and what the API server refused."""

    objects: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)


def oom_note(spec: InferenceModelSpec, decision: oom.OOMDecision) -> str:
    if decision.ooms:
        return oom.describe(decision)
    state = decision.state
    if not spec.oom_policy.adapt:
        return (
            "set spec.oomPolicy.adapt: true to let the operator adapt the setting that matches the cause "
            "(GPU settings after a CUDA OOM, memory or the KV pool after an OOMKilled), or give each "
            "replica more memory"
        )
    if state is not None and state.count:
        return f"adapted {state.count} time(s); last step: " + ", ".join(
            f"{k} {v}" for k, v in (state.changes or {}).items()
        )
    return "waiting for an OOM of the current config to adapt"


class Reconciler:
    """Reconciles InferenceModels through a `Kube`."""

    def __init__(
        self,
        kube: Kube,
        settings: OperatorSettings,
        *,
        clock: Callable[[], datetime] = utcnow,
        identity: str = "kvpilot-operator",
        adapter_client: AdapterClient | None = None,
    ) -> None:
        self.kube = kube
        self.adapter_client: AdapterClient = adapter_client or HttpAdapterClient()
        self.settings = settings
        self.clock = clock
        self.identity = identity
        self._apis: dict[str, tuple[float, bool]] = {}  # group/version -> (checked at, available)

    # -- helpers ------------------------------------------------------------------------------

    def api_available(self, group_version: str) -> bool:
        """Whether an optional API (monitoring.coreos.com, inference.networking.k8s.io) is served,
        re-checked every few minutes."""
        now = time.monotonic()
        checked_at, available = self._apis.get(group_version, (-1e9, False))
        if now - checked_at > API_RECHECK_S:
            try:
                available = self.kube.has_api(group_version)
            except Exception:  # discovery trouble must not block the reconcile
                log.warning("could not check for %s; assuming absent", group_version, exc_info=True)
                available = False
            self._apis[group_version] = (now, available)
        return available

    def service_monitor_available(self) -> bool:
        return self.api_available(SERVICE_MONITOR_API)

    def post_event(self, body: dict[str, Any], event: EventSpec) -> None:
        md = body["metadata"]
        obj = event_manifest(
            body,
            reason=event.reason,
            message=event.message,
            event_type=event.type,
            component="kvpilot-operator",
            reporting_component="kvpilot.dev/operator",
            reporting_instance=self.identity,
            now=self.clock(),
        )
        try:
            self.kube.create(obj)
            metrics.EVENTS.labels(event.type, event.reason).inc()
        except Exception:  # an Event is best effort; the condition already says it
            log.warning(
                "could not post event %s for %s/%s", event.reason, md["namespace"], md["name"], exc_info=True
            )

    # -- the reconcile ------------------------------------------------------------------------

    def reconcile(self, body: dict[str, Any]) -> Outcome:
        start = time.perf_counter()
        try:
            outcome = self._reconcile(body)
        except Exception:
            metrics.RECONCILES.labels("error").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - start)
        metrics.RECONCILES.labels("changed" if outcome.wrote else "unchanged").inc()
        return outcome

    def _reconcile(self, body: dict[str, Any]) -> Outcome:
        md = body["metadata"]
        name, namespace = md["name"], md["namespace"]
        outcome = Outcome()
        if md.get("deletionTimestamp"):
            return outcome  # children go with it (owner references)
        now = self.clock()
        live_status: dict[str, Any] = body.get("status") or {}

        spec, invalid = spec_problem(body.get("spec") or {})
        bad_name = name_problems(name)  # stored before the CRD refused such names
        if bad_name:
            spec, invalid = None, "; ".join(bad_name)
        if spec is None:
            outcome.invalid = invalid
            desired = invalid_status(
                name, namespace, int(md.get("generation") or 0), str(invalid), now=now, previous=live_status
            )
            self._write_status(body, live_status, desired, outcome, [])
            return outcome

        im = InferenceModel(metadata=md, spec=spec)
        pods = self.kube.list("v1", "Pod", namespace, selector_string(name))
        settings = self.settings
        service_monitor = self.service_monitor_available()
        if service_monitor != settings.service_monitor:
            settings = dataclasses.replace(settings, service_monitor=service_monitor)
        if spec.disaggregation is not None:
            self._reconcile_roles(body, im, settings, pods, live_status, now, outcome)
            return outcome
        state = (
            OOMAdaptation.model_validate(live_status["oomAdaptation"])
            if live_status.get("oomAdaptation")
            else None
        )
        problems = all_problems(pods, now)

        current = oom.current_overrides(spec, state)
        chash = config_hash(rollout_config_yaml(im, current), current)
        decision = oom.decide(spec, state, problems, chash)
        extra_events = oom_events(decision)

        children = render_children(im, settings, decision.overrides)
        applied = self._apply_children(im, children, outcome)
        deployment = next((obj for obj in applied.objects if obj["kind"] == "Deployment"), None)
        if live_status.get("roles"):  # it was disaggregated: remove the roles' children
            self._delete_stale(im, children, outcome)

        pool_condition = self.sync_inference_pool(im, settings, live_status, outcome)
        adapter_sync = None
        if spec.adapters:
            applied_hash = config_hash(rollout_config_yaml(im, decision.overrides), decision.overrides)
            adapter_sync = self.sync_adapters(im, pods, applied_hash)
            if adapter_sync.changed:
                log.info("%s/%s: adapters: %s", namespace, name, ", ".join(adapter_sync.changed))
        desired = compute_status(
            im,
            deployment,
            problems,
            now=now,
            previous=live_status,
            oom=decision.state,
            oom_note=oom_note(spec, decision),
            apply_error="; ".join(applied.errors) or None,
            router_endpoint=settings.router_endpoints.get(namespace),
            refused=frozenset(applied.refused),
            adapters=adapter_sync,
            inference_pool=pool_condition,
            fetching=fetching(pods),
        )
        self._write_status(body, live_status, desired, outcome, extra_events)
        if outcome.applied:
            log.info("%s/%s: applied %s", namespace, name, ", ".join(outcome.applied))
        return outcome

    def _reconcile_roles(
        self,
        body: dict[str, Any],
        im: InferenceModel,
        settings: OperatorSettings,
        pods: list[dict[str, Any]],
        live_status: dict[str, Any],
        now: datetime,
        outcome: Outcome,
    ) -> None:
        """A disaggregated model (operator/roles.py): each role's pods, OOM adaptation and status as an
        aggregated model's, one Service over both."""
        live_roles = live_status.get("roles") or {}
        decisions: dict[KvRole, oom.OOMDecision] = {}
        problems: dict[KvRole, list[PodProblem]] = {}
        hashes: dict[KvRole, str] = {}
        extra_events: list[EventSpec] = []
        role_pods = {role: [p for p in pods if pod_role(p) == role] for role in KV_ROLES}
        for role in KV_ROLES:
            rim = role_model(im, role)
            raw = (live_roles.get(role) or {}).get("oomAdaptation")
            state = OOMAdaptation.model_validate(raw) if raw else None
            problems[role] = all_problems(role_pods[role], now)
            current = oom.current_overrides(rim.spec, state)
            chash = config_hash(rollout_config_yaml(rim, current), current)
            decisions[role] = oom.decide(rim.spec, state, problems[role], chash)
            overrides = decisions[role].overrides
            hashes[role] = config_hash(rollout_config_yaml(rim, overrides), overrides)
            extra_events += [
                EventSpec(e.type, e.reason, f"{role}: {e.message}") for e in oom_events(decisions[role])
            ]

        children = render_role_children(im, settings, {r: d.overrides for r, d in decisions.items()})
        applied = self._apply_children(im, children, outcome)
        deployments: dict[KvRole, dict[str, Any] | None] = {
            role: next(
                (
                    o
                    for o in applied.objects
                    if o["kind"] == "Deployment" and o["metadata"]["name"] == role_name(im.name, role)
                ),
                None,
            )
            for role in KV_ROLES
        }
        if not live_status.get("roles"):  # new, or it was aggregated: remove the aggregated children
            self._delete_stale(im, children, outcome)

        pool_condition = self.sync_inference_pool(im, settings, live_status, outcome)
        adapter_sync = None
        if im.spec.adapters:
            adapter_sync = merge_adapter_syncs(
                [self.sync_adapters(role_model(im, role), role_pods[role], hashes[role]) for role in KV_ROLES]
            )
        desired = compute_roles_status(
            im,
            deployments,
            problems,
            now=now,
            previous=live_status,
            oom={role: d.state for role, d in decisions.items()},
            oom_notes={role: oom_note(role_model(im, role).spec, d) for role, d in decisions.items()},
            apply_error="; ".join(applied.errors) or None,
            router_endpoint=settings.router_endpoints.get(im.namespace),
            refused=frozenset(applied.refused),
            adapters=adapter_sync,
            inference_pool=pool_condition,
            fetching={role: fetching(role_pods[role]) for role in KV_ROLES},
        )
        self._write_status(body, live_status, desired, outcome, extra_events)
        if outcome.applied or outcome.deleted:
            log.info(
                "%s/%s: applied %s; deleted %s",
                im.namespace,
                im.name,
                ", ".join(outcome.applied) or "nothing",
                ", ".join(outcome.deleted) or "nothing",
            )

    def _apply_children(
        self, im: InferenceModel, children: list[dict[str, Any]], outcome: Outcome
    ) -> Applied:
        """Apply each child that differs; the API server's refusals (and a child another InferenceModel
        controls) are collected for the status, not raised."""
        applied = Applied()
        for child in children:
            md = child["metadata"]
            ref = f"{child['kind']}/{md['name']}"
            try:
                live = self.kube.get(child["apiVersion"], child["kind"], md["namespace"], md["name"])
                other = controller_elsewhere(live, im)
                if other is not None:
                    applied.errors.append(
                        f"{ref} belongs to InferenceModel {other}: rename one of the two models"
                    )
                    applied.refused.add(child["kind"])
                    continue
                result = apply_child(self.kube, child, live)
            except ApiException as e:
                if e.status not in (400, 422):
                    raise  # transient: the work queue retries with backoff
                applied.errors.append(f"{ref} was rejected: {api_message(e)}")
                applied.refused.add(child["kind"])
                continue
            (outcome.applied if result.applied else outcome.skipped).append(ref)
            metrics.APPLIES.labels(child["kind"], "applied" if result.applied else "skipped").inc()
            applied.objects.append(result.obj)
        return applied

    def _delete_stale(self, im: InferenceModel, children: list[dict[str, Any]], outcome: Outcome) -> None:
        """Delete what the other mode (aggregated or disaggregated) left: this model's Deployments,
        budgets and ConfigMaps that it no longer renders."""
        live = [
            obj
            for api_version, kind in ROLE_KINDS
            for obj in self.kube.list(api_version, kind, im.namespace, selector_string(im.name))
        ]
        for obj in stale_children(im, live, children):
            md = obj["metadata"]
            self.kube.delete(obj["apiVersion"], obj["kind"], im.namespace, md["name"])
            outcome.deleted.append(f"{obj['kind']}/{md['name']}")

    def sync_inference_pool(
        self, im: InferenceModel, settings: OperatorSettings, live_status: dict[str, Any], outcome: Outcome
    ) -> Cond | None:
        """Apply the model's InferencePool while spec.inferencePool.enabled (and the API exists); delete
        the one it made once disabled. The condition to report, None while disabled."""
        ref = f"{pool.INFERENCE_POOL_KIND}/{im.name}"
        if not pool.pool_enabled(im):
            had_pool = any(c.get("type") == pool.CONDITION for c in live_status.get("conditions") or [])
            if had_pool and self.api_available(pool.INFERENCE_POOL_API):
                self._delete_pool(im, outcome)
            return None
        if not self.api_available(pool.INFERENCE_POOL_API):
            return pool.pool_api_missing()
        try:
            live = self.kube.get(pool.INFERENCE_POOL_API, pool.INFERENCE_POOL_KIND, im.namespace, im.name)
            if live is not None and not pool.owned_by(live, im):
                return pool.pool_name_in_use(im)
            result = apply_child(self.kube, pool.render_inference_pool(im, settings), live)
        except ApiException as e:
            if e.status == 403:
                return pool.pool_forbidden()
            if e.status in (400, 422):
                return pool.pool_refused(im, api_message(e))
            raise  # transient: the work queue retries with backoff
        (outcome.applied if result.applied else outcome.skipped).append(ref)
        metrics.APPLIES.labels(pool.INFERENCE_POOL_KIND, "applied" if result.applied else "skipped").inc()
        return pool.pool_ready(im)

    def _delete_pool(self, im: InferenceModel, outcome: Outcome) -> None:
        try:
            live = self.kube.get(pool.INFERENCE_POOL_API, pool.INFERENCE_POOL_KIND, im.namespace, im.name)
            if live is not None and pool.owned_by(live, im):
                self.kube.delete(pool.INFERENCE_POOL_API, pool.INFERENCE_POOL_KIND, im.namespace, im.name)
                outcome.deleted.append(f"{pool.INFERENCE_POOL_KIND}/{im.name}")
        except ApiException as e:
            if e.status != 403:
                raise
            log.warning("%s/%s: may not delete its InferencePool (RBAC)", im.namespace, im.name)

    def sync_adapters(self, im: InferenceModel, pods: list[dict[str, Any]], chash: str) -> AdapterSync:
        """Load and unload adapters in the running pods; trouble ends up in the result, not raised."""
        try:
            key = api_key_of(im, lambda secret: self.kube.get("v1", "Secret", im.namespace, secret))
        except Exception as e:  # no RBAC for the secret, a missing key: say so in the status
            return AdapterSync(failures=[f"the runtime's API key: {e}"])
        return sync_adapters(im, pods, self.adapter_client, key, chash)

    def _write_status(
        self,
        body: dict[str, Any],
        live_status: dict[str, Any],
        desired: dict[str, Any],
        outcome: Outcome,
        extra_events: list[EventSpec],
    ) -> None:
        md = body["metadata"]
        patch = status_patch(live_status, desired)
        if patch is not None:
            self.kube.patch_status(API_VERSION, KIND, md["namespace"], md["name"], patch)
            metrics.STATUS_PATCHES.inc()
            outcome.status_patch = patch
            outcome.events = (
                condition_events(live_status.get("conditions"), desired["conditions"]) + extra_events
            )
        for event in outcome.events:
            self.post_event(body, event)
