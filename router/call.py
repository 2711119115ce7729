"""One client request on its way through the router (`Call`), the signal to try another pod
(`Retry`), and the wire's names: the headers the router reads and writes, the pods' errors."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvpilot.router.migrate import migratable
from kvpilot.router.policy import RouteKey
from kvpilot.router.sse import StreamTally

RETRY_AFTER_S = 1
POD_HEADER = "X-Kvpilot-Pod"
FALLBACK_HEADER = "X-Kvpilot-Fallback"  # set when another model served the request (overload spill-over)
REJECT_HEADER = "X-Kvpilot-Reject-Reason"  # why the router answered a 429/502/503/504 itself
QUEUE_TIMEOUT_HEADER = "X-Kvpilot-Queue-Timeout"  # seconds the client lets it wait (at most its class's)
# Only what the pod needs from the client's request; hop-by-hop headers stay here.
FORWARD_HEADERS = ("Authorization", "Content-Type", "Accept", "X-Request-Id", "OpenAI-Organization")
UPSTREAM_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


@dataclass
class Call:
    """One client request on its way through the router, and what it measured."""

    request: web.Request
    model: str  # the name it is counted under
    chat: bool
    body: dict[str, Any]  # as the pods get it
    raw: bytes
    key: RouteKey
    priority: int
    prompt_chars: int
    started: float = field(default_factory=time.monotonic)
    sent_at: float = 0.0  # when it went to the pod that answers
    answered_at: float | None = None  # an answer in one body: when it was read
    tally: StreamTally = field(default_factory=StreamTally)
    tenant: str = ""
    queue_timeout_s: float | None = None  # the client's own time to live in the queue
    unmigratable: str | None = field(init=False)  # why its stream cannot move to another pod (None: it can)
    keep_usage: bool = field(init=False)  # the client asked for usage in its stream

    def __post_init__(self) -> None:
        self.unmigratable = migratable(self.body, self.chat)
        options = self.body.get("stream_options")
        self.keep_usage = isinstance(options, dict) and options.get("include_usage") is True

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


class Retry(Exception):
    """The pod could not take the request and nothing reached the client: try another pod.

    `answer`: what to send the client when no other pod can take it either (else a 502, or a 504 after
    a missed deadline)."""

    def __init__(self, message: str, answer: web.Response | None = None, timeout: bool = False) -> None:
        super().__init__(message)
        self.answer = answer
        self.timeout = timeout  # the pod missed a deadline: a 504 when no other pod can take it
