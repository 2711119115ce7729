"""Tool calling's pure parts: tools/tool_choice parsing, the prompt through SmolLM2's own template
(no tools section: the documented fallback block), the grammar for required/named, and the output
parser, whole and streamed. The HTTP loop with the official client is in test_tool_calls_api.py."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from kvpilot.runtime.grammar.structured_output import GrammarCompiler, check_spec
from kvpilot.runtime.load.loader import builtin_model_path
from kvpilot.runtime.load.tokenizer import Tokenizer
from kvpilot.runtime.serving.tool_calls import (
    CALL_OPEN,
    Tool,
    ToolCallStreamer,
    ToolChoice,
    ToolError,
    guided_for_tools,
    parse_output,
    parse_tool_choice,
    parse_tools,
    render_chat,
    template_renders_tools,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(builtin_model_path("smollm2-135m-instruct"))


def tools() -> list[Tool]:
    return parse_tools([WEATHER, TIME])


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([WEATHER, WEATHER], "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tools[0].function.parameters",
        ),
        ("not a list", "tools"),
    ],
)
def test_bad_tools_name_the_field(raw: Any, param: str) -> None:
    with pytest.raises(ToolError) as info:
        parse_tools(raw)
    assert info.value.param == param


def test_tool_choice_forms() -> None:
    ts = tools()
    assert parse_tool_choice(None, ts) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("required", ts) == ToolChoice("required")
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, ts) == ToolChoice(
        "named", "get_time"
    )
    with pytest.raises(ToolError) as info:
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, ts)
    assert info.value.param == "tool_choice.function.name"
    with pytest.raises(ToolError):
        parse_tool_choice("required", [])
    with pytest.raises(ToolError):
        parse_tool_choice("sometimes", ts)


def test_smollm2_template_has_no_tools_section_so_the_fallback_block_is_rendered(
    tokenizer: Tokenizer,
) -> None:
    assert not template_renders_tools(tokenizer.chat_template)
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C, snow"},
    ]
    text = render_chat(tokenizer, messages, tools(), ToolChoice("auto"))
    # SmolLM2's own template renders the turns: the fallback block is its system message
    assert text.startswith("<|im_start|>system\nYou can call functions.")
    assert '"name": "get_weather"' in text and '"description": "Current weather in a city"' in text
    assert (
        f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Oslo", "unit": "celsius"}}}}' in text
    )
    assert "<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice none: the tools are not shown
    assert "You can call functions" not in render_chat(tokenizer, messages, tools(), ToolChoice("none"))


def test_a_template_with_a_tools_section_renders_them_itself(tokenizer: Tokenizer) -> None:
    own = Tokenizer(
        tokenizer.backend,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=set(tokenizer.eos_token_ids),
        chat_template="{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    assert template_renders_tools(own.chat_template)
    assert (
        render_chat(own, [{"role": "user", "content": "hi"}], tools(), ToolChoice("auto"))
        == "[get_weather][get_time]hi"
    )


def test_required_and_named_grammars_accept_exactly_valid_calls() -> None:
    ts = tools()
    required = guided_for_tools(ts, ToolChoice("required"))
    named = guided_for_tools(ts, ToolChoice("named", "get_weather"))
    assert required is not None and named is not None and guided_for_tools(ts, ToolChoice("auto")) is None
    check_spec(required)
    check_spec(named)
    schema = json.loads(required.source)
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    assert json.loads(named.source) == WEATHER["function"]["parameters"]  # type: ignore[index]


def test_parse_output_per_mode() -> None:
    ts = tools()
    content, calls = parse_output(
        '{"city": "Oslo", "unit": "celsius"}', ts, ToolChoice("named", "get_weather")
    )
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})
    ]
    content, calls = parse_output('[{"name": "get_time", "arguments": {}}]', ts, ToolChoice("required"))
    assert content is None and [c.name for c in calls] == ["get_time"]
    text = f'Let me check.\n{CALL_OPEN}\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>'
    content, calls = parse_output(text, ts, ToolChoice("auto"))
    assert content == "Let me check." and [c.name for c in calls] == ["get_time"]
    # an unknown function or broken JSON is not a call: the text stays content
    bad = f'{CALL_OPEN}{{"name": "rm_rf", "arguments": {{}}}}</tool_call>'
    assert parse_output(bad, ts, ToolChoice("auto")) == (bad, [])
    assert parse_output("just text", ts, ToolChoice("auto")) == ("just text", [])


def test_streamer_auto_holds_back_a_possible_call_and_sends_calls_at_the_end() -> None:
    ts = tools()
    s = ToolCallStreamer(ts, ToolChoice("auto"))
    pieces = ["Sure", ". <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>']
    sent = "".join(s.feed(p).content for p in pieces)
    assert sent == "Sure. "  # nothing of the call block leaked as content
    end = s.finish()
    assert end.content == "" and end.tool_calls[0]["function"]["name"] == "get_time"
    # text that only looked like a tag start is released
    s = ToolCallStreamer(ts, ToolChoice("auto"))
    assert s.feed("a <to").content == "a "
    assert s.feed("day").content == "<today"


def test_streamer_named_streams_arguments_deltas() -> None:
    s = ToolCallStreamer(tools(), ToolChoice("named", "get_weather"))
    first = s.feed('{"city": ')
    assert first.tool_calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first.tool_calls[1] == {"index": 0, "function": {"arguments": '{"city": '}}
    second = s.feed('"Oslo", "unit": "celsius"}')
    assert [d["function"]["arguments"] for d in second.tool_calls] == ['"Oslo", "unit": "celsius"}']
    assert s.finish().tool_calls == [] and json.loads(s.calls[0].arguments)["city"] == "Oslo"


def test_required_cut_short_has_neither_calls_nor_the_partial_json_as_content() -> None:
    """max_tokens (or a stop string) ends a required call mid-JSON: like vLLM, no half-made call
    and no raw JSON in `content`; whole and streamed."""
    partial = '[{"name": "get_weather", "arguments": {"city": "Os'
    assert parse_output(partial, tools(), ToolChoice("required")) == ("", [])
    s = ToolCallStreamer(tools(), ToolChoice("required"))
    assert s.feed(partial).content == ""
    end = s.finish()
    assert (end.content, end.tool_calls, s.calls) == ("", [], [])


def test_a_tool_schema_the_grammar_cannot_enforce_is_refused_only_when_it_constrains() -> None:
    unique = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        },
    }
    ts = parse_tools([WEATHER, unique])  # auto: the schema is only shown to the model
    assert guided_for_tools(ts, ToolChoice("auto")) is None
    assert guided_for_tools(ts, ToolChoice("named", "get_weather")) is not None
    for choice in (ToolChoice("required"), ToolChoice("named", "tag")):
        with pytest.raises(ToolError) as info:
            guided_for_tools(ts, choice)
        assert info.value.param == "tools[1].function.parameters"
        assert "'uniqueItems' at 'properties/tags'" in str(info.value)


def test_required_keeps_each_tools_local_references(tokenizer: Tokenizer) -> None:
    """pydantic-made parameters use $defs and '#/$defs/...' refs; inside the array of calls they
    must still resolve (before: 'Cannot find field $defs', a 400 for a valid request)."""
    point = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "$defs": {
                    "P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
                },
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/P"}},
                "required": ["to"],
            },
        },
    }
    ts = parse_tools([WEATHER, point])
    spec = guided_for_tools(ts, ToolChoice("required"))
    assert spec is not None
    schema = json.loads(spec.source)
    jsonschema.validate([{"name": "move", "arguments": {"to": {"x": 1}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "move", "arguments": {"to": {"x": "one"}}}], schema)
    state = GrammarCompiler.for_tokenizer(tokenizer).new_state(spec)
    assert state.matcher.accept_string('[{"name": "move", "arguments": {"to": {"x": 1')
