from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kvpilot.request_body import MAX_JSON_DEPTH
from kvpilot.runtime.serving.errors import APIError
from kvpilot.runtime.serving.output_processor import choice_params
from kvpilot.runtime.serving.refused_fields import REFUSED_FIELDS
from kvpilot.runtime.serving.request import (
    ChatCompletionRequest,
    CompletionRequest,
    check_token_ids,
    parse_chat_request,
    parse_completion_request,
)


def body(**kw: Any) -> bytes:
    return json.dumps(kw).encode()


def completion_error(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_completion_request(raw)
    return info.value


def chat_error(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request(raw)
    return info.value


def params_error(req: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_len: int) -> APIError:
    with pytest.raises(APIError) as info:
        req.to_sampling_params(prompt_len, max_len)
    return info.value


# -- body-level errors --------------------------------------------------------------------------


def test_malformed_json() -> None:
    e = completion_error(b'{"prompt": "hi",')
    assert e.status == 400 and "not valid JSON" in e.message and e.type == "invalid_request_error"


def test_invalid_utf8_body() -> None:
    e = completion_error(b'{"prompt": "\xff\xfe"}')
    assert e.status == 400 and "UTF-8" in e.message


def test_lone_surrogate_escape() -> None:
    e = completion_error(b'{"prompt": "bad \\ud800 char"}')
    assert e.status == 400 and "surrogate" in e.message and e.param == "prompt"


def test_empty_body_and_non_object() -> None:
    assert "empty" in completion_error(b"").message
    assert "JSON object" in completion_error(b"[1, 2]").message


# -- wrong types ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "10"),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("temperature", "hot"),
        ("n", "2"),
        ("stream", "yes"),
        ("stop", 5),
        ("seed", 1.5),
        ("logprobs", "3"),
    ],
)
def test_wrong_types_name_the_parameter(field: str, value: Any) -> None:
    e = completion_error(body(prompt="hi", **{field: value}))
    assert e.status == 400
    assert e.param == field
    assert f"'{field}'" in e.message


def test_wrong_prompt_type() -> None:
    for prompt in (5, [1, "a"], [[1], "a"], {"x": 1}, [True, False]):
        e = completion_error(body(prompt=prompt))
        assert e.status == 400 and e.param == "prompt" and "'prompt' must be" in e.message


def test_message_errors_have_a_path() -> None:
    e = chat_error(body(messages=[{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}]))
    assert e.status == 400 and e.param == "messages[1].role"
    e = chat_error(body(messages=[{"content": "hi"}]))
    assert e.param == "messages[0].role" and "required" in e.message


# -- empty inputs -------------------------------------------------------------------------------


def test_missing_or_empty_prompt() -> None:
    for raw in (body(), body(prompt=""), body(prompt=[]), body(prompt=[[]]), body(prompt=["ok", ""])):
        with pytest.raises(APIError) as info:
            parse_completion_request(raw).prompt_list()
        assert info.value.status == 400 and info.value.param == "prompt"
        assert "prompt" in info.value.message


def test_empty_messages() -> None:
    for raw in (body(messages=[]), body()):
        e = chat_error(raw)
        assert e.status == 400 and e.param == "messages" and "non-empty" in e.message


def test_prompt_forms() -> None:
    assert parse_completion_request(body(prompt="a")).prompt_list() == ["a"]
    assert parse_completion_request(body(prompt=["a", "b"])).prompt_list() == ["a", "b"]
    assert parse_completion_request(body(prompt=[1, 2])).prompt_list() == [[1, 2]]
    assert parse_completion_request(body(prompt=[[1], [2, 3]])).prompt_list() == [[1], [2, 3]]


# -- max_tokens and the context window -----------------------------------------------------------


def test_max_tokens_defaults_to_remaining_context() -> None:
    req = parse_completion_request(body(prompt="hi"))
    assert req.to_sampling_params(prompt_len=10, max_model_len=100).max_tokens == 90


def test_negative_and_zero_max_tokens() -> None:
    for v in (0, -5):
        e = completion_error(body(prompt="hi", max_tokens=v))
        assert e.status == 400 and e.param == "max_tokens" and str(v) in e.message
        e = chat_error(body(messages=[{"role": "user", "content": "x"}], max_completion_tokens=v))
        assert e.status == 400 and e.param == "max_completion_tokens" and str(v) in e.message


