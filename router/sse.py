"""Reading an OpenAI stream (server-sent events) as the router passes it on. Pure, no I/O.

`split_events` cuts the bytes that came so far into whole events (each ends with a blank line) and
the rest, so the router forwards whole events only: a pod that dies in the middle of one leaves no
half event at the client, and a continuation on another pod (migrate.py) can follow cleanly.

`StreamTally` reads each whole event of a stream for what the router measures and what a migration
needs: when the first content token reached the client, how many content chunks came (one decoded
token each in kvpilot's runtime and vLLM; a chunk that carries bytes held back for a whole character
or a stop string can hold two, so the count is a floor), the text of choice 0 so far, the usage the
pod reported (exact counts, preferred over the chunk count), whether the stream finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]"


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """(whole events, each with its closing blank line, and the incomplete rest)."""
    end = buffer.rfind(b"\n\n")
    if end < 0:
        return [], buffer
    head, rest = buffer[: end + 2], buffer[end + 2 :]
    return [e + b"\n\n" for e in head[:-2].split(b"\n\n")], rest


def event_data(event: bytes) -> Any:
    """The JSON of an event's `data:` line(s); None for [DONE], comments, and what is not JSON."""
    lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines or lines == [b"[DONE]"]:
        return None
    try:
        return json.loads(b"\n".join(lines))
    except (ValueError, UnicodeDecodeError):
        return None


def encode_event(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def choice_content(choice: Any) -> str:
    """The text a stream chunk's choice adds (completions' `text`, chat's `delta.content`)."""
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def is_content(choice: Any) -> bool:
    """A choice that carries output: text, or a tool call's part."""
    if choice_content(choice):
        return True
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return isinstance(delta, dict) and bool(delta.get("tool_calls"))


@dataclass
class StreamTally:
    """What one client stream has delivered so far (across the pods that served it)."""

    first_content_s: float | None = None  # clock time the first content chunk went out
    last_content_s: float | None = None
    content_chunks: int = 0
    text: list[str] = field(default_factory=list)  # choice 0's text, in order
    usage: dict[str, Any] | None = None  # the last usage the pods reported (adjusted after a migration)
    finish_reason: str | None = None
    error: bool = False  # an error event went out
    done: bool = False  # data: [DONE] went out
    stream_id: str | None = None  # the first chunk's id and created: a continuation takes them over
    created: int | None = None

    def see(self, event: bytes, now: float) -> Any:
        """Account one whole event that went out to the client; its JSON data (None if none)."""
        if event.startswith(DONE):
            self.done = True
            return None
        data = event_data(event)
        if not isinstance(data, dict):
            return data
        if "error" in data and "choices" not in data:
            self.error = True
            return data
        if self.stream_id is None and isinstance(data.get("id"), str):
            self.stream_id, created = data["id"], data.get("created")
            self.created = created if isinstance(created, int) else None
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        for choice in data.get("choices") or ():
            if is_content(choice):
                self.content_chunks += 1
                self.last_content_s = now
                if self.first_content_s is None:
                    self.first_content_s = now
                if choice.get("index", 0) == 0:
                    self.text.append(choice_content(choice))
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if isinstance(reason, str):
                self.finish_reason = reason
        return data

    @property
    def delivered_text(self) -> str:
        return "".join(self.text)

    @property
    def output_tokens(self) -> int:
        """Output tokens delivered: the pod's usage when it reported one, else the content chunks."""
        if self.usage is not None and isinstance(self.usage.get("completion_tokens"), int):
            return max(self.usage["completion_tokens"], 0)
        return self.content_chunks

    @property
    def prompt_tokens(self) -> int | None:
        if self.usage is not None and isinstance(self.usage.get("prompt_tokens"), int):
            return int(self.usage["prompt_tokens"])
        return None
