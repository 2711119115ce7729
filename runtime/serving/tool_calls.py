"""Tool calling for /v1/chat/completions: the request's `tools` and `tool_choice`, the prompt that
shows the tools to the model, the grammar that enforces `required` / a named function, and the
parser that turns the model's output into OpenAI `tool_calls` (whole, or as streaming deltas).

Formats (pure functions; the HTTP layer only calls them):
- Prompt: a chat template that uses `tools` renders them itself (its own format). A template
  without a tools section (SmolLM2's) gets a fallback system block (`fallback_tools_block`) that
  lists the functions as JSON and asks for calls as `<tool_call>{"name": ..., "arguments": ...}
  </tool_call>`; earlier assistant calls are rendered in that same form and `role: tool` results
  as user turns wrapped in `<tool_response>` (any template can render those).
- `tool_choice: "auto"`: the output is parsed for `<tool_call>...</tool_call>` blocks; text outside
  them is the message content. Unconstrained: the model decides.
- `"required"`: the output is constrained (xgrammar, JSON schema) to a JSON array of one or more
  `{"name": <one of the tools>, "arguments": <that tool's parameters schema>}` objects. Output cut
  short (max_tokens, a stop string) has no calls and no content: the partial JSON is dropped.
- a named function: the output is constrained to that function's `parameters` schema and is the
  call's `arguments` (vLLM's convention).
- `"none"`: tools are not shown to the model and nothing is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpilot.runtime.grammar.schema_checks import subschemas
from kvpilot.runtime.grammar.structured_output import GuidedSpec, GuidedSpecError, check_spec, validate_schema

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
_ANY_OBJECT: dict[str, Any] = {"type": "object"}

ChoiceMode = Literal["none", "auto", "required", "named"]


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / tool message; `param` names the field (a 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"'{param}': {message}")
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode
    name: str | None = None  # the function, when mode == "named"
    parallel: bool = True  # parallel_tool_calls: false allows one call per turn


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


# ------------------------------------------------------------------------------------------------
# Request fields


def parse_tools(tools: Any) -> list[Tool]:
    if not isinstance(tools, list):
        raise ToolError("tools", "must be a list of function tools")
    out: list[Tool] = []
    names: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ToolError(f"{where}.type", "only tools of type 'function' are supported")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function", "is required (an object with 'name' and 'parameters')")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ToolError(f"{where}.function.name", "must be 1-64 letters, digits, '_' or '-'")
        if name in names:
            raise ToolError(f"{where}.function.name", f"duplicate function name '{name}'")
        names.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{where}.function.description", "must be a string")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise ToolError(f"{where}.function.parameters", "must be a JSON schema object")
        try:  # valid JSON Schema; whether the grammar can enforce it matters only for required/named
            spec = GuidedSpec.json_schema(params, f"{where}.function.parameters")
            check_spec(spec, enforced=False)
            validate_schema(spec)
        except GuidedSpecError as e:
            raise ToolError(e.param, e.problem) from None
        out.append(Tool(name, desc, params))
    return out


def parse_tool_choice(choice: Any, tools: Sequence[Tool]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ToolError("tool_choice", f"'{choice}' needs 'tools'")
        return ToolChoice(choice)
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise ToolError("tool_choice.function.name", f"no tool named {name!r} in 'tools'")
        return ToolChoice("named", name)
    raise ToolError(
        "tool_choice",
        'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
    )


def guided_for_tools(tools: Sequence[Tool], choice: ToolChoice) -> GuidedSpec | None:
    """The constraint `required` and a named function put on the output (None for auto/none).
    Raises ToolError naming the tool's `parameters` when the grammar cannot enforce its schema."""
    if choice.mode in ("named", "required"):
        for i, t in enumerate(tools):
            if choice.mode == "required" or t.name == choice.name:
                param = f"tools[{i}].function.parameters"
                try:
                    check_spec(GuidedSpec.json_schema(t.parameters, param))
                except GuidedSpecError as e:
                    raise ToolError(e.param, e.problem) from None
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        return GuidedSpec.json_schema(tool.parameters, "tool_choice")
    if choice.mode == "required":
        # each tool's schema moves under $defs, its local references ('#/$defs/...') with it: in
        # place they would resolve against the array schema's root
        defs = {f"tool{i}": relocated(t.parameters, f"#/$defs/tool{i}") for i, t in enumerate(tools)}
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
                "required": ["name", "arguments"],
            }
            for i, t in enumerate(tools)
        ]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array: dict[str, Any] = {"type": "array", "items": items, "minItems": 1, "$defs": defs}
        if not choice.parallel:
            array["maxItems"] = 1
        return GuidedSpec.json_schema(array, "tool_choice")
    return None


def relocated(schema: dict[str, Any], base: str) -> dict[str, Any]:
    """A copy of `schema` whose local references ('#', '#/...') point into it where it sits at
    `base` ('#/$defs/tool0') inside another schema."""
    copy: dict[str, Any] = json.loads(json.dumps(schema))
    for _, node in subschemas(copy):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = base + ref[1:]
    return copy


