"""The router's P/D decisions (router/pd.py): which requests take the prefill pool, and the two legs' bodies."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvpilot.router.cli import add_arguments, build_router
from kvpilot.router.discovery import add_prefill_endpoints, parse_endpoints
from kvpilot.router.pd import (
    PREFILL_SLACK,
    PdSettings,
    PrefillSpeed,
    decode_body,
    held_path,
    needs_prefill,
    plan,
    prefill_body,
    prefill_budget_s,
    prompt_tokens,
    should_disaggregate,
    transfer_params,
)

PD = PdSettings(min_prompt_tokens=100, transfer_timeout_s=5.0)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def test_the_threshold_splits_short_prompts_from_long_ones() -> None:
    assert should_disaggregate(100, 100) and not should_disaggregate(99, 100)
    assert should_disaggregate(0, 0)  # a threshold of 0 sends every prompt to the prefill pool
    # a text prompt is estimated at 4 characters a token: 396 characters are 99 tokens
    assert plan({"prompt": "x" * 396}, False, PD, 1).path == "direct"
    assert plan({"prompt": "x" * 400}, False, PD, 1).path == "disaggregated"
    # chat: the messages' text with a role marker each ("<user>" and a newline: 7 characters)
    assert prompt_tokens(chat("x" * 393), True) == 100
    assert plan(chat("x" * 393), True, PD, 1).path == "disaggregated"
    assert plan(chat("x" * 380), True, PD, 1).path == "direct"


def test_token_id_prompts_are_counted_exactly() -> None:
    assert prompt_tokens({"prompt": list(range(100))}, False) == 100
    assert prompt_tokens({"prompt": [list(range(150))]}, False) == 150
    assert plan({"prompt": list(range(99))}, False, PD, 1).path == "direct"
    assert plan({"prompt": [list(range(100))]}, False, PD, 1).path == "disaggregated"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"prompt": ["x" * 800, "y" * 800]}, "several prompts"),
        ({"prompt": [list(range(200)), list(range(200))]}, "several prompts"),
        ({"prompt": "x" * 800, "echo": True}, "echo"),
        ({"prompt": "x" * 800, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt": "x" * 800, "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ],
)
def test_requests_the_two_legs_cannot_carry_go_direct_whatever_their_size(
    body: dict[str, Any], why: str
) -> None:
    decided = plan(body, False, PD, 2)
    assert decided.path == "direct" and why in decided.reason


def test_without_a_routable_prefill_pod_long_prompts_go_direct_counted_apart() -> None:
    decided = plan({"prompt": "x" * 800}, False, PD, 0)
    assert decided.path == "no_prefill" and decided.reason == "no routable prefill pod"
    # short prompts and unfit requests say nothing about the prefill role: direct, as with pods
    assert plan({"prompt": "x" * 40}, False, PD, 0).path == "direct"
    assert plan({"prompt": "x" * 800, "echo": True}, False, PD, 0).path == "direct"


@pytest.mark.parametrize(
    ("body", "needs"),
    [
        ({"prompt": "x" * 800}, True),
        ({"prompt": list(range(100))}, True),
        ({"prompt": "x" * 396}, False),  # 99 tokens: under the threshold
        ({"prompt": "x" * 800, "echo": True}, False),
        ({"prompt": ["x" * 800, "y" * 800]}, False),
    ],
)
def test_a_held_request_needs_the_prefill_pool_until_its_prefill_leg_ran(
    body: dict[str, Any], needs: bool
) -> None:
    assert needs_prefill(body, False, PD) is needs
    assert held_path(body, False, PD, prefilled=False) == ("prefill" if needs else "direct")
    # a retry of the decode leg (the prefill leg answered): a decode pod alone
    assert held_path(body, False, PD, prefilled=True) == "direct"
    # the same as plan's choice with a prefill pod routable, and without one
    assert (plan(body, False, PD, 1).path == "disaggregated") is needs
    assert (plan(body, False, PD, 0).path == "no_prefill") is needs


def test_the_prefill_body_keeps_what_renders_the_prompt_and_drops_what_shapes_the_output() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {
        "model": "sql-lora",  # a LoRA adapter: served on both roles
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        "tools": tools,
        "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "cache_salt": "tenant-1",
        "temperature": 0.7,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 64,
        "min_tokens": 8,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_object"},
        "guided_json": {"type": "object"},
        "guided_regex": "a+",
        "stop": ["\n"],
        "stop_token_ids": [2],
        "ignore_eos": True,
    }
    out = prefill_body(body)
    assert out == {
        "model": "sql-lora",
        "messages": body["messages"],
        "tools": tools,
        "tool_choice": "none",  # "none" leaves the tools out of the prompt: it shapes the prompt
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "cache_salt": "tenant-1",
        "temperature": 0.7,
        "seed": 3,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["stream"] is True and "kv_transfer_params" not in body  # the client's body is untouched


def test_the_decode_body_is_the_clients_with_the_prefill_pods_params_and_its_url() -> None:
    params = {"do_remote_prefill": True, "transfer_id": "t1", "num_tokens": 300, "block_size": 16}
    got = transfer_params({"choices": [], "kv_transfer_params": params}, "http://10.0.0.1:8000")
    assert got == {**params, "remote_url": "http://10.0.0.1:8000"}
    own = {**params, "remote_url": "http://prefill-0.svc:8000"}  # a pod that names its own URL keeps it
    assert transfer_params({"kv_transfer_params": own}, "http://10.0.0.1:8000") == own
    for answer in ({"choices": []}, {"kv_transfer_params": {"do_remote_decode": True}}, [], "x", None):
        assert transfer_params(answer, "http://10.0.0.1:8000") is None
    body = chat("hi", stream=True, response_format={"type": "json_object"})
    assert decode_body(body, got) == {**body, "kv_transfer_params": got}


def test_pd_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="minimum prompt tokens"):
        PdSettings(min_prompt_tokens=-1)
    with pytest.raises(ValueError, match="transfer timeout"):
        PdSettings(transfer_timeout_s=0)


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoints", "m=http://a:1", "--pd-min-prompt-tokens", "10"], "--pd-min-prompt-tokens needs"),
        (["--endpoints", "m=http://a:1", "--pd-transfer-timeout", "3"], "--pd-transfer-timeout needs"),
        (["--prefill-endpoints", "m=http://b:1", "--namespace", "ns"], "--prefill-endpoints needs --endpoints"),
        (["--endpoints", "m=http://a:1", "--prefill-endpoints", "x=http://b:1"], "'x' is not a model"),
        (["--endpoints", "m=http://a:1", "--prefill-endpoints", "m=http://a:1"], "has one role"),
        (["--endpoints", "m=http://a:1", "--prefill-endpoints", "m=ftp://b"], "--prefill-endpoints 'm=ftp://b'"),
        (["--endpoints", "m=http://a:1", "--prefill-endpoints", "m=http://b:1", "--pd-min-prompt-tokens", "-1"],
         "--pd-min-prompt-tokens must be >= 0"),
        (["--endpoints", "m=http://a:1", "--prefill-endpoints", "m=http://b:1", "--pd-transfer-timeout", "0"],
         "--pd-transfer-timeout must be > 0"),
    ],
)  # fmt: skip
def test_static_pd_flags_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_router(args(*argv))


def test_prefill_endpoints_join_their_model_with_the_prefill_role() -> None:
    endpoints = parse_endpoints(["m=http://a:1,http://b:1", "n=http://c:1"], capacity=4)
    out = add_prefill_endpoints(endpoints, ["m=http://p:1/v1"], capacity=4)
    assert [(e.url, e.role) for e in out["m"]] == [
        ("http://a:1", None),
        ("http://b:1", None),
        ("http://p:1", "prefill"),
    ]
    assert out["n"] == endpoints["n"] and len(endpoints["m"]) == 2  # the input is not changed


def test_a_prefill_legs_budget_follows_the_pools_measured_speed() -> None:
    # no bound of its own before the pool has answered a leg
    assert prefill_budget_s(4096, None, 10.0) is None
    assert PrefillSpeed().budget_s(4096, 10.0) is None
    # a 4k-token prompt on a pool that ran 1k tokens in 5 s: the transfer timeout + 4 x 20 s
    speed = PrefillSpeed()
    speed.observe(1000, 5.0)
    assert speed.seconds_per_token == pytest.approx(0.005)
    assert speed.budget_s(4096, 10.0) == pytest.approx(10.0 + PREFILL_SLACK * 4096 * 0.005)
    assert speed.budget_s(100, 10.0) < speed.budget_s(4096, 10.0)
    # a slower leg moves the average part of the way; many converge on the new speed
    speed.observe(1000, 15.0)
    assert 0.005 < (speed.seconds_per_token or 0) < 0.015
    for _ in range(30):
        speed.observe(2000, 30.0)
    assert speed.seconds_per_token == pytest.approx(0.015, rel=1e-3)
    # an empty prompt says nothing; a negative time (a clock step) counts as none
    speed.observe(0, 1.0)
    assert speed.seconds_per_token == pytest.approx(0.015, rel=1e-3)
    speed.observe(100, -1.0)
    assert speed.seconds_per_token == pytest.approx(0.7 * 0.015, rel=1e-3)
