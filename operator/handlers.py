"""kopf wiring, kept thin: watch events only enqueue keys for the `ReconcileController`.

All handlers are `on.event` (stateless), so kopf never writes to our objects: no finalizers, no
last-handled-configuration annotations, no progress in status. Reconcile triggers:
- the InferenceModel itself: created, changed, or listed when the operator (re)starts;
- a Deployment or pod we manage changed (mapped back to its InferenceModel);
- the ReconcileController's periodic resync, as a safety net.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from kvpilot.api.models import GROUP, PLURAL, VERSION
from kvpilot.operator.builders import MANAGED_BY, MANAGED_BY_LABEL
from kvpilot.operator.controller import ReconcileController

log = logging.getLogger(__name__)
MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}


def build_registry(controller: ReconcileController, login: Any = None) -> kopf.OperatorRegistry:
    """A kopf registry whose handlers feed `controller`. `login` is an optional kopf login handler."""
    registry = kopf.OperatorRegistry()

    if login is not None:
        kopf.on.login(registry=registry)(login)

    seen: dict[tuple[str, str], tuple[Any, ...]] = {}

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
    async def inference_model_event(type: str | None, body: kopf.Body, **_: Any) -> None:
        key = (body.metadata.namespace or "", body.metadata.name or "")
        if type == "DELETED":
            seen.pop(key, None)
            controller.forget(key)
            return
        # Like controller-runtime's GenerationChangedPredicate: our own status writes (and the
        # autoscaler's) bump resourceVersion but not generation; they need no reconcile.
        state = (body.metadata.uid, body.metadata.get("generation"), body.metadata.get("deletionTimestamp"))
        if seen.get(key) == state:
            return
        seen[key] = state
        controller.enqueue(key)

    @kopf.on.event("apps", "v1", "deployments", labels=MANAGED, registry=registry)
    async def deployment_event(body: kopf.Body, **_: Any) -> None:
        controller.enqueue_owner(dict(body))

    @kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry)
    async def pod_event(body: kopf.Body, **_: Any) -> None:
        controller.enqueue_owner(dict(body))

    return registry


def configure_settings(settings: kopf.OperatorSettings) -> kopf.OperatorSettings:
    """kopf settings for a leader-elected, event-only operator."""
    settings.peering.standalone = True  # we elect a leader with a Lease; no KopfPeering CRDs needed
    settings.posting.enabled = False  # we post our own Events, only for what a person should know
    settings.scanning.disabled = True  # resources and namespaces are fixed at start
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    return settings
