"""Endpoint sources: where the router learns each model's Ready pods.

`StaticSource` is the `--endpoints MODEL=URL[,URL...]` list (and `--prefill-endpoints`: a disaggregated
model's prefill pods); the Kubernetes source (`kube_discovery`) watches the namespace's pods. Both
follow `source.EndpointSource`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from kvpilot.router.pd import PdSettings
from kvpilot.router.pool import Endpoint
from kvpilot.router.source import UpdateEndpoints


def parse_endpoints(
    specs: Sequence[str], capacity: int = 64, flag: str = "--endpoints", role: str | None = None
) -> dict[str, list[Endpoint]]:
    """`MODEL=URL[,URL...]` strings (repeatable; a model named twice gets both lists) -> endpoints
    of `role` (None: aggregated pods, or a disaggregated model's decode pods).

    Raises ValueError naming `flag` and the bad value.
    """
    out: dict[str, list[Endpoint]] = {}
    for spec in specs:
        model, sep, urls = spec.partition("=")
        model = model.strip()
        if not sep or not model or not urls.strip():
            raise ValueError(f"{flag} {spec!r}: expected MODEL=URL[,URL...]")
        for url in urls.split(","):
            url = url.strip().rstrip("/")
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"{flag} {spec!r}: {url!r} is not an http(s) URL")
            if parts.path.endswith("/v1"):
                url = url[: -len("/v1")]  # the router appends the request's own path (/v1/...)
            eps = out.setdefault(model, [])
            if any(e.url == url for e in eps):
                raise ValueError(f"{flag} {spec!r}: {url} is listed twice for {model}")
            eps.append(Endpoint(name=url, url=url, capacity=capacity, role=role))
    return out


def parse_adapters(specs: Sequence[str], models: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """`MODEL=ADAPTER[,ADAPTER...]` strings (repeatable) -> {model: adapter names}: the LoRA adapters
    each model's pods serve (their `--lora-modules` names). Raises ValueError naming the bad value:
    a model not in `models`, an adapter named like a model or declared twice."""
    out: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for spec in specs:
        model, sep, names = spec.partition("=")
        model = model.strip()
        adapters = [n.strip() for n in names.split(",")]
        if not sep or not model or not all(adapters):
            raise ValueError(f"--adapters {spec!r}: expected MODEL=ADAPTER[,ADAPTER...]")
        if model not in models:
            raise ValueError(f"--adapters {spec!r}: {model!r} is not a model of --endpoints")
        for name in adapters:
            if name in models:
                raise ValueError(f"--adapters {spec!r}: {name!r} is a model's name, not an adapter's")
            if name in owner:
                raise ValueError(
                    f"--adapters {spec!r}: adapter {name!r} is already declared for {owner[name]}"
                )
            owner[name] = model
        out[model] = out.get(model, ()) + tuple(adapters)
    return out


def add_prefill_endpoints(
    endpoints: Mapping[str, list[Endpoint]], specs: Sequence[str], capacity: int = 64
) -> dict[str, list[Endpoint]]:
    """`--prefill-endpoints MODEL=URL[,URL...]` added to the models of `--endpoints` (whose pods are
    then the model's decode pods). Raises ValueError naming the flag: a model not in `endpoints`, a
    URL that is also one of the model's decode pods."""
    out = {model: list(eps) for model, eps in endpoints.items()}
    for model, prefill in parse_endpoints(specs, capacity, "--prefill-endpoints", "prefill").items():
        if model not in out:
            raise ValueError(f"--prefill-endpoints {model}=...: {model!r} is not a model of --endpoints")
        for ep in prefill:
            if any(e.url == ep.url for e in out[model]):
                raise ValueError(
                    f"--prefill-endpoints {model}=...: {ep.url} is also a pod of {model} in --endpoints "
                    "(a pod has one role)"
                )
        out[model] += prefill
    return out


class StaticSource:
    """A fixed list of pods per model (a single host, tests, benchmarks); `disaggregation`: the
    models whose prefill pods are among their endpoints (role "prefill"), with their P/D settings."""

    def __init__(
        self,
        endpoints: Mapping[str, list[Endpoint]],
        policies: Mapping[str, str] | None = None,
        disaggregation: Mapping[str, PdSettings] | None = None,
    ) -> None:
        self.endpoints = dict(endpoints)
        self.policies = dict(policies or {})
        self.disaggregation = dict(disaggregation or {})

    async def run(self, update: UpdateEndpoints, synced: Callable[[], None]) -> None:
        for model, eps in self.endpoints.items():
            pd = self.disaggregation.get(model)
            update(model, list(eps), self.policies.get(model), disaggregation=pd)
        synced()
        await asyncio.Event().wait()  # nothing changes until the router stops
