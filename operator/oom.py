"""Out-of-memory adaptation (spec.oomPolicy): a pure decision from what the pods report.

When a replica running the *current* config ran out of memory after the last adaptation, and
spec.oomPolicy.adapt is true, adapt the setting that matches the cause:

- GPU out-of-memory (the runtime exited with a CUDA OOM in its termination message): the GPU is full,
  so gpuMemoryUtilization steps down by 0.05 and maxNumSeqs / maxNumBatchedTokens are halved.
- OOMKilled (the kernel killed the container at its cgroup memory limit): host memory is full, and
  gpuMemoryUtilization does not touch host memory (nor is it read on a CPU pod). On a CPU pod the KV
  pool and the batch live in host memory, so the KV pool (kvCacheMemory) and maxNumSeqs /
  maxNumBatchedTokens are halved. On a GPU pod, or once those are at their floors, the pod's memory
  request/limit is raised by half, up to spec.oomPolicy.maxMemory (default twice
  spec.resources.memory); without spec.resources.memory there is no limit of ours to raise.

Nothing goes below the policy's minimums or above its maximum. The result lives in
status.oomAdaptation.overrides and is applied when the children are rendered (runtime settings capped,
memory raised), so the reconcile stays level-triggered: the same status always renders the same
children. Editing spec.runtime or spec.oomPolicy resets the overrides (their hash no longer matches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpilot.api.models import InferenceModelSpec, OOMAdaptation, OOMAdaptationPolicy, OOMOverrides
from kvpilot.kube.times import format_time
from kvpilot.operator.builders import effective_memory, effective_runtime, stable_hash
from kvpilot.operator.podstate import PodProblem
from kvpilot.operator.quantity import MIB, format_mebibytes, parse_bytes
from kvpilot.runtime.config import EngineConfig

GPU_MEMORY_STEP = 0.05
MEMORY_GROWTH = 1.5  # OOMKilled on a GPU pod: memory request/limit times this, up to the ceiling
ADAPTED_FIELDS = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens")
CAMEL = {
    "gpu_memory_utilization": "gpuMemoryUtilization",
    "max_num_seqs": "maxNumSeqs",
    "max_num_batched_tokens": "maxNumBatchedTokens",
    "kv_cache_memory": "kvCacheMemory",
    "memory": "memory",
}
DEFAULT_MIN_KV_CACHE_MEMORY = "128Mi"
# The runtime's KV pool on a CPU when kv_cache_memory is unset (kvpilot.runtime.engine.runner, which
# imports torch; the operator does not). tests/operator/test_runtime_contract.py keeps them equal.
CPU_DEFAULT_KV_BYTES = 1 << 30


def runtime_hash(spec: InferenceModelSpec) -> str:
    policy = spec.oom_policy.dump()
    if policy.get("minKvCacheMemory") == DEFAULT_MIN_KV_CACHE_MEMORY:
        del policy["minKvCacheMemory"]  # added later: at its default it keeps existing hashes valid
    return stable_hash({"runtime": spec.runtime.dump(), "oomPolicy": policy})


def current_overrides(spec: InferenceModelSpec, state: OOMAdaptation | None) -> OOMOverrides | None:
    """The overrides in force: only those made for the current spec.runtime / spec.oomPolicy."""
    if state is None or state.overrides is None or state.runtime_hash != runtime_hash(spec):
        return None
    return state.overrides


def step_down(
    values: dict[str, float | int], policy: OOMAdaptationPolicy
) -> dict[str, tuple[float | int, float | int]]:
    """One adaptation step: field -> (old, new) for each field that can still go down."""
    out: dict[str, tuple[float | int, float | int]] = {}
    gmu = float(values["gpu_memory_utilization"])
    new_gmu = max(policy.min_gpu_memory_utilization, round(gmu - GPU_MEMORY_STEP, 2))
    if new_gmu < gmu:
        out["gpu_memory_utilization"] = (gmu, new_gmu)
    for key, floor in (
        ("max_num_seqs", policy.min_max_num_seqs),
        ("max_num_batched_tokens", policy.min_max_num_batched_tokens),
    ):
        old = int(values[key])
        new = max(floor, old // 2)
        if new < old:
            out[key] = (old, new)
    return out


def host_step_down(values: dict[str, float | int], policy: OOMAdaptationPolicy) -> dict[str, tuple[int, int]]:
    """One step for a CPU pod that hit its memory limit: halve the KV pool and the batch limits."""
    out: dict[str, tuple[int, int]] = {}
    for key, floor in (
        ("kv_cache_memory", parse_bytes(policy.min_kv_cache_memory)),
        ("max_num_seqs", policy.min_max_num_seqs),
        ("max_num_batched_tokens", policy.min_max_num_batched_tokens),
    ):
        old = int(values[key])
        new = max(floor, old // 2)
        if new < old:
            out[key] = (old, new)
    return out


def memory_ceiling(spec_memory: str | None, policy: OOMAdaptationPolicy) -> int | None:
    """The most memory an adaptation may give a pod (bytes), or None when it may not raise it."""
    if spec_memory is None:
        return None  # no limit of ours: the kill came from elsewhere (node pressure, a LimitRange)
    if policy.max_memory is not None:
        return parse_bytes(policy.max_memory)
    return 2 * parse_bytes(spec_memory)


def raise_memory(current: str | None, ceiling: int | None) -> tuple[str, str] | None:
    """(old, new) memory quantities for one raise by MEMORY_GROWTH, or None at the ceiling."""
    if current is None or ceiling is None:
        return None
    old = parse_bytes(current)
    new = min(ceiling, math.ceil(old * MEMORY_GROWTH / MIB) * MIB)
    if new <= old:
        return None
    return current, format_mebibytes(new)


def cpu_kv_cache_default(spec: InferenceModelSpec) -> int:
    """The KV pool a CPU runtime sizes itself when kv_cache_memory is unset (per rank)."""
    return CPU_DEFAULT_KV_BYTES // spec.effective_tensor_parallel_size()


def effective_values(spec_runtime: dict[str, object]) -> dict[str, float | int]:
    """The adapted fields as the runtime will see them (spec value, else the runtime's default)."""
    out: dict[str, float | int] = {}
    for key in ADAPTED_FIELDS:
        value = spec_runtime.get(key, EngineConfig.model_fields[key].default)
        assert isinstance(value, int | float)
        out[key] = value
    return out


@dataclass(frozen=True)
class OOMDecision:
    """What to record in status.oomAdaptation and tell people."""

    state: OOMAdaptation | None  # the status.oomAdaptation to write (None: there is none)
    adapted: dict[str, str] = field(default_factory=dict)  # camelCase field -> "old -> new" (this step)
    exhausted: bool = False  # an OOM happened but every field is at its minimum already
    ooms: tuple[PodProblem, ...] = ()  # the OOM kills this decision handled
    why: str = ""  # when exhausted: what a person can do

    @property
    def overrides(self) -> OOMOverrides | None:
        return self.state.overrides if self.state else None


def decide(
    spec: InferenceModelSpec,
    state: OOMAdaptation | None,
    problems: list[PodProblem],
    config_hash: str,
) -> OOMDecision:
    """Decide whether to adapt, from the pods' problems and the recorded state.

    Only OOM kills of pods running the current config (`config_hash`) that happened after the last
    recorded one count, so an OOM is acted on once, and old pods still rolling away don't count.
    Times are the kubelet's finishedAt, never the operator's clock.
    """
    rhash = runtime_hash(spec)
    if state is not None and state.runtime_hash != rhash and state.overrides is not None:
        # The user changed the settings: their values win again.
        state = state.model_copy(update={"overrides": None, "runtime_hash": rhash, "changes": None})
    last = state.last_time if state else None
    new_ooms = tuple(
        p
        for p in problems
        if p.is_oom
        and p.config_hash == config_hash
        and p.finished_at
        and (last is None or p.finished_at > last)
    )
    if not new_ooms or not spec.oom_policy.adapt:
        return OOMDecision(state)

    latest = max(p.finished_at for p in new_ooms if p.finished_at)
    overrides = current_overrides(spec, state)
    steps, why = plan_steps(spec, overrides, {cause(p, spec) for p in new_ooms})
    count = state.count if state else 0
    if not steps:
        kept = state or OOMAdaptation.model_validate({})
        return OOMDecision(
            kept.model_copy(update={"last_time": latest}), exhausted=True, ooms=new_ooms, why=why
        )

    update: dict[str, object] = {k: new for k, (_old, new) in steps.items()}
    new_overrides = (overrides or OOMOverrides.model_validate({})).model_copy(update=update)
    changes = {CAMEL[k]: f"{_show(k, old)} -> {_show(k, new)}" for k, (old, new) in steps.items()}
    new_state = OOMAdaptation(
        count=count + 1,
        last_time=latest,
        changes=changes,
        overrides=new_overrides,
        runtime_hash=rhash,
    )
    return OOMDecision(new_state, adapted=changes, ooms=new_ooms)


def cause(problem: PodProblem, spec: InferenceModelSpec) -> str:
    """'gpu' (CUDA OOM on a GPU pod) or 'memory' (the container's memory limit; every CPU pod OOM)."""
    if problem.oom_kind == "gpu" and spec.resources.gpus > 0:
        return "gpu"
    return "memory"


def plan_steps(
    spec: InferenceModelSpec, overrides: OOMOverrides | None, causes: set[str]
) -> tuple[dict[str, tuple[object, object]], str]:
    """The settings to change for these causes: field -> (old, new), and why nothing when empty."""
    policy = spec.oom_policy
    runtime = effective_runtime(spec.runtime, overrides)
    values = effective_values(runtime)
    steps: dict[str, tuple[object, object]] = {}
    why = []
    if "gpu" in causes:
        steps.update(step_down(values, policy))
        if not steps:
            why.append(
                "GPU out-of-memory, and gpuMemoryUtilization, maxNumSeqs and maxNumBatchedTokens are at "
                "their spec.oomPolicy minimums: use GPUs with more memory or a smaller maxModelLen"
            )
    if "memory" in causes:
        host: dict[str, tuple[int, int]] = {}
        if spec.resources.gpus == 0:
            kv = runtime.get("kv_cache_memory")
            host_values = {
                **values,
                "kv_cache_memory": int(kv) if kv is not None else cpu_kv_cache_default(spec),
            }
            host = host_step_down(host_values, policy)
        for key, change in host.items():
            steps.setdefault(key, change)
        if not host:
            raised = raise_memory(
                effective_memory(spec, overrides), memory_ceiling(spec.resources.memory, policy)
            )
            if raised is not None:
                steps["memory"] = raised
            elif spec.resources.memory is None:
                why.append(
                    "OOMKilled at a memory limit the operator did not set (no spec.resources.memory): "
                    "set spec.resources.memory so each replica gets the memory it needs"
                )
            else:
                why.append(
                    "OOMKilled at the container's memory limit, and memory is at its ceiling "
                    "(spec.oomPolicy.maxMemory, default twice spec.resources.memory): raise "
                    "spec.oomPolicy.maxMemory or spec.resources.memory"
                    + (", or lower the KV pool and batch limits" if spec.resources.gpus == 0 else "")
                )
    return steps, "; ".join(why)


def _show(key: str, value: object) -> str:
    if key == "kv_cache_memory" and isinstance(value, int):
        return format_mebibytes(value)
    return str(value)


def describe(decision: OOMDecision) -> str:
    pods = ", ".join(sorted({p.pod for p in decision.ooms}))
    if decision.exhausted:
        return f"out-of-memory in {pods}; nothing left to adapt: {decision.why}"
    steps = ", ".join(f"{k} {v}" for k, v in decision.adapted.items())
    when = format_time(decision.state.last_time) if decision.state and decision.state.last_time else "?"
    return f"out-of-memory in {pods} at {when}; adapted: {steps}"
