"""Structured output over HTTP with the official `openai` client against the real SmolLM2 engine:
response_format and vLLM's guided_* fields on both endpoints, streaming, n, stop strings, and 400s
that name the field and the problem."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import openai
import pytest
from fake_engine import LiveServer

pytestmark = pytest.mark.timeout(600)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["city", "population", "landmarks"],
}
MESSAGES = [{"role": "user", "content": "Tell me about Paris as JSON."}]


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


def test_chat_json_schema_n_and_streaming(live: tuple[LiveServer, Any]) -> None:
    server, engine = live
    c = client(server)
    rf: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    out = c.chat.completions.create(
        model=engine.model_name,
        messages=MESSAGES,
        response_format=rf,
        max_tokens=100,
        n=2,
        temperature=1.0,
        seed=3,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    stream = c.chat.completions.create(
        model=engine.model_name,
        messages=MESSAGES,
        response_format=rf,
        max_tokens=100,
        temperature=0,
        stream=True,
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    again = c.chat.completions.create(
        model=engine.model_name, messages=MESSAGES, response_format=rf, max_tokens=100, temperature=0
    )
    assert again.choices[0].message.content == text  # streaming and not agree at temperature 0


def test_completions_guided_fields_and_stop_strings(live: tuple[LiveServer, Any]) -> None:
    server, engine = live
    c = client(server)
    prompt = "The answer, in JSON: "
    out = c.completions.create(
        model=engine.model_name,
        prompt=prompt,
        max_tokens=100,
        temperature=0,
        extra_body={"guided_json": SCHEMA},
    )
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    obj = c.completions.create(  # the client has no response_format argument for completions
        model=engine.model_name,
        prompt=prompt,
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(obj.choices[0].text), dict)
    choice = c.completions.create(
        model=engine.model_name,
        prompt="Is the sky blue? Answer:",
        max_tokens=10,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].text in ("yes", "no")
    regex = c.completions.create(
        model=engine.model_name,
        prompt="A phone number:",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_regex": r"\+1-[0-9]{3}-[0-9]{4}"},
    )
    assert regex.choices[0].text.startswith("+1-") and len(regex.choices[0].text) == 11
    # a stop string cuts guided output like any other
    cut = c.completions.create(
        model=engine.model_name,
        prompt="A phone number:",
        max_tokens=20,
        temperature=0,
        stop=["-"],
        extra_body={"guided_regex": r"\+1-[0-9]{3}-[0-9]{4}"},
    )
    assert cut.choices[0].text == "+1" and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("extra", "param", "problem"),
    [
        (
            {"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}},
            "guided_json",
            "invalid JSON schema",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar", "not defined"),
        # unsatisfiable: refused when compiled (before: a 503 "aborted by the server (shutting
        # down)" once the engine found no allowed token, and an ERROR log)
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "no output can satisfy it"),
        ({"guided_grammar": "root ::= root"}, "guided_grammar", "no output can satisfy it"),
        # a constraint xgrammar would drop (it never fetches a URL or a file): before, a 200 with
        # unconstrained output
        ({"guided_json": {"$ref": "http://example.com/schema.json"}}, "guided_json", "only references"),
        ({"guided_json": {"$ref": "file:///etc/passwd"}}, "guided_json", "only references"),
        (
            {"guided_json": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
            "guided_json",
            "cannot be enforced",
        ),
        # no finite instance: a required property that is the whole schema again (before: ran to
        # max_tokens)
        (
            {"guided_json": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}},
            "guided_json",
            "no finite instance",
        ),
        ({"guided_json": False}, "guided_json", "no value satisfies"),
        # a schema string nested past the body's limit: before, a 500 with a traceback (5,000 deep)
        # or a 400 that leaked "maximum recursion depth exceeded" (200 deep)
        ({"guided_json": '{"items": ' * 5_000 + "{}" + "}" * 5_000}, "guided_json", "deeper than 64"),
        ({"guided_json": "[" * 100_000}, "guided_json", "deeper than 64"),
        ({"guided_json": '{"items": ' * 200 + "{}" + "}" * 200}, "guided_json", "deeper than 64"),
        # over --grammar-max-bytes: refused before any compile (before: 100k choices stalled
        # every client 17 s)
        ({"guided_choice": [f"item{i}" for i in range(30_000)]}, "guided_choice", "--grammar-max-bytes"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"minimum": "zero"}},
                }
            },
            "response_format.json_schema.schema",
            "invalid JSON schema",
        ),
    ],
)
def test_invalid_constraints_are_400_naming_field_and_problem(
    live: tuple[LiveServer, Any], extra: dict[str, Any], param: str, problem: str
) -> None:
    server, engine = live
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=engine.model_name, messages=MESSAGES, max_tokens=5, extra_body=extra)
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    assert problem in err["message"] and "recursion" not in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=engine.model_name, prompt="x", max_tokens=5, extra_body=extra)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == param


def test_json_schema_true_is_any_json(live: tuple[LiveServer, Any]) -> None:
    """JSON Schema's `true` allows any JSON value (before: refused as a wrong type)."""
    server, engine = live
    out = client(server).completions.create(
        model=engine.model_name,
        prompt="A JSON value: ",
        max_tokens=30,
        temperature=0,
        extra_body={"guided_json": True},
    )
    if out.choices[0].finish_reason == "stop":
        json.loads(out.choices[0].text)
    else:  # cut by max_tokens: still the start of JSON
        assert out.choices[0].text[:1] in '{["-0123456789tfn'
