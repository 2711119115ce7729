"""Mid-stream migration: a stream whose pod died (connection dropped, or silent past its deadline and
its health probe) continues on another pod. Pure: which requests can move, the continuation's body,
and how the continuation's events are rewritten into the client's one stream.

The continuation asks the new pod for the same output from where the first one stopped: the prompt
followed by the text already delivered, and max_tokens (and min_tokens) lowered by the tokens
delivered. The router has no tokenizer and sees text, so the continuation is a text prompt:

- /v1/completions with a text prompt: `prompt` + delivered text. The pod tokenizes it again; with
  greedy sampling the output is the uninterrupted run's whenever the delivered text re-tokenizes to
  the tokens that produced it (byte-level BPE's canonical split: what a model emits nearly always).
- /v1/chat/completions: the messages plus an assistant message holding the delivered text, with
  `continue_final_message: true, add_generation_prompt: false` (vLLM's semantics, kvpilot's runtime
  too): the pod renders the conversation with the last turn left open, the prompt the first pod
  decoded from plus the delivered text. A client's own open final assistant turn is extended.

Not migrated (the stream ends with an error event, as before): n or best_of above 1, several prompts,
a prompt of token ids (the delivered tokens' ids are not known), echo, guided or structured output
(guided_*, a response_format other than text), tools (the output is parsed into tool calls), and a
chat request that already sets add_generation_prompt false without continuing its last message.
Sampled (non-greedy) streams continue with fresh randomness: still one stream, not the same text.
"""

from __future__ import annotations

import copy
from typing import Any

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def migratable(body: dict[str, Any], chat: bool) -> str | None:
    """None when a stream of this request can move to another pod, else why not."""
    if body.get("stream") is not True:
        return "not a stream"
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            return f"{name} > 1"
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            return f"guided output ({name})"
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "structured output (response_format)"
    if chat:
        if body.get("tools") or body.get("functions"):
            return "tools"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            return "no messages"
        continuing = body.get("continue_final_message") is True
        if continuing and not isinstance(messages[-1].get("content"), str):
            return "a final message without text content"
        if body.get("add_generation_prompt") is False and not continuing:
            return "add_generation_prompt false"
        return None
    if body.get("echo"):
        return "echo"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return None
    if not isinstance(prompt, str):
        return "a prompt that is not one text"
    return None


def _lowered(value: Any, by: int) -> Any:
    return value - by if isinstance(value, int) and not isinstance(value, bool) else value


def continuation(body: dict[str, Any], chat: bool, text: str, tokens: int) -> dict[str, Any] | None:
    """The body that continues a migratable request after `text` (`tokens` output tokens) went out;
    None when nothing is left to generate (max_tokens reached)."""
    if not text and tokens == 0:
        return body  # nothing went out yet (a chat's opening chunk at most): the request as it was
    out = copy.deepcopy(body)
    for name in ("max_tokens", "max_completion_tokens"):
        if name in out:
            out[name] = _lowered(out[name], tokens)
            if isinstance(out[name], int) and out[name] < 1:
                return None
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = max(0, out["min_tokens"] - tokens)
    if chat:
        messages = out["messages"]
        if body.get("continue_final_message") is True:
            messages[-1]["content"] = messages[-1]["content"] + text
        else:
            messages.append({"role": "assistant", "content": text})
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
    else:
        prompt = out["prompt"]
        out["prompt"] = (prompt[0] if isinstance(prompt, list) else prompt) + text
    return out


def rewrite_event(
    data: dict[str, Any], stream_id: str | None, created: int | None, tokens_before: int, keep_usage: bool
) -> dict[str, Any] | None:
    """A continuation's chunk as a chunk of the client's stream: the first pod's id and created, the
    chat opening chunk (role only: the client has had one) dropped, usage counted over the whole
    stream (the tokens delivered before move from the prompt to the completion), and a usage-only
    chunk dropped when the client did not ask for usage. None: send nothing."""
    if "choices" not in data:
        return data  # an error event passes as it is
    out = dict(data)
    if stream_id is not None:
        out["id"] = stream_id
    if created is not None:
        out["created"] = created
    choices = []
    for choice in out.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        opening = (
            isinstance(delta, dict)
            and set(delta) <= {"role", "content"}
            and not delta.get("content")
            and choice.get("finish_reason") is None
        )
        if not opening:
            choices.append(choice)
    usage = out.get("usage")
    if isinstance(usage, dict):
        usage = dict(usage)
        for name, sign in (("prompt_tokens", -1), ("completion_tokens", 1)):
            if isinstance(usage.get(name), int):
                usage[name] = max(0, usage[name] + sign * tokens_before)
        out["usage"] = usage
        if not keep_usage:
            del out["usage"]
    if not choices and "usage" not in out:
        return None
    out["choices"] = choices
    return out
