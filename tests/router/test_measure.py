"""The router's pure parts of measuring and migrating streams, and the fair queue's order."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from kvpilot.api.slo import SloTargets
from kvpilot.router.fairqueue import FairQueue
from kvpilot.router.measure import SloMeter, estimate_tokens, quantile
from kvpilot.router.migrate import continuation, migratable, rewrite_event
from kvpilot.router.sse import StreamTally, encode_event, split_events


def chunk(text: str, finish: str | None = None, chat: bool = False, **extra: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    choice.update({"delta": {"content": text}} if chat else {"text": text})
    return encode_event({"id": "x1", "created": 7, "choices": [choice], **extra})


def test_split_events_keeps_a_half_event_for_later() -> None:
    a, b = chunk("a"), chunk("b")
    events, rest = split_events(a + b[:10])
    assert events == [a] and rest == b[:10]
    events, rest = split_events(rest + b[10:])
    assert events == [b] and rest == b""


def test_tally_counts_content_and_prefers_the_pods_usage() -> None:
    t = StreamTally()
    t.see(
        encode_event({"id": "c", "created": 1, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        1.0,
    )
    assert t.first_content_s is None  # the chat opening chunk is not a token
    t.see(chunk("Hel", chat=True), 2.0)
    t.see(chunk("lo", "stop", chat=True), 3.5)
    assert (t.first_content_s, t.last_content_s, t.output_tokens) == (2.0, 3.5, 2)
    assert t.delivered_text == "Hello" and t.finish_reason == "stop" and t.stream_id == "c"
    t.see(encode_event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}), 3.6)
    t.see(b"data: [DONE]\n\n", 3.6)
    assert t.output_tokens == 3 and t.prompt_tokens == 9 and t.done and not t.error


@pytest.mark.parametrize(
    ("body", "chat", "why"),
    [
        ({"stream": True, "prompt": "p"}, False, None),
        ({"stream": True, "prompt": ["p"]}, False, None),
        ({"stream": True, "prompt": [1, 2]}, False, "a prompt that is not one text"),
        ({"stream": True, "prompt": "p", "n": 2}, False, "n > 1"),
        ({"stream": True, "prompt": "p", "echo": True}, False, "echo"),
        ({"stream": True, "prompt": "p", "guided_regex": "a"}, False, "guided output (guided_regex)"),
        ({"stream": True, "messages": [{"role": "user", "content": "q"}]}, True, None),
        (
            {
                "stream": True,
                "messages": [{"role": "user", "content": "q"}],
                "response_format": {"type": "json_object"},
            },
            True,
            "structured output (response_format)",
        ),
        ({"stream": True, "messages": [{"role": "user", "content": "q"}], "tools": [{}]}, True, "tools"),
        ({"prompt": "p"}, False, "not a stream"),
    ],
)
def test_which_streams_can_move(body: dict[str, Any], chat: bool, why: str | None) -> None:
    assert migratable(body, chat) == why


def test_the_continuation_asks_for_the_rest() -> None:
    body = {"prompt": ["Once"], "max_tokens": 10, "min_tokens": 2, "stream": True}
    assert continuation(body, False, " upon", 3) == {
        **body,
        "prompt": "Once upon",
        "max_tokens": 7,
        "min_tokens": 0,
    }
    assert continuation(body, False, " upon a time", 10) is None  # nothing left to generate
    assert continuation(body, False, "", 0) is body  # nothing went out: the request as it was
    chat = {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 5}
    out = continuation(chat, True, "An", 1)
    assert out is not None and out["messages"][-1] == {"role": "assistant", "content": "An"}
    assert (out["continue_final_message"], out["add_generation_prompt"], out["max_completion_tokens"]) == (
        True,
        False,
        4,
    )
    assert chat["messages"] == [{"role": "user", "content": "q"}]  # the client's body is untouched
    open_turn = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "A"}]}
    open_turn["continue_final_message"], open_turn["add_generation_prompt"] = True, False
    out = continuation(open_turn, True, "n", 1)
    assert out is not None and out["messages"][-1]["content"] == "An" and len(out["messages"]) == 2


def test_a_continuations_events_join_the_clients_stream() -> None:
    opening = {
        "id": "y",
        "created": 9,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    }
    assert rewrite_event(opening, "x1", 7, 3, keep_usage=True) is None
    data = json.loads(chunk("more", chat=True)[6:])
    data["id"] = "y"
    assert rewrite_event(data, "x1", 7, 3, True) == {**data, "id": "x1", "created": 7}
    usage = {"id": "y", "choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 4}}
    assert rewrite_event(usage, "x1", 7, 3, True)["usage"] == {"prompt_tokens": 10, "completion_tokens": 7}  # type: ignore[index]
    assert rewrite_event(usage, "x1", 7, 3, False) is None  # usage the client did not ask for
    error = {"error": {"message": "m"}}
    assert rewrite_event(error, "x1", 7, 3, True) == error


def test_the_meter_judges_and_windows_and_averages() -> None:
    meter = SloMeter(SloTargets(ttft_s=1.0, tpot_s=0.1), window_s=60, alpha=0.5)
    assert meter.record("m", 0.0, 0.5, 0.05, 10) == "met"
    assert meter.record("m", 1.0, 2.0, 0.05, 10) == "missed_ttft"
    assert meter.record("m", 2.0, 0.5, 0.2, 10) == "missed_tpot"
    assert meter.record("m", 3.0, None, None, 10) == "failed"
    # a whole answer: 3 s for 21 tokens is within 1 s + 20 x 0.1 s; 3.5 s is not
    assert meter.record_whole("m", 4.0, 3.0, 21, 10) == "met"
    assert meter.record_whole("m", 5.0, 3.5, 21, 10) == "missed_ttft"
    w = meter.window("m", 5.0)
    assert w.requests == 6 and w.attainment == pytest.approx(2 / 6)
    assert w.outcomes == {"met": 2, "missed_ttft": 2, "missed_tpot": 1, "failed": 1}
    assert w.tpot_s[0.5] == 0.05 and w.tpot_s[0.99] == 0.2
    later = meter.window("m", 61.5)  # the first two fell out of the window
    assert later.requests == 4
    assert math.isnan(meter.window("other", 0).attainment)
    meter.set_targets("m", SloTargets(ttft_s=3.0, tpot_s=0.1))
    assert meter.record("m", 62.0, 2.0, None, 10) == "met"
    meter.observe_pod("m", "p", 1.0, 0.1)
    meter.observe_pod("m", "p", 3.0, 0.3)
    meter.pod_error("m", "p")
    lat = meter.pod_latency("m", "p")
    assert lat is not None and (lat.ttft_s, lat.tpot_s, lat.error_rate) == (2.0, pytest.approx(0.2), 0.5)


def test_quantile_and_prompt_estimate() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and quantile([1.0, 2.0], 0.99) == 2.0
    assert estimate_tokens(0) == 0 and estimate_tokens(9) == 3


def test_fair_queue_serves_bands_in_order_and_tenants_in_turn() -> None:
    q: FairQueue[str] = FairQueue(3)
    for item, band, tenant in [("a1", 1, "a"), ("a2", 1, "a"), ("a3", 1, "a"), ("b1", 1, "b"), ("h", 0, "a")]:
        q.push(item, band, tenant)
    q.push("low", 2, "c")
    assert q.tenant_len("a") == 4 and q.band_len(1) == 4 and len(q) == 6
    assert q.remove("a3", 1, "a") and not q.remove("a3", 1, "a")
    assert [q.pop() for _ in range(len(q))] == ["h", "a1", "b1", "a2", "low"]
    assert q.peek() is None and q.head_band() is None and q.tenant_len("a") == 0
