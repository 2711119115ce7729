"""Endpoint sources: where the router learns each model's Ready pods.

`StaticSource` is the `--endpoints MODEL=URL[,URL...]` list; the Kubernetes source (`kube_discovery`)
watches the namespace's pods. Both follow `server.EndpointSource`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from kvpilot.router.pool import Endpoint
from kvpilot.router.server import UpdateEndpoints


def parse_endpoints(specs: Sequence[str], capacity: int = 64) -> dict[str, list[Endpoint]]:
    """`MODEL=URL[,URL...]` strings (repeatable; a model named twice gets both lists) -> endpoints.

    Raises ValueError naming the bad value.
    """
    out: dict[str, list[Endpoint]] = {}
    for spec in specs:
        model, sep, urls = spec.partition("=")
        model = model.strip()
        if not sep or not model or not urls.strip():
            raise ValueError(f"--endpoints {spec!r}: expected MODEL=URL[,URL...]")
        for url in urls.split(","):
            url = url.strip().rstrip("/")
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"--endpoints {spec!r}: {url!r} is not an http(s) URL")
            if parts.path.endswith("/v1"):
                url = url[: -len("/v1")]  # the router appends the request's own path (/v1/...)
            eps = out.setdefault(model, [])
            if any(e.url == url for e in eps):
                raise ValueError(f"--endpoints {spec!r}: {url} is listed twice for {model}")
            eps.append(Endpoint(name=url, url=url, capacity=capacity))
    return out


class StaticSource:
    """A fixed list of pods per model (a single host, tests, benchmarks)."""

    def __init__(
        self, endpoints: Mapping[str, list[Endpoint]], policies: Mapping[str, str] | None = None
    ) -> None:
        self.endpoints = dict(endpoints)
        self.policies = dict(policies or {})

    async def run(self, update: UpdateEndpoints, synced: Callable[[], None]) -> None:
        for model, eps in self.endpoints.items():
            update(model, list(eps), self.policies.get(model))
        synced()
        await asyncio.Event().wait()  # nothing changes until the router stops
