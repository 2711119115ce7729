"""Out-of-memory adaptation (spec.oomPolicy): a pure decision from what the pods report.

When a replica running the *current* config was OOM-killed (or exited on a CUDA OOM) after the last
adaptation, and spec.oomPolicy.adapt is true, step the memory-hungry settings down:
gpuMemoryUtilization by 0.05, maxNumSeqs and maxNumBatchedTokens halved, never below the policy's
minimums. The result lives in status.oomAdaptation.overrides and caps spec.runtime when the config
is rendered, so the reconcile stays level-triggered: the same status always renders the same config.
Editing spec.runtime or spec.oomPolicy resets the overrides (their hash no longer matches).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.operator.builders import effective_runtime, stable_hash
from kvpilot.operator.models import InferenceModelSpec, OOMAdaptation, OOMOverrides, OOMPolicy
from kvpilot.operator.podstate import PodProblem, format_time
from kvpilot.runtime.config import EngineConfig

GPU_MEMORY_STEP = 0.05
ADAPTED_FIELDS = ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens")
CAMEL = {
    "gpu_memory_utilization": "gpuMemoryUtilization",
    "max_num_seqs": "maxNumSeqs",
    "max_num_batched_tokens": "maxNumBatchedTokens",
}


def runtime_hash(spec: InferenceModelSpec) -> str:
    return stable_hash({"runtime": spec.runtime.dump(), "oomPolicy": spec.oom_policy.dump()})


def current_overrides(spec: InferenceModelSpec, state: OOMAdaptation | None) -> OOMOverrides | None:
    """The overrides in force: only those made for the current spec.runtime / spec.oomPolicy."""
    if state is None or state.overrides is None or state.runtime_hash != runtime_hash(spec):
        return None
    return state.overrides


def step_down(
    values: dict[str, float | int], policy: OOMPolicy
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
    values = effective_values(effective_runtime(spec.runtime, overrides))
    steps = step_down(values, spec.oom_policy)
    count = state.count if state else 0
    if not steps:
        kept = state or OOMAdaptation.model_validate({})
        return OOMDecision(kept.model_copy(update={"last_time": latest}), exhausted=True, ooms=new_ooms)

    new_overrides = (overrides or OOMOverrides()).model_copy(
        update={k: new for k, (_old, new) in steps.items()}
    )
    changes = {CAMEL[k]: f"{old} -> {new}" for k, (old, new) in steps.items()}
    new_state = OOMAdaptation(
        count=count + 1,
        last_time=latest,
        changes=changes,
        overrides=new_overrides,
        runtime_hash=rhash,
    )
    return OOMDecision(new_state, adapted=changes, ooms=new_ooms)


def describe(decision: OOMDecision) -> str:
    pods = ", ".join(sorted({p.pod for p in decision.ooms}))
    if decision.exhausted:
        return (
            f"out-of-memory in {pods}; spec.oomPolicy minimums already reached, nothing left to lower: "
            "give the model more memory (spec.resources) or a smaller maxModelLen"
        )
    steps = ", ".join(f"{k} {v}" for k, v in decision.adapted.items())
    when = format_time(decision.state.last_time) if decision.state and decision.state.last_time else "?"
    return f"out-of-memory in {pods} at {when}; adapted runtime config: {steps}"
