"""The decode side's pull: `GET {remote_url}/v1/kv/transfers/{id}?from_block=K` within a deadline,
read frame by frame as it arrives (each frame no larger than the blocks still due, wire.py's
StreamChecker), each run's data into its own buffer that the engine's import views in place;
then `DELETE` to release the prefill pod's pins. Every fault is a `PullError` whose reason the server
counts; the caller recomputes the prompt. Torch-free (aiohttp)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import zlib
from collections.abc import Callable

import aiohttp

from kvpilot.runtime.engine.kv_transfer.wire import (
    BLOCKS,
    END,
    FRAME_HEAD_BYTES,
    HEADER,
    RUN_ID_BYTES,
    BlockRun,
    DecodedKV,
    KVLayout,
    StreamChecker,
    StreamHeader,
    WireError,
)

RELEASE_TIMEOUT_S = 2.0
# the pull session's read buffer: aiohttp's default (64 KiB) pauses and resumes the socket every
# 128 KiB, which caps a stream of many MB at a fraction of what the connection carries
READ_BUFSIZE = 4 * 2**20
# why a transfer failed (kvpilot_kv_transfer_failures_total{reason}): the pull's reasons, and the
# prefill side's `pin_capacity` (its pinned transfers hold their share of the pool: no params given)
PULL_FAILURES = (
    "timeout",
    "peer_gone",
    "not_found",
    "peer_error",
    "too_large",
    "busy",
    "checksum",
    "truncated",
    "protocol",
    "mismatch",
)
FAILURE_REASONS = (*PULL_FAILURES, "pin_capacity")
# why a decode pod recomputed a prompt whose KV was offered (kvpilot_kv_transfer_fallbacks_total{reason}):
# a failed pull, or blocks the engine could not use (engine_side.py), or prompt logprobs asked for
FALLBACK_REASONS = (*PULL_FAILURES, "evicted", "no_blocks", "import_error", "prompt_logprobs")


def new_session() -> aiohttp.ClientSession:
    """The decode side's session for pulls (and their releases)."""
    return aiohttp.ClientSession(read_bufsize=READ_BUFSIZE)


class PullError(Exception):
    """reason: timeout | peer_gone | not_found | peer_error | too_large | busy | checksum | truncated
    | protocol | mismatch."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ByteBudget:
    """Bounds the bytes of pulled blocks held at once (pulls in flight and pulled blocks the engine
    has not copied in yet). `release` may be called from any thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._freed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def acquire(self, size: int, deadline: float) -> Callable[[], None]:
        """Wait until `size` bytes fit (or the deadline: PullError busy); returns the release, to be
        called once."""
        if size > self.limit:
            raise PullError("too_large", f"{size} bytes of KV blocks exceed the pull budget of {self.limit}")
        self._loop = asyncio.get_running_loop()
        if self._freed is None:
            self._freed = asyncio.Event()
        while True:
            with self._lock:
                if self.held + size <= self.limit:
                    self.held += size
                    break
            self._freed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PullError("busy", "other pulls hold the pull budget")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), remaining)
        done = False

        def release() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                self.held -= size
            loop, freed = self._loop, self._freed
            if loop is not None and freed is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    loop.call_soon_threadsafe(freed.set)

        return release


async def _read_exact(content: aiohttp.StreamReader, n: int, crc: int = 0) -> tuple[bytearray, int]:
    """The next `n` bytes of the body into one writable buffer (the import views it in place), and
    their crc32 continued from `crc`, computed chunk by chunk while each chunk is in the CPU's cache."""
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        chunk = await content.read(n - pos)
        if not chunk:
            raise WireError("truncated", f"the stream ends {n - pos} bytes inside a frame")
        view[pos : pos + len(chunk)] = chunk
        crc = zlib.crc32(chunk, crc)
        pos += len(chunk)
    return buf, crc


async def read_stream(
    content: aiohttp.StreamReader, local: KVLayout, first_block: int, num_blocks: int
) -> DecodedKV:
    """Read and check a stream frame by frame as it arrives. Raises WireError."""
    checker = StreamChecker(local, first_block, num_blocks)
    header: StreamHeader | None = None
    runs: list[BlockRun] = []
    while True:
        raw, _ = await _read_exact(content, FRAME_HEAD_BYTES)
        head = checker.head(raw)
        payload, crc = await _read_exact(content, RUN_ID_BYTES if head.kind == BLOCKS else head.length)
        if head.kind == BLOCKS:
            run = checker.run_ids(payload, head.length)
            data, crc = await _read_exact(content, head.length - RUN_ID_BYTES, crc)
            runs.append(BlockRun(run, memoryview(data)))
        if crc != head.crc:
            raise WireError("checksum", "a frame fails its crc32")
        if head.kind == HEADER:
            header = checker.header(bytes(payload))
        elif head.kind == END:
            checker.end(payload)
            break
    if await content.read(1):
        raise WireError("protocol", "bytes after the end frame")
    assert header is not None
    return DecodedKV(header, runs)


async def pull(
    session: aiohttp.ClientSession,
    url: str,
    first_block: int,
    num_blocks: int,
    local: KVLayout,
    deadline: float,
    headers: dict[str, str] | None = None,
) -> DecodedKV:
    """Blocks first_block.. of the transfer at `url` (…/v1/kv/transfers/{id}), checked against
    `local` as they arrive; `deadline`: time.monotonic() by which it must be done."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise PullError("timeout", "no time left for the pull")
    params = {"from_block": str(first_block), "rank": str(local.tp_rank)}
    try:
        async with asyncio.timeout(remaining):
            async with session.get(url, params=params, headers=headers) as resp:
                if resp.status == 404:
                    raise PullError("not_found", "the prefill pod no longer has this transfer")
                if resp.status != 200:
                    raise PullError("peer_error", f"the prefill pod answered {resp.status}")
                return await read_stream(resp.content, local, first_block, num_blocks)
    except TimeoutError:
        raise PullError("timeout", "the pull passed its deadline") from None
    except WireError as e:
        raise PullError(e.reason, str(e)) from None
    except aiohttp.ClientPayloadError:
        raise PullError("truncated", "the prefill pod's stream broke off") from None
    except aiohttp.ClientError as e:
        raise PullError("peer_gone", f"the prefill pod could not be read: {type(e).__name__}") from None


async def pull_ranks(
    session: aiohttp.ClientSession,
    url: str,
    first_block: int,
    num_blocks: int,
    layouts: list[KVLayout],
    deadline: float,
    headers: dict[str, str] | None = None,
) -> list[DecodedKV]:
    """`pull` of every tensor-parallel rank's stream (`layouts[r]` is rank r's), side by side; the
    first failure cancels the others and is raised."""
    tasks = [
        asyncio.ensure_future(pull(session, url, first_block, num_blocks, layout, deadline, headers))
        for layout in layouts
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def release(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> bool:
    """DELETE the transfer (best effort within RELEASE_TIMEOUT_S: the prefill pod's TTL is the backstop)."""
    try:
        async with asyncio.timeout(RELEASE_TIMEOUT_S), session.delete(url, headers=headers) as resp:
            return resp.status in (200, 204)
    except (TimeoutError, aiohttp.ClientError):
        return False
