"""The errors a client of the OpenAI-compatible API sees: `APIError` (an OpenAI error body with a
status, a parameter name and headers) and the fixed errors the server and the output processor raise.

Every rejection names the parameter it is about (`param`), so a client can act on it.
"""

from __future__ import annotations

from typing import Any

from kvpilot.request_body import error_body

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error the client sees as an OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def _unavailable(message: str, close: bool = False) -> APIError:
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if close:
        headers["Connection"] = "close"
    return APIError(message, status=503, type="service_unavailable", headers=headers)


def engine_dead_error() -> APIError:
    return _unavailable("the engine stopped on an internal error; retry on another replica")


def shutting_down_error() -> APIError:
    return _unavailable("the server is shutting down; retry on another replica", close=True)


def loading_error() -> APIError:
    return _unavailable("the model is still loading")


def aborted_error() -> APIError:
    return _unavailable("the request was aborted by the server (shutting down); retry it")


def queue_full_error() -> APIError:
    return APIError(
        "the server is overloaded (request queue full); retry later",
        status=429,
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def grammar_queue_full_error() -> APIError:
    return APIError(
        "the server is overloaded (too many grammars waiting to compile); retry later",
        status=429,
        type="rate_limit_error",
        code="grammar_queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def internal_error(message: str = "internal server error") -> APIError:
    return APIError(message, status=500, type="internal_server_error")
