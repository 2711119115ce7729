"""Tool calling over HTTP against the real SmolLM2 engine with the official `openai` client: the
client's usual loop (call -> run the tool -> send the result back) runs unchanged; required and named
choices give arguments valid for the function's schema, whole and streamed."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fake_engine import LiveServer

from kvpilot.runtime.serving.tool_calls import ToolChoice, parse_tools, render_chat

pytestmark = pytest.mark.timeout(600)

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def get_weather(city: str, unit: str) -> dict[str, Any]:
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit}


@pytest.fixture(scope="module")
def live(make_engine: Callable[..., Any]) -> Iterator[tuple[LiveServer, Any]]:
    from kvpilot.runtime.engine.async_engine import AsyncEngine

    engine = AsyncEngine(make_engine(max_model_len=1024))
    engine.start()
    server = LiveServer(engine, model_name=engine.model_name)
    yield server, engine
    server.close()


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_tool_calling_loop(live: tuple[LiveServer, Any]) -> None:
    server, engine = live
    c = client(server)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = c.chat.completions.create(
        model=engine.model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # left free, a 135M model repeats calls until max_tokens
        max_tokens=120,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        schema = PARAMS if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
        jsonschema.validate(args, schema)
    # the client's loop: append the assistant message as returned, then one result per call
    messages.append(choice.message)
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        result = get_weather(**args) if call.function.name == "get_weather" else {"time": "12:00"}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    second = c.chat.completions.create(
        model=engine.model_name, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the history (the call and its result) reached the prompt, rendered as documented
    history = [
        {"role": "user", "content": messages[0]["content"]},
        choice.message.model_dump(),
        *messages[2:],
    ]
    tok = engine.tokenizer
    want = tok.encode(
        render_chat(tok, history, parse_tools(TOOLS), ToolChoice("auto")), add_special_tokens=False
    )
    assert second.usage is not None and second.usage.prompt_tokens == len(want)


def test_named_function_whole_and_streamed(live: tuple[LiveServer, Any]) -> None:
    server, engine = live
    c = client(server)
    messages: Any = [{"role": "user", "content": "Weather in Oslo in fahrenheit?"}]
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    whole = c.chat.completions.create(
        model=engine.model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=60,
        temperature=0,
    )
    call = whole.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and whole.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    stream = c.chat.completions.create(
        model=engine.model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    ids, names, args, finish = set(), set(), "", None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                if d.id:
                    ids.add(d.id)
                if d.function and d.function.name:
                    names.add(d.function.name)
                if d.function and d.function.arguments:
                    args += d.function.arguments
            finish = ch.finish_reason or finish
    assert len(ids) == 1 and names == {"get_weather"} and finish == "tool_calls"
    assert args == call.function.arguments  # streamed deltas add up to the whole response's arguments


def test_required_streamed_and_auto_parsed(live: tuple[LiveServer, Any]) -> None:
    server, engine = live
    c = client(server)
    messages: Any = [{"role": "user", "content": "What time is it?"}]
    stream = c.chat.completions.create(
        model=engine.model_name,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # left free, a 135M model repeats calls until max_tokens
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    calls = [d for chunk in stream for ch in chunk.choices for d in ch.delta.tool_calls or []]
    assert calls and all(
        d.id and d.function and d.function.name in ("get_weather", "get_time") for d in calls
    )
    # auto: the model decides; a grammar makes it write a call here, which the parser must turn into
    # tool_calls (and no content), streamed and whole
    forced = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    whole = c.chat.completions.create(
        model=engine.model_name,
        messages=messages,
        tools=TOOLS,
        max_tokens=40,
        temperature=0,
        extra_body={"guided_choice": [forced]},
    )
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(t.function.name, t.function.arguments) for t in msg.tool_calls or []] == [("get_time", "{}")]
    stream = c.chat.completions.create(
        model=engine.model_name,
        messages=messages,
        tools=TOOLS,
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"guided_choice": [forced]},
    )
    chunks = list(stream)
    content = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
    deltas = [d for chunk in chunks for ch in chunk.choices for d in ch.delta.tool_calls or []]
    assert content == "" and [d.function.name for d in deltas if d.function] == ["get_time"]


def test_required_cut_short_by_max_tokens_is_length_without_a_partial_call(
    live: tuple[LiveServer, Any],
) -> None:
    """vLLM's answer: finish_reason length, no tool call, and not the partial JSON as content."""
    server, engine = live
    c = client(server)
    args: Any = {
        "model": engine.model_name,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 4,
        "temperature": 0,
    }
    out = c.chat.completions.create(**args)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage is not None and out.usage.completion_tokens == 4
    assert not choice.message.content and not choice.message.tool_calls, choice.message
    chunks = list(c.chat.completions.create(**args, stream=True))
    content = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
    calls = [d for chunk in chunks for ch in chunk.choices for d in ch.delta.tool_calls or []]
    finish = [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason]
    assert (content, calls, finish) == ("", [], ["length"])


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(
    live: tuple[LiveServer, Any], extra: dict[str, Any], param: str
) -> None:
    server, engine = live
    body = {"tools": TOOLS, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            extra_body=body,
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param, info.value.body


def test_a_tool_message_needs_its_call_id(live: tuple[LiveServer, Any]) -> None:
    server, engine = live
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}],  # type: ignore[list-item]
            max_tokens=5,
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "messages[1].tool_call_id"