def test_prompt_plus_max_tokens_over_context_states_both_numbers() -> None:
    e = params_error(parse_completion_request(body(prompt="hi", max_tokens=95)), 10, 100)
    assert e.status == 400 and e.param == "max_tokens"
    assert "100" in e.message and "105" in e.message and "10 in the prompt" in e.message
    assert "95 in the completion" in e.message


def test_absurd_max_tokens() -> None:
    e = params_error(parse_completion_request(body(prompt="hi", max_tokens=10**12)), 10, 2048)
    assert e.status == 400 and "2048" in e.message


def test_prompt_alone_too_long() -> None:
    e = params_error(parse_completion_request(body(prompt="hi")), 100, 100)
    assert e.status == 400 and e.param == "prompt" and "100" in e.message
    e = params_error(parse_chat_request(body(messages=[{"role": "user", "content": "x"}])), 120, 100)
    assert e.param == "messages" and "120" in e.message


def test_chat_max_completion_tokens_wins_and_is_named() -> None:
    req = parse_chat_request(
        body(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=7)
    )
    assert req.to_sampling_params(10, 100).max_tokens == 7
    req = parse_chat_request(body(messages=[{"role": "user", "content": "x"}], max_completion_tokens=200))
    assert params_error(req, 10, 100).param == "max_completion_tokens"


# -- value ranges (pydantic constraints, reported with the parameter name) ----------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
    ],
)
def test_out_of_range_values(field: str, value: float) -> None:
    e = completion_error(body(prompt="hi", **{field: value}))
    assert e.status == 400 and e.param == field and e.message.startswith(f"'{field}' must be")
    assert e.message.endswith(f"got {value!r}")
    e = chat_error(body(messages=[{"role": "user", "content": "x"}], **{field: value}))
    assert e.status == 400 and e.param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("temperature", 100.0),
        ("top_p", 1.0),
        ("top_k", -1),
        ("min_p", 1.0),
        ("presence_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("repetition_penalty", 10.0),
    ],
)
def test_range_bounds_are_accepted(field: str, value: float) -> None:
    params = parse_completion_request(body(prompt="hi", **{field: value})).to_sampling_params(5, 100)
    assert getattr(params, field) == value


def test_min_tokens_over_max_tokens() -> None:
    e = params_error(parse_completion_request(body(prompt="hi", max_tokens=5, min_tokens=6)), 5, 100)
    assert e.param == "min_tokens" and "6" in e.message and "5" in e.message
    # against the default max_tokens too: what fits after the prompt
    e = params_error(parse_completion_request(body(prompt="hi", min_tokens=96)), 5, 100)
    assert e.param == "min_tokens" and "95" in e.message
    assert completion_error(body(prompt="hi", min_tokens=-1)).param == "min_tokens"


def test_n_and_logprobs_ranges() -> None:
    assert completion_error(body(prompt="hi", n=0)).param == "n"
    assert completion_error(body(prompt="hi", n=1000)).param == "n"
    assert completion_error(body(prompt="hi", logprobs=21)).param == "logprobs"
    e = chat_error(body(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=50))
    assert e.param == "top_logprobs"
    e = chat_error(body(messages=[{"role": "user", "content": "x"}], top_logprobs=2))
    assert e.param == "top_logprobs" and "logprobs" in e.message


def test_empty_stop_string_rejected() -> None:
    e = completion_error(body(prompt="hi", stop=["ok", ""]))
    assert e.param == "stop" and "empty" in e.message


def test_negative_stop_token_ids() -> None:
    assert completion_error(body(prompt="hi", stop_token_ids=[-1])).param == "stop_token_ids"


def test_token_ids_checked_against_vocab() -> None:
    check_token_ids([0, 5], 10, "prompt")
    with pytest.raises(APIError) as info:
        check_token_ids([0, 10], 10, "prompt")
    assert "10" in info.value.message and info.value.param == "prompt"


# -- unsupported features ------------------------------------------------------------------------


