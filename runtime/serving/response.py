"""The response side of the OpenAI-compatible API: the two renderers (`CompletionRenderer` for
/v1/completions, `ChatRenderer` for /v1/chat/completions) that turn the output processor's choices and
deltas into response bodies and stream chunks.

Bodies are plain dicts built by small functions: the streaming path builds one per token, and dicts
keep the exact OpenAI shapes (explicit nulls included) without a model round trip. A renderer is
the place for a field of the response that a request feature adds (a chat message's tool calls, say).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from kvpilot.runtime.serving.output_processor import Choice, Delta, LogprobEntry


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(entries: Sequence[LogprobEntry], text_offset: int) -> dict[str, Any]:
    """The legacy completions format; `text_offset` is where the first token's text starts."""
    offsets = []
    for tok, _, _ in entries:
        offsets.append(text_offset)
        text_offset += len(tok.text)
    return {
        "tokens": [tok.text for tok, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [None if top is None else {t.text: v for t, v in top} for _, _, top in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[LogprobEntry]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": tok.text,
                "logprob": lp,
                "bytes": tok.bytes,
                "top_logprobs": [{"token": t.text, "logprob": v, "bytes": t.bytes} for t, v in top or []],
            }
            for tok, lp, top in entries
        ],
        "refusal": None,
    }


def _body(
    obj: str, request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_: Any
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "system_fingerprint": None,
    }


class Renderer(Protocol):
    """Builds one endpoint's response bodies and stream chunks from the output processor's state."""

    def body(
        self, request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_: Any
    ) -> dict[str, Any]:
        """The whole response (non-streaming)."""
        ...

    def choice(self, c: Choice, text: str) -> dict[str, Any]:
        """One finished choice of the whole response; `text` is all of it (echo included)."""
        ...

    def chunk(
        self, request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_: Any
    ) -> dict[str, Any]:
        """One stream chunk."""
        ...

    def opening_choice(self, c: Choice) -> dict[str, Any] | None:
        """The chunk choice sent for `c` before any generated text (None: nothing)."""
        ...

    def delta_choice(self, d: Delta) -> dict[str, Any]:
        """The chunk choice for one delta."""
        ...


class CompletionRenderer:
    def body(
        self, request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_: Any
    ) -> dict[str, Any]:
        return _body("text_completion", request_id, model, created, choices, usage_)

    chunk = body  # a completions stream chunk has the shape of the whole response

    @staticmethod
    def _choice(
        index: int,
        text: str,
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }

    def choice(self, c: Choice, text: str) -> dict[str, Any]:
        start = 0 if c.echo_logprobs else len(c.echo_text)
        lps = completion_logprobs(c.logprobs, start) if c.want_logprobs else None
        out = self._choice(c.index, text, lps, c.finish_reason, c.stop_reason)
        if c.prompt_logprobs_k is not None:
            out["prompt_logprobs"] = c.prompt_logprobs
        return out

    def opening_choice(self, c: Choice) -> dict[str, Any] | None:
        if not c.echo_text or c.echo_logprobs:  # echo with logprobs comes with them (delta_choice)
            return None
        return self._choice(c.index, c.echo_text, None, None, None)

    def delta_choice(self, d: Delta) -> dict[str, Any]:
        c = d.choice
        lps = completion_logprobs(d.logprobs, d.text_offset) if c.want_logprobs and d.logprobs else None
        if d.finished:
            return self._choice(c.index, d.echo + d.text, lps, c.finish_reason, c.stop_reason)
        return self._choice(c.index, d.echo + d.text, lps, None, None)


class ChatRenderer:
    def body(
        self, request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_: Any
    ) -> dict[str, Any]:
        return _body("chat.completion", request_id, model, created, choices, usage_)

    def chunk(
        self, request_id: str, model: str, created: int, choices: list[dict[str, Any]], usage_: Any
    ) -> dict[str, Any]:
        return _body("chat.completion.chunk", request_id, model, created, choices, usage_)

    def choice(self, c: Choice, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if c.tools is not None:  # a request with tools: the calls, and no empty content beside them
            message["tool_calls"] = [call.as_openai() for call in c.tool_calls]
            if c.tool_calls and not text:
                message["content"] = None
        return {
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c.logprobs) if c.want_logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    @staticmethod
    def _chunk_choice(
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None,
        finish_reason: str | None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return choice

    def opening_choice(self, c: Choice) -> dict[str, Any] | None:
        return self._chunk_choice(c.index, {"role": "assistant", "content": ""}, None, None)

    def delta_choice(self, d: Delta) -> dict[str, Any]:
        c = d.choice
        lps = chat_logprobs(d.logprobs) if c.want_logprobs and d.logprobs else None
        delta: dict[str, Any] = {"content": d.text} if d.text or not (d.finished or d.tool_calls) else {}
        if d.tool_calls:
            delta["tool_calls"] = d.tool_calls
        if d.finished:
            return self._chunk_choice(c.index, delta, lps, c.finish_reason, c.stop_reason)
        return self._chunk_choice(c.index, delta, lps, None)


RENDERERS: dict[str, Renderer] = {"completion": CompletionRenderer(), "chat": ChatRenderer()}
