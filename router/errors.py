"""The router's own error answers: an OpenAI error body (kvpilot/request_body.error_body), and the
middleware that turns aiohttp's errors and an unexpected exception into one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvpilot.request_body import error_body

log = logging.getLogger("kvpilot.router")


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(error_body(message, type_, code, param), status=status, headers=headers)


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error the router answers is an OpenAI error body: aiohttp's own (unknown path, wrong
    method, body over the size limit) and an unexpected exception (500, logged, no traceback sent)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return error_response(e.status, f"{e.reason}: {request.method} {request.path}", kind)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("internal error while handling %s %s", request.method, request.path)
        return error_response(500, "internal error in the router", "internal_server_error")