def test_unsupported_features_are_400_with_param() -> None:
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        (body(messages=msgs, functions=[{"name": "f"}]), "functions"),
        (body(messages=msgs, function_call="auto"), "function_call"),
        (body(messages=msgs, logit_bias={"5": 1.0}), "logit_bias"),
        (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), None),
    ]
    for raw, param in cases:
        req_or_err: Any
        try:
            req_or_err = parse_chat_request(raw)
            req_or_err.template_messages()
            pytest.fail(f"accepted {raw!r}")
        except APIError as e:
            assert e.status == 400
            if param:
                assert e.param == param and "not supported" in e.message
            else:
                assert "only text content parts" in e.message
    for raw, param in [
        (body(prompt="x", suffix="y"), "suffix"),
        (body(prompt="x", best_of=3), "best_of"),
        (body(prompt="x", max_tokens=0), "max_tokens"),
        (body(prompt="x", stream=True, prompt_logprobs=1), "prompt_logprobs"),
        (body(prompt="x", prompt_logprobs=-1), "prompt_logprobs"),
        (body(prompt="x", stream_options={"include_usage": True}), "stream_options"),
    ]:
        assert completion_error(raw).param == param


def test_accepted_chat_forms() -> None:
    req = parse_chat_request(
        body(
            model="m",
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
            ],
            response_format={"type": "text"},
            tool_choice="none",
            user="someone",
            unknown_extra_field=1,
        )
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]


# -- model name and conversion --------------------------------------------------------------------


def test_unknown_model_is_404() -> None:
    req = parse_completion_request(body(prompt="x", model="gpt-4"))
    with pytest.raises(APIError) as info:
        req.check_model("smollm2")
    e = info.value
    assert e.status == 404 and e.code == "model_not_found" and "gpt-4" in e.message and e.param == "model"
    parse_completion_request(body(prompt="x", model="smollm2")).check_model("smollm2")
    parse_completion_request(body(prompt="x")).check_model("smollm2")  # model may be omitted


def test_conversion_to_sampling_params() -> None:
    req = parse_completion_request(
        body(
            prompt="x",
            max_tokens=7,
            temperature=0,
            top_p=0.5,
            top_k=4,
            min_p=0.1,
            n=3,
            stop="END",
            seed=11,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.1,
            ignore_eos=True,
            min_tokens=2,
            stop_token_ids=[9],
            logprobs=2,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        )
    )
    p = req.to_sampling_params(3, 100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.0, 0.5, 4, 0.1)
    assert p.stop == ["END"] and p.stop_token_ids == [9] and p.seed == 11 and p.logprobs == 2
    assert p.ignore_eos and p.min_tokens == 2 and not p.skip_special_tokens and p.include_stop_str_in_output
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.1)
    c = choice_params(p, 2)
    assert c.seed == 13 and p.seed == 11 and c.max_tokens == p.max_tokens
    assert choice_params(parse_completion_request(body(prompt="x")).to_sampling_params(1, 10), 2).seed is None


def test_chat_logprobs_conversion() -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert parse_chat_request(body(messages=msgs)).to_sampling_params(1, 10).logprobs is None
    assert parse_chat_request(body(messages=msgs, logprobs=True)).to_sampling_params(1, 10).logprobs == 0
    req = parse_chat_request(body(messages=msgs, logprobs=True, top_logprobs=3))
    assert req.to_sampling_params(1, 10).logprobs == 3


def test_defaults() -> None:
    p = parse_completion_request(body(prompt="x")).to_sampling_params(1, 10)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (1.0, 1.0, 0, None, [])


# -- hostile bodies: every one a 400 naming what is wrong, never an exception ------------------------


def test_deep_nesting_is_400() -> None:
    for depth in (MAX_JSON_DEPTH + 1, 1_000, 100_000):  # 100,000 exceeds the JSON parser's recursion limit
        raw = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
        e = completion_error(raw)
        assert e.status == 400 and "deeper than" in e.message
    ok = b'{"prompt": "x", "tool_choice": ' + b"[" * 10 + b"]" * 10 + b"}"
    assert parse_completion_request(ok).prompt == "x"


