"""The prefill side's pinned transfers: a finished `do_remote_decode` request's full prompt blocks,
held (one block-manager reference each) under a transfer id until the decode pod releases them
(`DELETE`) or the TTL passes, and never more than a cap of the pool, so pinning cannot starve the
pod's own requests.

Thread safety: the engine thread adds pins and frees what `take_freeable` hands it (it owns the block
manager); the server's handlers open readers and release transfers from the event loop. A pin being
read is never freed: expiry and release wait for its readers, so a stream never sends blocks that
were reused meanwhile. Torch-free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Pin:
    transfer_id: str
    block_ids: list[int]  # the prompt's blocks 0..n-1, in order
    num_tokens: int
    expires_at: float
    readers: int = 0
    released: bool = False  # DELETE came, or the TTL passed: freed once no reader holds it


class PinTable:
    def __init__(self, max_blocks: int, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_blocks = max_blocks
        self.ttl = ttl
        self.clock = clock
        self._lock = threading.Lock()
        self._pins: dict[str, Pin] = {}
        self._blocks = 0  # blocks held by all pins (a block in two pins counts twice)

    @property
    def pending(self) -> int:
        """Transfers pinned and not yet released."""
        with self._lock:
            return sum(1 for p in self._pins.values() if not p.released)

    @property
    def pinned_blocks(self) -> int:
        with self._lock:
            return self._blocks

    def add(self, transfer_id: str, block_ids: list[int], num_tokens: int) -> bool:
        """Pin (the caller takes the block references when this returns True); False: over the cap."""
        with self._lock:
            if self._blocks + len(block_ids) > self.max_blocks:
                return False
            self._pins[transfer_id] = Pin(transfer_id, list(block_ids), num_tokens, self.clock() + self.ttl)
            self._blocks += len(block_ids)
            return True

    def open(self, transfer_id: str) -> Pin | None:
        """A reader's lease on a live transfer (None: unknown, released or expired); `close` it."""
        with self._lock:
            pin = self._pins.get(transfer_id)
            if pin is None or pin.released or self.clock() >= pin.expires_at:
                return None
            pin.readers += 1
            return pin

    def close(self, pin: Pin) -> None:
        with self._lock:
            pin.readers -= 1

    def release(self, transfer_id: str) -> bool:
        """The decode pod is done with it; False when unknown (released already, or expired)."""
        with self._lock:
            pin = self._pins.get(transfer_id)
            if pin is None or pin.released:
                return False
            pin.released = True
            return True

    def take_freeable(self) -> list[list[int]]:
        """Engine thread: remove the pins released or past their TTL that no reader holds, and hand
        back their blocks for the caller to unreference."""
        now = self.clock()
        out: list[list[int]] = []
        with self._lock:
            for tid, pin in list(self._pins.items()):
                if (pin.released or now >= pin.expires_at) and pin.readers == 0:
                    del self._pins[tid]
                    self._blocks -= len(pin.block_ids)
                    out.append(pin.block_ids)
        return out

    def take_all(self) -> list[list[int]]:
        """Every pin's blocks, whatever their state (the engine is closing)."""
        with self._lock:
            out = [p.block_ids for p in self._pins.values()]
            self._pins.clear()
            self._blocks = 0
        return out
