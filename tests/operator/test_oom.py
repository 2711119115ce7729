"""The OOM adaptation decision (pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kvpilot.operator import oom
from kvpilot.operator.models import InferenceModelSpec, OOMAdaptation, OOMOverrides, OOMPolicy
from kvpilot.operator.podstate import PodProblem

T1 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
T2 = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)


def spec(adapt: bool = True, **runtime: Any) -> InferenceModelSpec:
    return InferenceModelSpec.model_validate(
        {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "runtime": runtime,
            "oomPolicy": {"adapt": adapt},
        }
    )


def killed(at: datetime = T1, chash: str = "h1", pod: str = "p-1") -> PodProblem:
    return PodProblem(pod, "OOMKilled", f"pod {pod} was OOMKilled", chash, at)


@pytest.mark.parametrize(
    ("values", "policy", "expected"),
    [
        (
            {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_num_batched_tokens": 2048},
            OOMPolicy(),
            {
                "gpu_memory_utilization": (0.9, 0.85),
                "max_num_seqs": (64, 32),
                "max_num_batched_tokens": (2048, 1024),
            },
        ),
        (
            {"gpu_memory_utilization": 0.52, "max_num_seqs": 5, "max_num_batched_tokens": 300},
            OOMPolicy(),
            {
                "gpu_memory_utilization": (0.52, 0.5),
                "max_num_seqs": (5, 4),
                "max_num_batched_tokens": (300, 256),
            },
        ),
        ({"gpu_memory_utilization": 0.5, "max_num_seqs": 4, "max_num_batched_tokens": 256}, OOMPolicy(), {}),
        (
            {"gpu_memory_utilization": 0.4, "max_num_seqs": 2, "max_num_batched_tokens": 100},
            OOMPolicy(),
            {},  # already below the floors: never raised
        ),
        (
            {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_num_batched_tokens": 2048},
            OOMPolicy(min_gpu_memory_utilization=0.9, min_max_num_seqs=64, min_max_num_batched_tokens=1500),
            {"max_num_batched_tokens": (2048, 1500)},
        ),
    ],
)
def test_step_down(values: dict[str, Any], policy: OOMPolicy, expected: dict[str, Any]) -> None:
    assert oom.step_down(values, policy) == expected


def test_first_oom_adapts_from_runtime_defaults() -> None:
    d = oom.decide(spec(), None, [killed()], "h1")
    assert d.adapted == {
        "gpuMemoryUtilization": "0.9 -> 0.85",
        "maxNumSeqs": "64 -> 32",
        "maxNumBatchedTokens": "2048 -> 1024",
    }
    assert d.state is not None and d.state.count == 1 and d.state.last_time == T1
    assert d.overrides == OOMOverrides(
        gpu_memory_utilization=0.85, max_num_seqs=32, max_num_batched_tokens=1024
    )
    assert d.state.runtime_hash == oom.runtime_hash(spec())


def test_same_oom_is_not_handled_twice() -> None:
    first = oom.decide(spec(), None, [killed()], "h1")
    again = oom.decide(spec(), first.state, [killed()], "h1")
    assert again.adapted == {} and again.state == first.state and not again.exhausted


def test_oom_of_pods_with_an_older_config_is_ignored() -> None:
    first = oom.decide(spec(), None, [killed()], "h1")
    d = oom.decide(spec(), first.state, [killed(T2, chash="h1")], "h2")
    assert d.adapted == {} and d.state == first.state


def test_next_oom_of_the_new_config_adapts_further() -> None:
    first = oom.decide(spec(), None, [killed()], "h1")
    second = oom.decide(spec(), first.state, [killed(T2, chash="h2")], "h2")
    assert second.state is not None and second.state.count == 2
    assert second.overrides == OOMOverrides(
        gpu_memory_utilization=0.8, max_num_seqs=16, max_num_batched_tokens=512
    )


def test_spec_values_are_the_starting_point() -> None:
    d = oom.decide(
        spec(gpuMemoryUtilization=0.7, maxNumSeqs=10, maxNumBatchedTokens=4096), None, [killed()], "h1"
    )
    assert d.adapted == {
        "gpuMemoryUtilization": "0.7 -> 0.65",
        "maxNumSeqs": "10 -> 5",
        "maxNumBatchedTokens": "4096 -> 2048",
    }


def test_without_adapt_nothing_changes() -> None:
    d = oom.decide(spec(adapt=False), None, [killed()], "h1")
    assert d.state is None and d.adapted == {} and not d.exhausted


def test_exhausted_at_the_minimums() -> None:
    s = spec(gpuMemoryUtilization=0.5, maxNumSeqs=4, maxNumBatchedTokens=256)
    d = oom.decide(s, None, [killed()], "h1")
    assert d.exhausted and d.adapted == {}
    assert d.state is not None and d.state.last_time == T1 and d.state.count == 0
    assert "minimums already reached" in oom.describe(d)
    assert oom.decide(s, d.state, [killed()], "h1").exhausted is False  # told once


def test_editing_the_runtime_spec_resets_overrides() -> None:
    first = oom.decide(spec(), None, [killed()], "h1")
    assert oom.current_overrides(spec(), first.state) is not None
    edited = spec(maxNumSeqs=48)
    assert oom.current_overrides(edited, first.state) is None
    d = oom.decide(edited, first.state, [], "h3")
    assert d.state is not None and d.state.overrides is None and d.state.count == 1


def test_describe_lists_the_changes() -> None:
    d = oom.decide(spec(), None, [killed(pod="llama-7f-x")], "h1")
    text = oom.describe(d)
    assert "llama-7f-x" in text and "gpuMemoryUtilization 0.9 -> 0.85" in text


def test_state_round_trips_through_status_json() -> None:
    d = oom.decide(spec(), None, [killed()], "h1")
    assert d.state is not None
    assert OOMAdaptation.model_validate(d.state.dump()) == d.state
    assert d.state.dump()["lastTime"] == "2026-01-01T12:00:00Z"