def test_integer_beyond_python_digit_limit_is_400() -> None:
    e = completion_error(b'{"prompt": "x", "max_tokens": ' + b"9" * 5_000 + b"}")
    assert e.status == 400 and "4300 digits" in e.message and "set_int_max_str_digits" not in e.message


FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_float_fields_refuse_nan_and_infinity(field: str, literal: str) -> None:
    raw = f'{{"prompt": "x", "{field}": {literal}}}'.encode()
    e = completion_error(raw)
    assert e.status == 400 and e.param == field and "finite" in e.message
    raw = f'{{"messages": [{{"role": "user", "content": "x"}}], "{field}": {literal}}}'.encode()
    assert chat_error(raw).param == field


def test_logit_bias_values_refuse_nan() -> None:
    assert completion_error(b'{"prompt": "x", "logit_bias": {"5": NaN}}').param.startswith("logit_bias")


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seed_out_of_range_names_seed(seed: int) -> None:
    e = completion_error(body(prompt="x", seed=seed))
    assert e.status == 400 and e.param == "seed" and "overflow" not in e.message.lower()


def test_extreme_seeds_in_range_are_accepted() -> None:
    for seed in (2**63 - 1, -(2**63)):
        req = parse_completion_request(body(prompt="x", seed=seed, n=3))
        params = req.to_sampling_params(2, 100)
        for i in range(3):
            torch.Generator().manual_seed(choice_params(params, i).seed)  # in the generator's range


# -- vLLM fields whose meaning is not implemented -------------------------------------------------

MEANINGFUL = {  # a value that asks for something, per refused field
    "guided_whitespace_pattern": " ",
    "guided_decoding_backend": "outlines",
    "structured_outputs": {"json": {"type": "object"}},
    "logits_processors": ["my.module:proc"],
    "lora_request": {"lora_name": "a", "lora_int_id": 1, "lora_path": "/x"},
    "prompt_logprobs": 1,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "use_beam_search": True,
    "length_penalty": 0.5,
    "truncate_prompt_tokens": 10,
    "return_tokens_as_token_ids": True,
    "return_token_ids": True,
    "spaces_between_special_tokens": False,
    "add_special_tokens": False,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": True},
    "documents": [{"text": "d"}],
    "mm_processor_kwargs": {"a": 1},
    "prompt_embeds": "AAAA",
    "priority": 1,
    "vllm_xargs": {"a": 1},
    "reasoning_effort": "high",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy"},
}


def test_every_refused_field_has_a_case() -> None:
    assert set(MEANINGFUL) == set(REFUSED_FIELDS)


@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
def test_refused_fields_are_400_naming_the_field(field: str) -> None:
    value = MEANINGFUL[field]
    if field not in CompletionRequest.model_fields:  # prompt_logprobs: completions implement it
        e = completion_error(json.dumps({"prompt": "x", field: value}).encode())
        assert e.status == 400 and e.param == field and "not supported" in e.message
    e = chat_error(json.dumps({"messages": [{"role": "user", "content": "x"}], field: value}).encode())
    assert e.param == field
    if field == "priority":  # true == 1 in Python; it is still not the neutral 0
        assert completion_error(json.dumps({"prompt": "x", field: True}).encode()).param == field


@pytest.mark.parametrize("field", sorted(REFUSED_FIELDS))
def test_refused_fields_accept_their_neutral_values(field: str) -> None:
    for value in REFUSED_FIELDS[field][1]:
        assert parse_completion_request(json.dumps({"prompt": "x", field: value}).encode()).prompt == "x"


def test_prompt_logprobs_requests() -> None:
    """echo + logprobs asks the engine for prompt logprobs (the larger k when prompt_logprobs also
    does); max_tokens 0 with echo runs one token, which the response leaves out."""
    req = parse_completion_request(body(prompt=[1, 2, 3], echo=True, logprobs=2, max_tokens=0))
    params = req.to_sampling_params(3, 100)
    assert (
        req.echo_logprobs and params.prompt_logprobs == 2 and params.logprobs == 2 and params.max_tokens == 1
    )
    req = parse_completion_request(body(prompt="x", echo=True, logprobs=1, prompt_logprobs=4))
    assert req.to_sampling_params(1, 100).prompt_logprobs == 4
    req = parse_completion_request(body(prompt="x", logprobs=3))
    assert not req.echo_logprobs and req.to_sampling_params(1, 100).prompt_logprobs is None
    assert (
        parse_completion_request(body(prompt="x", echo=True)).to_sampling_params(1, 100).prompt_logprobs
        is None
    )


