"""The OOM adaptation decision (pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from kvpilot.api.models import InferenceModelSpec, OOMAdaptation, OOMAdaptationPolicy, OOMOverrides
from kvpilot.operator import oom
from kvpilot.operator.podstate import PodProblem

T1 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
T2 = datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
T3 = datetime(2026, 1, 1, 12, 10, tzinfo=UTC)


def spec(
    adapt: bool = True,
    resources: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
    **runtime: Any,
) -> InferenceModelSpec:
    return InferenceModelSpec.model_validate(
        {
            "model": {"source": "builtin://smollm2-135m-instruct"},
            "runtime": runtime,
            "resources": resources or {},
            "oomPolicy": {"adapt": adapt, **(policy or {})},
        }
    )


def killed(at: datetime = T1, chash: str = "h1", pod: str = "p-1", kind: str = "gpu") -> PodProblem:
    """kind "gpu": the runtime exited on a CUDA OOM; "memory": the kernel's OOMKilled at the limit."""
    return PodProblem(pod, "OOMKilled", f"pod {pod} ran out of memory", chash, at, kind)


@pytest.mark.parametrize(
    ("values", "policy", "expected"),
    [
        (
            {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_num_batched_tokens": 2048},
            OOMAdaptationPolicy(),
            {
                "gpu_memory_utilization": (0.9, 0.85),
                "max_num_seqs": (64, 32),
                "max_num_batched_tokens": (2048, 1024),
            },
        ),
        (
            {"gpu_memory_utilization": 0.52, "max_num_seqs": 5, "max_num_batched_tokens": 300},
            OOMAdaptationPolicy(),
            {
                "gpu_memory_utilization": (0.52, 0.5),
                "max_num_seqs": (5, 4),
                "max_num_batched_tokens": (300, 256),
            },
        ),
        (
            {"gpu_memory_utilization": 0.5, "max_num_seqs": 4, "max_num_batched_tokens": 256},
            OOMAdaptationPolicy(),
            {},
        ),
        (
            {"gpu_memory_utilization": 0.4, "max_num_seqs": 2, "max_num_batched_tokens": 100},
            OOMAdaptationPolicy(),
            {},  # already below the floors: never raised
        ),
        (
            {"gpu_memory_utilization": 0.9, "max_num_seqs": 64, "max_num_batched_tokens": 2048},
            OOMAdaptationPolicy(
                min_gpu_memory_utilization=0.9, min_max_num_seqs=64, min_max_num_batched_tokens=1500
            ),
            {"max_num_batched_tokens": (2048, 1500)},
        ),
    ],
)
def test_step_down(values: dict[str, Any], policy: OOMAdaptationPolicy, expected: dict[str, Any]) -> None:
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
    assert "GPU out-of-memory, and gpuMemoryUtilization, maxNumSeqs and maxNumBatchedTokens are at" in (
        oom.describe(d)
    )
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


# -- the cause decides the knob ------------------------------------------------------------------

GPU_POD = {"gpus": 1, "memory": "16Gi"}
CPU_POD = {"gpus": 0, "memory": "4Gi"}


def test_memory_limit_kill_on_a_gpu_pod_raises_memory_not_gpu_settings() -> None:
    d = oom.decide(spec(resources=GPU_POD), None, [killed(kind="memory")], "h1")
    assert d.adapted == {"memory": "16Gi -> 24Gi"}
    assert d.overrides == OOMOverrides(memory="24Gi")
    # The next kill of the new pods raises again, up to the ceiling (twice spec.resources.memory).
    second = oom.decide(spec(resources=GPU_POD), d.state, [killed(T2, "h2", kind="memory")], "h2")
    assert second.adapted == {"memory": "24Gi -> 32Gi"}
    third = oom.decide(spec(resources=GPU_POD), second.state, [killed(T3, "h3", kind="memory")], "h3")
    assert third.exhausted and third.adapted == {}
    assert "memory is at its ceiling" in oom.describe(third) and "spec.oomPolicy.maxMemory" in third.why


def test_memory_ceiling_comes_from_the_policy() -> None:
    s = spec(resources=GPU_POD, policy={"maxMemory": "20Gi"})
    d = oom.decide(s, None, [killed(kind="memory")], "h1")
    assert d.adapted == {"memory": "16Gi -> 20Gi"}


def test_memory_limit_kill_without_a_memory_spec_says_to_set_one() -> None:
    d = oom.decide(spec(resources={"gpus": 1}), None, [killed(kind="memory")], "h1")
    assert d.exhausted and d.adapted == {}
    assert "set spec.resources.memory" in oom.describe(d)


def test_memory_limit_kill_on_a_cpu_pod_shrinks_what_lives_in_host_memory() -> None:
    d = oom.decide(spec(resources=CPU_POD), None, [killed(kind="memory")], "h1")
    assert d.adapted == {
        "kvCacheMemory": "1Gi -> 512Mi",  # the runtime's CPU default pool, halved
        "maxNumSeqs": "64 -> 32",
        "maxNumBatchedTokens": "2048 -> 1024",
    }
    assert d.overrides == OOMOverrides(
        kv_cache_memory=512 * 2**20, max_num_seqs=32, max_num_batched_tokens=1024
    )
    assert "gpuMemoryUtilization" not in d.adapted  # not read on a CPU pod


def test_cpu_pod_at_its_floors_raises_memory_instead() -> None:
    s = spec(
        resources=CPU_POD,
        policy={"minKvCacheMemory": "1Gi", "minMaxNumSeqs": 64, "minMaxNumBatchedTokens": 2048},
    )
    d = oom.decide(s, None, [killed(kind="memory")], "h1")
    assert d.adapted == {"memory": "4Gi -> 6Gi"}


def test_a_cuda_oom_message_on_a_cpu_pod_is_a_host_memory_problem() -> None:
    d = oom.decide(spec(resources=CPU_POD), None, [killed(kind="gpu")], "h1")
    assert "kvCacheMemory" in d.adapted and "gpuMemoryUtilization" not in d.adapted


def test_both_causes_at_once_adapt_both_sides() -> None:
    d = oom.decide(
        spec(resources=GPU_POD), None, [killed(kind="gpu"), killed(pod="p-2", kind="memory")], "h1"
    )
    assert d.adapted == {
        "gpuMemoryUtilization": "0.9 -> 0.85",
        "maxNumSeqs": "64 -> 32",
        "maxNumBatchedTokens": "2048 -> 1024",
        "memory": "16Gi -> 24Gi",
    }


def test_the_memory_override_renders_into_the_deployment_and_the_pod_hash() -> None:
    from kvpilot.api.models import InferenceModel
    from kvpilot.operator.builders import OperatorSettings, config_hash, render_children, render_config_yaml

    im = InferenceModel.model_validate(
        {"metadata": {"name": "m", "namespace": "ns"}, "spec": spec(resources=GPU_POD).dump()}
    )
    plain = {c["kind"]: c for c in render_children(im, OperatorSettings())}
    raised = {c["kind"]: c for c in render_children(im, OperatorSettings(), OOMOverrides(memory="24Gi"))}
    resources = raised["Deployment"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["memory"] == resources["requests"]["memory"] == "24Gi"
    template = raised["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert template["kvpilot.dev/config-hash"] == config_hash(
        render_config_yaml(im), OOMOverrides(memory="24Gi")
    )
    assert template != plain["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert raised["ConfigMap"] == plain["ConfigMap"]  # the runtime's config did not change
    # A spec that already asks for more than the override keeps its own value.
    bigger = InferenceModel.model_validate(
        {
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": spec(resources={"gpus": 1, "memory": "64Gi"}).dump(),
        }
    )
    kept = {c["kind"]: c for c in render_children(bigger, OperatorSettings(), OOMOverrides(memory="24Gi"))}
    assert (
        kept["Deployment"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
        == "64Gi"
    )


def test_the_kv_override_reaches_the_runtime_config() -> None:
    from kvpilot.api.models import InferenceModel
    from kvpilot.operator.builders import render_engine_config

    im = InferenceModel.model_validate(
        {"metadata": {"name": "m", "namespace": "ns"}, "spec": spec(resources=CPU_POD).dump()}
    )
    assert render_engine_config(im).kv_cache_memory is None
    assert render_engine_config(im, OOMOverrides(kv_cache_memory=512 * 2**20)).kv_cache_memory == 512 * 2**20
    # The same overrides after the model moved to a GPU: its pool comes from gpuMemoryUtilization.
    gpu = InferenceModel.model_validate(
        {"metadata": {"name": "m", "namespace": "ns"}, "spec": spec(resources=GPU_POD).dump()}
    )
    assert render_engine_config(gpu, OOMOverrides(kv_cache_memory=512 * 2**20)).kv_cache_memory is None


def test_the_new_policy_field_at_its_default_keeps_recorded_hashes() -> None:
    """Statuses written before minKvCacheMemory existed keep their overrides across the upgrade."""
    before = {
        "adapt": True,
        "minGpuMemoryUtilization": 0.5,
        "minMaxNumSeqs": 4,
        "minMaxNumBatchedTokens": 256,
    }
    assert oom.runtime_hash(spec()) == oom.stable_hash({"runtime": {}, "oomPolicy": before})
    assert oom.runtime_hash(spec(policy={"minKvCacheMemory": "256Mi"})) != oom.runtime_hash(spec())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16Gi", 16 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1.5Gi", 3 * 2**29),
        ("2G", 2 * 10**9),
        ("100", 100),
        ("1500m", 2),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    from kvpilot.operator.quantity import parse_bytes

    assert parse_bytes(text) == expected


def test_parse_bytes_refuses_what_is_not_a_quantity() -> None:
    from kvpilot.operator.quantity import parse_bytes

    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_bytes("16GB")