# ------------------------------------------------------------------------------------------------
# The prompt


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether the model's own template has a tools section (it reads the `tools` variable)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template or "") is not None


def fallback_tools_block(tools: Sequence[Tool]) -> str:
    listing = "\n".join(json.dumps(t.as_openai()["function"]) for t in tools)
    return (
        "You can call functions. The available functions, one JSON object per line:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, reply with one block per call and nothing else:\n"
        f'{CALL_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CALL_CLOSE}\n'
        "Function results come back inside <tool_response></tool_response>."
    )


def _call_text(calls: Sequence[Mapping[str, Any]]) -> str:
    blocks = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args_obj = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            args_obj = args
        blocks.append(
            f"{CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args_obj})}\n{CALL_CLOSE}"
        )
    return "\n".join(blocks)


def fallback_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Messages for a template without a tools section: the tools block joins (or becomes) the
    system message; assistant calls become `<tool_call>` text; tool results become user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m["role"]
        if role == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
            )
        elif role == "assistant" and m.get("tool_calls"):
            text = "\n".join(x for x in (m.get("content") or "", _call_text(m["tool_calls"])) if x)
            out.append({"role": "assistant", "content": text})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if tools:
        block = fallback_tools_block(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Tool],
    choice: ToolChoice,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text: the model's template with `tools` when it renders them, else the fallback."""
    shown = list(tools) if choice.mode != "none" else []
    if template_renders_tools(tokenizer.chat_template):
        rendered: str = tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=[t.as_openai() for t in shown] or None,
        )
        return rendered
    text: str = tokenizer.apply_chat_template(fallback_messages(messages, shown), add_generation_prompt)
    return text


# ------------------------------------------------------------------------------------------------
# The output


def parse_output(text: str, tools: Sequence[Tool], choice: ToolChoice) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output. Auto mode: calls that do not parse as a known
    function with a JSON object of arguments stay in the content as the model wrote them."""
    if choice.mode == "named":
        assert choice.name is not None
        return None, [ToolCall(choice.name, text)]
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            # cut short by max_tokens or a stop string: no half-made call, and the partial JSON is
            # not the message's content either (vLLM answers content "" and finish_reason "length")
            return "", []
        return None, [ToolCall(c["name"], json.dumps(c["arguments"])) for c in items]
    if choice.mode == "none":
        return text, []
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _CALL_RE.finditer(text):
        call = _auto_call(m.group(1), names)
        if call is None:
            continue
        if calls and not choice.parallel:
            break  # parallel_tool_calls false: the first call only; the rest stays text
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


def _auto_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args))


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI delta entries


class ToolCallStreamer:
    """Turns the text deltas of one choice into content deltas and `tool_calls` deltas.

    named: the first delta opens call 0 (id, name, empty arguments); every text delta is an
    arguments delta. required: the JSON array is held until the end, then each call is one delta.
    auto: text that may start a `<tool_call>` block is held back; content outside blocks streams,
    and the parsed calls are sent at the end."""

    def __init__(self, tools: Sequence[Tool], choice: ToolChoice) -> None:
        self.tools = tools
        self.choice = choice
        self.text = ""
        self._sent = 0  # auto: characters of `text` already sent as content
        self._named_call: ToolCall | None = None
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        mode = self.choice.mode
        if mode == "named":
            out = StreamDelta()
            if self._named_call is None:
                assert self.choice.name is not None
                self._named_call = ToolCall(self.choice.name, "")
                self.calls = [self._named_call]
                out.tool_calls.append(
                    {
                        "index": 0,
                        "id": self._named_call.id,
                        "type": "function",
                        "function": {"name": self.choice.name, "arguments": ""},
                    }
                )
            if delta:
                out.tool_calls.append({"index": 0, "function": {"arguments": delta}})
            self._named_call.arguments += delta
            return out
        if mode == "required":
            return StreamDelta()
        if mode == "none":
            return StreamDelta(content=delta)
        # auto: send what cannot be (the start of) a call block
        start = self.text.find(CALL_OPEN, self._sent)
        if start < 0:
            start = len(self.text)
            for k in range(min(len(CALL_OPEN) - 1, len(self.text) - self._sent), 0, -1):
                if CALL_OPEN.startswith(self.text[-k:]):
                    start = len(self.text) - k
                    break
        out = StreamDelta(content=self.text[self._sent : start])
        self._sent = start
        return out

    def finish(self) -> StreamDelta:
        """At the end of the output: what was held back, and the calls."""
        mode = self.choice.mode
        if mode in ("named", "none"):
            return StreamDelta()
        if mode == "required":  # whole calls, or nothing when the output was cut short
            _, self.calls = parse_output(self.text, self.tools, self.choice)
            return StreamDelta(tool_calls=[_whole_delta(i, c) for i, c in enumerate(self.calls)])
        rest = self.text[self._sent :]
        content, calls = parse_output(rest, self.tools, self.choice)
        self.calls = calls
        return StreamDelta(
            content=content or "", tool_calls=[_whole_delta(i, c) for i, c in enumerate(calls)]
        )


def _whole_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, **call.as_openai()}