def test_chat_echo_is_refused() -> None:
    e = chat_error(body(messages=[{"role": "user", "content": "x"}], echo=True))
    assert e.param == "echo"


def test_continuous_usage_stats_needs_include_usage() -> None:
    e = completion_error(body(prompt="x", stream=True, stream_options={"continuous_usage_stats": True}))
    assert e.param == "stream_options.continuous_usage_stats"
    req = parse_completion_request(
        body(prompt="x", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    )
    assert req.continuous_usage and req.include_usage


def test_default_max_tokens_fits_the_kv_pool() -> None:
    req = parse_completion_request(body(prompt="x"))
    assert req.to_sampling_params(10, 1000, kv_capacity=64).max_tokens == 54
    assert req.to_sampling_params(10, 50, kv_capacity=64).max_tokens == 40
    with pytest.raises(APIError) as info:
        req.to_sampling_params(64, 1000, kv_capacity=64)
    assert info.value.param == "prompt" and "64" in info.value.message
    # an explicit max_tokens that can never fit in the pool is refused here, naming it
    req = parse_completion_request(body(prompt="x", max_tokens=500))
    with pytest.raises(APIError) as info:
        req.to_sampling_params(10, 1000, kv_capacity=64)
    assert info.value.param == "max_tokens" and "510" in info.value.message and "64" in info.value.message
    assert req.to_sampling_params(10, 1000, kv_capacity=510).max_tokens == 500


# -- structured output fields (the engine side: tests/runtime/test_structured_output.py) ----------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            "json_schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            "json_schema",
        ),
        ({"guided_json": SCHEMA}, "json_schema"),
        ({"guided_json": json.dumps(SCHEMA)}, "json_schema"),
        ({"guided_json": True}, "json_schema"),  # JSON Schema's true: any JSON value
        ({"guided_json": "true"}, "json_schema"),
        ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}}, "json_schema"),
        # keywords are looked for in schema positions only, never in property names or data
        ({"guided_json": {"properties": {"not": {"const": {"if": 1}}}}}, "json_schema"),
        ({"guided_json": {"type": "array", "uniqueItems": False}}, "json_schema"),
        ({"guided_regex": "[a-z]+"}, "regex"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_grammar": 'root ::= "a" | "b"'}, "grammar"),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "x"}, "regex"),
    ],
)
def test_structured_output_fields_become_the_guided_spec(fields: dict[str, Any], kind: str) -> None:
    for raw in (body(prompt="x", **fields), body(messages=[{"role": "user", "content": "x"}], **fields)):
        req = parse_chat_request(raw) if b"messages" in raw else parse_completion_request(raw)
        params = req.to_sampling_params(2, 100)
        assert params.guided is not None and params.guided.kind == kind
        assert choice_params(params, 1).guided == params.guided  # each choice gets the same spec


def test_text_response_format_constrains_nothing() -> None:
    req = parse_chat_request(
        body(messages=[{"role": "user", "content": "x"}], response_format={"type": "text"})
    )
    assert req.to_sampling_params(2, 100).guided is None


