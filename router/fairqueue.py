"""The central queue's order: priority bands, and in each band one FIFO per tenant served in turn.

Pure, no I/O. Band 0 is served first; within a band the tenants take turns, one request each (round
robin over the tenants that have requests waiting, a tenant that arrives joins at the end of the
turn), so one tenant's burst waits behind its own requests, not in front of everyone else's. With a
single tenant (fairness off: every request has tenant "") a band is a plain FIFO.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, bands: int) -> None:
        self._bands: list[OrderedDict[str, deque[T]]] = [OrderedDict() for _ in range(bands)]
        self._len = 0
        self._band_len = [0] * bands
        self._tenant_len: dict[str, int] = {}

    def __len__(self) -> int:
        return self._len

    def band_len(self, band: int) -> int:
        return self._band_len[band]

    def tenant_len(self, tenant: str) -> int:
        return self._tenant_len.get(tenant, 0)

    def head_band(self) -> int | None:
        """The band served next (the first with a request), None when empty."""
        return next((b for b, n in enumerate(self._band_len) if n), None)

    def push(self, item: T, band: int, tenant: str = "") -> None:
        self._bands[band].setdefault(tenant, deque()).append(item)
        self._count(band, tenant, 1)

    def peek(self) -> T | None:
        band = self.head_band()
        if band is None:
            return None
        return next(iter(self._bands[band].values()))[0]

    def pop(self) -> T:
        """The next request: the head of the first band's tenant whose turn it is."""
        band = self.head_band()
        if band is None:
            raise IndexError("pop from an empty queue")
        tenants = self._bands[band]
        tenant, fifo = next(iter(tenants.items()))
        item = fifo.popleft()
        if fifo:
            tenants.move_to_end(tenant)  # its next request waits for the other tenants' turns
        else:
            del tenants[tenant]
        self._count(band, tenant, -1)
        return item

    def remove(self, item: T, band: int, tenant: str = "") -> bool:
        fifo = self._bands[band].get(tenant)
        if fifo is None or item not in fifo:
            return False
        fifo.remove(item)
        if not fifo:
            del self._bands[band][tenant]
        self._count(band, tenant, -1)
        return True

    def __iter__(self) -> Iterator[T]:
        for tenants in self._bands:
            for fifo in tenants.values():
                yield from fifo

    def _count(self, band: int, tenant: str, delta: int) -> None:
        self._len += delta
        self._band_len[band] += delta
        left = self._tenant_len.get(tenant, 0) + delta
        if left:
            self._tenant_len[tenant] = left
        else:
            self._tenant_len.pop(tenant, None)
