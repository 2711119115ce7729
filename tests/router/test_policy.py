"""The routing decisions, as pure functions: bounded load, affinity, capacity, the kv-aware estimate."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.router.keys import prompt_text, request_key, text_blocks, token_blocks
from kvpilot.router.policy import (
    POLICIES,
    AdapterAffinity,
    KvAware,
    PodView,
    PrefixAffinity,
    RouteKey,
    choose_adapter_holder,
    load_bound,
    make_policy,
    route,
)


def pods_of(loads: list[int], capacity: int = 8) -> list[PodView]:
    return [PodView(name=f"pod-{i}", in_flight=n, capacity=capacity) for i, n in enumerate(loads)]


def key_of(text: str, session: str | None = None) -> RouteKey:
    return RouteKey(blocks=text_blocks(text, 8), session=session)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_holds_when_no_pod_has_room(name: str) -> None:
    policy = make_policy(name)
    assert policy.choose(key_of("x" * 64), pods_of([4, 4, 4], capacity=4)) is None
    assert policy.choose(key_of("x" * 64), []) is None


@pytest.mark.parametrize("name", POLICIES)
@given(loads=st.lists(st.integers(0, 8), min_size=1, max_size=6), text=st.text(max_size=80))
@settings(max_examples=60, deadline=None)
def test_every_policy_picks_a_pod_with_room(name: str, loads: list[int], text: str) -> None:
    pods = pods_of(loads, capacity=8)
    i = make_policy(name).choose(key_of(text), pods)
    if all(n >= 8 for n in loads):
        assert i is None
    else:
        assert i is not None and pods[i].has_room


def test_round_robin_cycles_and_skips_full_pods() -> None:
    policy = make_policy("round-robin")
    assert [policy.choose(RouteKey(), pods_of([0, 0, 0])) for _ in range(4)] == [0, 1, 2, 0]
    pods = pods_of([0, 8, 0])
    assert [policy.choose(RouteKey(), pods) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_uses_in_flight_waiting_and_kv_use() -> None:
    policy = make_policy("least-loaded")
    assert policy.choose(RouteKey(), pods_of([3, 1, 2])) == 1
    # scraped waiting counts add to the router's own in-flight counts
    pods = [PodView("a", 1, 8, waiting=5), PodView("b", 2, 8, waiting=0)]
    assert policy.choose(RouteKey(), pods) == 1
    # equal load: lower KV use wins
    pods = [PodView("a", 1, 8, kv_usage=0.9), PodView("b", 1, 8, kv_usage=0.2)]
    assert policy.choose(RouteKey(), pods) == 1
    # load is per slot: 4 of 16 is less than 3 of 8
    assert policy.choose(RouteKey(), [PodView("a", 3, 8), PodView("b", 4, 16)]) == 1


@given(
    loads=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    eps=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
    text=st.text(min_size=8, max_size=64),
    session=st.one_of(st.none(), st.text(max_size=10)),
)
@settings(max_examples=200, deadline=None)
def test_prefix_affinity_never_exceeds_the_load_bound(
    loads: list[int], eps: float, text: str, session: str | None
) -> None:
    pods = pods_of(loads, capacity=1000)
    i = PrefixAffinity(eps=eps).choose(key_of(text, session), pods)
    assert i is not None
    assert pods[i].load + 1 <= load_bound(pods, eps)


def test_prefix_affinity_bound_is_ceil_of_one_plus_eps_times_average() -> None:
    pods = pods_of([3, 3, 3])
    assert load_bound(pods, 0.25) == math.ceil(1.25 * 10 / 3)


def test_prefix_affinity_sticks_and_spreads_different_prefixes() -> None:
    policy = PrefixAffinity()
    pods = pods_of([0, 0, 0, 0])
    keys = [key_of(f"system prompt number {k} " * 4) for k in range(40)]
    first = [policy.choose(k, pods) for k in keys]
    # same key, same pod, every time the load allows
    assert [policy.choose(k, pods) for k in keys] == first
    # different prefixes land on different pods (64 virtual nodes per pod)
    counts = collections.Counter(first)
    assert len(counts) == 4 and max(counts.values()) < 20


def test_prefix_affinity_hashes_leading_blocks_only() -> None:
    policy = PrefixAffinity(affinity_blocks=2)
    pods = pods_of([0, 0, 0, 0, 0])
    base = "S" * 16  # two blocks of 8 characters
    chosen = {policy.choose(key_of(base + f"user question {k}"), pods) for k in range(20)}
    assert len(chosen) == 1


def test_prefix_affinity_session_overrides_prompt() -> None:
    policy = PrefixAffinity()
    pods = pods_of([0] * 6)
    by_session = {policy.choose(key_of(f"turn {t} " * 5, session="conv-7"), pods) for t in range(10)}
    assert len(by_session) == 1


def test_prefix_affinity_passes_on_when_the_home_pod_is_over_the_bound() -> None:
    policy = PrefixAffinity(eps=0.25)
    pods = pods_of([0, 0, 0])
    key = key_of("a shared system prompt, long enough")
    home = policy.choose(key, pods)
    assert home is not None
    loads = [0, 0, 0]
    loads[home] = 5  # bound = ceil(1.25 * 6 / 3) = 3
    second = policy.choose(key, pods_of(loads))
    assert second is not None and second != home
    # the ring order decides where it goes next, and that is stable too
    assert policy.choose(key, pods_of(loads)) == second
    assert policy.ring_order(key, pods)[0] == home


def test_prefix_affinity_moves_few_keys_when_a_pod_joins() -> None:
    policy = PrefixAffinity()
    keys = [key_of(f"prompt {k} " * 3) for k in range(300)]
    three = [policy.choose(k, pods_of([0, 0, 0])) for k in keys]
    four = [policy.choose(k, pods_of([0, 0, 0, 0])) for k in keys]
    moved = [(a, b) for a, b in zip(three, four, strict=True) if a != b]
    # consistent hashing: only keys that now belong to the new pod move, about a quarter
    assert all(b == 3 for _, b in moved)
    assert 0 < len(moved) < 150


def test_kv_aware_follows_what_it_sent_where() -> None:
    policy = KvAware()
    pods = pods_of([0, 0, 0])
    turn1 = key_of("system prompt. " * 8 + "user: hi")
    i = policy.choose(turn1, pods)
    assert i is not None
    policy.dispatched(pods[i].name, turn1)
    # the next turn extends the same conversation: its prefix is cached on pod i only
    turn2 = key_of("system prompt. " * 8 + "user: hi assistant: hello user: more")
    assert policy.cached_blocks(pods[i].name, turn2) == len(turn1.blocks)
    assert policy.choose(turn2, pods) == i


def test_kv_aware_trades_cache_hits_against_load() -> None:
    policy = KvAware(prefill_weight=1.0)
    key = key_of("z" * 80)  # 10 blocks
    policy.dispatched("pod-0", key)
    busy = [PodView("pod-0", 3, 8, active_blocks=30), PodView("pod-1", 0, 8)]
    # 30 blocks in use on pod-0 cost more than prefilling 10 blocks on the idle pod-1
    assert policy.choose(key, busy) == 1
    light = [PodView("pod-0", 1, 8, active_blocks=5), PodView("pod-1", 0, 8)]
    assert policy.choose(key, light) == 0
    # a tie (10 blocks in use against 10 blocks to prefill) keeps the warm pod
    tie = [PodView("pod-0", 1, 8, active_blocks=10), PodView("pod-1", 0, 8)]
    assert policy.choose(key, tie) == 0


def test_kv_aware_forgets_evicted_and_deleted_pods() -> None:
    policy = KvAware(max_blocks_per_pod=4)
    key = key_of("q" * 80)
    policy.dispatched("pod-0", key)
    assert policy.cached_blocks("pod-0", key) == 0  # its leading blocks were evicted first (LRU)
    small = key_of("q" * 24)
    policy.dispatched("pod-0", small)
    assert policy.cached_blocks("pod-0", small) == 3
    policy.forget("pod-0")
    assert policy.cached_blocks("pod-0", small) == 0


def test_make_policy_refuses_unknown_names_and_options() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="takes no option bogus"):
        make_policy("kv-aware", bogus=1.0)
    assert isinstance(make_policy("prefix-affinity", eps=0.5), PrefixAffinity)


def test_blocks_are_chained_prefix_hashes() -> None:
    a = text_blocks("abcdefgh" * 3 + "tail", 8)
    b = text_blocks("abcdefgh" * 2 + "XXXXXXXX", 8)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert text_blocks("short", 8) == ()
    assert token_blocks(list(range(40)), 16)[:1] == token_blocks(list(range(16)), 16)


def test_request_keys_from_bodies() -> None:
    chat = {"messages": [{"role": "system", "content": "S" * 100}, {"role": "user", "content": "hi"}]}
    longer = {"messages": [*chat["messages"], {"role": "assistant", "content": "hello" * 20}]}
    k1, k2 = request_key(chat, chat=True), request_key(longer, chat=True)
    assert k2.blocks[: len(k1.blocks)] == k1.blocks and len(k2.blocks) > len(k1.blocks)
    assert prompt_text({"prompt": ["first", "second"]}, chat=False) == "first"
    assert prompt_text({"prompt": [1, 2, 3]}, chat=False) == "1,2,3"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}
    assert "abc" in prompt_text(parts, chat=True)
    assert request_key({"prompt": "x", "max_tokens": 160}, chat=False).size_blocks == 10
    assert request_key({"prompt": "x"}, chat=False, session="s1").session == "s1"


def test_route_chooses_and_records_for_the_simulator() -> None:
    policy = KvAware()
    pods = pods_of([0, 0, 0])
    key = key_of("a prompt the simulator sends " * 3)
    i = route(policy, key, pods)
    assert i is not None and policy.cached_blocks(pods[i].name, key) == len(key.blocks)
    assert route(policy, key, pods_of([8, 8, 8])) is None


def test_adapter_holder_is_preferred_until_beyond_the_bound() -> None:
    # pod-1 holds the adapter: it wins while its load after the request stays within the bound
    pods = pods_of([0, 2, 0])
    assert load_bound(pods, 0.25) == 2
    assert choose_adapter_holder([False, True, False], pods, 0.25) is None  # 2 + 1 > 2: beyond
    pods = pods_of([1, 1, 1])
    assert load_bound(pods, 0.25) == 2 and choose_adapter_holder([False, True, False], pods, 0.25) == 1
    # among holders the least loaded per slot; a holder without room never
    assert choose_adapter_holder([True, True, False], pods_of([2, 1, 3]), 0.5) == 1
    assert choose_adapter_holder([True, False], pods_of([4, 0], capacity=4), 10.0) is None


def test_adapter_affinity_sticks_then_spreads_under_load_and_forgets_pods() -> None:
    policy = AdapterAffinity(make_policy("round-robin"), eps=0.25, slots=2)
    sql = RouteKey(adapter="sql")
    loads = [0, 0, 0]
    first = route(policy, sql, pods_of(loads))
    assert first == 0 and policy.holds("pod-0", "sql")
    # while its load stays within the bound, every sql request goes to the holder
    for loads in ([1, 1, 1], [2, 1, 1]):  # 2 <= ceil(1.25 x 4 / 3) = 2, 3 <= ceil(1.25 x 5 / 3) = 3
        assert route(policy, sql, pods_of(loads)) == 0
    # beyond it (3 + 1 > ceil(1.25 x 6 / 3) = 3) the base policy picks, and that pod holds it too
    spilled = route(policy, sql, pods_of([3, 1, 1]))
    assert spilled in (1, 2) and policy.holds(f"pod-{spilled}", "sql")
    # base-model requests ignore adapters: round-robin goes on
    assert route(policy, RouteKey(), pods_of([0, 0, 0])) is not None
    # a pod remembers its last `slots` adapters only
    for name in ("a", "b"):
        policy.dispatched("pod-0", RouteKey(adapter=name))
    assert not policy.holds("pod-0", "sql") and policy.holds("pod-0", "a") and policy.holds("pod-0", "b")
    policy.forget("pod-0")
    assert not policy.holds("pod-0", "a")
    with pytest.raises(ValueError, match="slots"):
        AdapterAffinity(make_policy("round-robin"), slots=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=8), min_size=1, max_size=6),
    st.lists(st.booleans(), min_size=6, max_size=6),
    st.floats(min_value=0.0, max_value=2.0),
)
def test_adapter_holder_choice_respects_room_and_the_bound(
    loads: list[int], held: list[bool], eps: float
) -> None:
    pods = pods_of(loads, capacity=8)
    holders = held[: len(pods)]
    i = choose_adapter_holder(holders, pods, eps)
    ok = [j for j, p in enumerate(pods) if holders[j] and p.has_room and p.load + 1 <= load_bound(pods, eps)]
    if i is None:
        assert not ok
    else:
        assert i in ok and pods[i].load == min(pods[j].load for j in ok)


def test_slowness_is_relative_to_the_measured_peers_and_counts_errors() -> None:
    from kvpilot.router.policy import slowness

    views = [
        PodView("fast", 0, 8, ttft_s=0.2, tpot_s=0.02),
        PodView("typical", 0, 8, ttft_s=0.2, tpot_s=0.04),
        PodView("slow", 0, 8, ttft_s=0.2, tpot_s=0.12),
        PodView("new", 0, 8),
        PodView("failing", 0, 8, ttft_s=0.2, tpot_s=0.04, error_rate=0.5),
    ]
    assert slowness(views) == pytest.approx([1.0, 1.0, 3.0, 1.0, 2.0])
    assert slowness(pods_of([0, 5])) == [1.0, 1.0]  # nothing measured: load alone decides


@pytest.mark.parametrize("name", ["least-loaded", "kv-aware"])
def test_a_pod_measured_slow_gets_less_until_the_fast_ones_are_loaded(name: str) -> None:
    policy = make_policy(name)
    key = RouteKey(blocks=(), size_blocks=1)

    def views(loads: list[int]) -> list[PodView]:
        tpot = [0.03, 0.03, 0.09]  # pod-2 answers three times as slowly
        return [PodView(f"pod-{i}", n, 8, active_blocks=n, tpot_s=tpot[i]) for i, n in enumerate(loads)]

    picks = collections.Counter(policy.choose(key, views([0, 0, 0])) for _ in range(4))
    assert picks[2] == 0  # idle fast pods first
    assert policy.choose(key, views([1, 1, 0])) in (0, 1)  # still: 2 x 1 < 1 x 3
    assert policy.choose(key, views([3, 3, 0])) == 2  # 4 x 1 > 1 x 3: the slow pod takes its share