@pytest.mark.parametrize(
    ("fields", "param", "problem"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        # schemas are checked against the JSON Schema metaschema, and regexes and grammars parsed
        # by xgrammar, only in a grammar worker process when the server compiles them (their 400s:
        # test_structured_api.py, test_grammar_service.py)
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty"),
        # JSON Schema's false allows no value; a schema string is held to the body's nesting limit
        ({"guided_json": False}, "guided_json", "no value satisfies"),
        ({"guided_json": "false"}, "guided_json", "no value satisfies"),
        ({"guided_json": "[" * 100_000}, "guided_json", f"deeper than {MAX_JSON_DEPTH} levels"),
        ({"guided_json": '{"items": ' * 5_000 + "{}" + "}" * 5_000}, "guided_json", "deeper than"),
        ({"guided_json": '{"items": ' * 200 + "{}" + "}" * 200}, "guided_json", "deeper than"),
        # a constraint the grammar engine would drop is refused, not ignored
        ({"guided_json": {"$ref": "http://example.com/s.json"}}, "guided_json", "only references inside"),
        (
            {"guided_json": {"properties": {"a": {"$ref": "file:///etc/passwd"}}}},
            "guided_json",
            "'$ref' at 'properties/a'",
        ),
        (
            {"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
            "guided_json",
            "'uniqueItems' at the top level",
        ),
        (
            {"guided_json": {"properties": {"n": {"not": {"const": 3}}}}},
            "guided_json",
            "'not' at 'properties/n'",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"if": {}, "then": {"required": ["a"]}}},
                }
            },
            "response_format.json_schema.schema",
            "conditional subschemas",
        ),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "not supported"),
        ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens", "structured output"),
    ],
)
def test_bad_structured_output_is_400_naming_field_and_problem(
    fields: dict[str, Any], param: str, problem: str
) -> None:
    for raw in (body(prompt="x", **fields), body(messages=[{"role": "user", "content": "x"}], **fields)):
        e = chat_error(raw) if b"messages" in raw else completion_error(raw)
        assert e.status == 400 and e.param == param, e.message
        assert problem in e.message, e.message


def test_tools_and_tool_choice_are_parsed_and_checked() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "x"}]
    req = parse_chat_request(body(messages=msgs, tools=tools, tool_choice="required"))
    ts, choice = req.tool_settings
    assert [t.name for t in ts] == ["f"] and choice.mode == "required"
    assert req.to_sampling_params(2, 100).guided is not None  # required is enforced by a grammar
    auto = parse_chat_request(body(messages=msgs, tools=tools))
    assert auto.tool_settings[1].mode == "auto" and auto.to_sampling_params(2, 100).guided is None
    for raw, param in [
        (body(messages=msgs, tool_choice="auto"), "tool_choice"),  # auto without tools
        (
            body(messages=msgs, tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}),
            "tool_choice.function.name",
        ),
        (body(messages=msgs, tools=tools, tool_choice="required", guided_regex="a"), "tool_choice"),
        (body(messages=msgs, tools=tools, tool_choice="required", min_tokens=1), "min_tokens"),
        (body(messages=[*msgs, {"role": "tool", "content": "r"}]), "messages[1].tool_call_id"),
        (
            body(
                messages=[
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            ),
            "messages[0].tool_calls",
        ),
    ]:
        assert chat_error(raw).param == param


def test_continue_final_message_renders_the_open_turn_the_generation_prompt_would_start() -> None:
    """vLLM's continue_final_message: the prompt is the conversation up to the end of the final
    assistant text, which is the generation prompt followed by that text (the router's migration)."""
    from kvpilot.runtime.serving.prepare import ServingLimits, prepare_chat
    from tests.runtime.fake_engine import FakeTokenizer

    tok = FakeTokenizer()
    limits = ServingLimits(max_model_len=512, kv_capacity_tokens=4096, max_queue_len=8, vocab_size=None)
    user = [{"role": "user", "content": "Hi"}]
    fresh = prepare_chat(json.dumps({"messages": user}).encode(), tok, limits, "m")
    body = {
        "messages": [*user, {"role": "assistant", "content": "Hello the"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    cont = prepare_chat(json.dumps(body).encode(), tok, limits, "m")
    expected = tok.encode(tok.apply_chat_template(user) + "Hello the", add_special_tokens=False)
    assert cont.prompts[0].token_ids == expected
    assert cont.prompts[0].token_ids[: len(fresh.prompts[0].token_ids)] == fresh.prompts[0].token_ids
    for wrong, message in (
        ({**body, "add_generation_prompt": True}, "needs 'add_generation_prompt' false"),
        ({**body, "messages": user}, "continues a final assistant message"),
    ):
        with pytest.raises(APIError, match=message) as e:
            prepare_chat(json.dumps(wrong).encode(), tok, limits, "m")
        assert e.value.param == "continue_final_message"
