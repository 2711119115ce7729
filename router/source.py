"""What feeds the router its models' pods: the protocol a source (discovery.py, kube_discovery.py)
follows and the update it calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvpilot.api.slo import SloTargets
from kvpilot.router.pd import PdSettings
from kvpilot.router.pool import Endpoint


class UpdateEndpoints(Protocol):
    def __call__(
        self,
        model: str,
        endpoints: list[Endpoint] | None,
        policy: str | None = None,
        fallback: str | None = None,
        adapters: Sequence[str] | None = None,
        slo: SloTargets | None = None,
        disaggregation: PdSettings | None = None,
    ) -> None: ...


class EndpointSource(Protocol):
    """Feeds the router the Ready pods of each model it serves (static list, Kubernetes watch...).

    `run` calls `update(model, endpoints, policy, fallback, adapters, slo, disaggregation)` whenever a
    model's pods (or its routing policy, fallback model, LoRA adapter names, SLO targets or P/D
    settings) change (endpoints None: the model is gone), `synced()` once every model is known, and
    returns only when cancelled. An error while watching must not drop the endpoints already known:
    keep them until the source sees otherwise. A disaggregated model (`disaggregation` set) lists its
    prefill pods among its endpoints with `role="prefill"`.
    """

    async def run(self, update: UpdateEndpoints, synced: Callable[[], None]) -> None: ...
