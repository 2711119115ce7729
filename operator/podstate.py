"""Read what is wrong with a model's pods from their status (pure functions over pod dicts)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kvpilot.kube.times import parse_time
from kvpilot.operator.builders import CONFIG_HASH_ANNOTATION

# A container's lastState keeps an old OOM kill for as long as the pod lives; only a recent one
# counts as "the model is degraded now".
OOM_RECENT = timedelta(minutes=10)
GPU_OOM_MARKERS = ("out of memory", "outofmemoryerror", "cuda error: out of memory")
PULL_REASONS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName"}
CONFIG_REASONS = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class PodProblem:
    """One thing wrong with one pod."""

    pod: str
    reason: str  # OOMKilled, CrashLoopBackOff, ImagePullBackOff, CreateContainerConfigError, Unschedulable
    message: str
    config_hash: str | None = None
    finished_at: datetime | None = None  # for OOM kills: when the container died
    oom_kind: str | None = None  # for OOM kills: "memory" (the container's limit) or "gpu" (CUDA OOM)

    @property
    def is_oom(self) -> bool:
        return self.reason == "OOMKilled"


def _oom_kind(terminated: dict[str, Any] | None) -> str | None:
    """'memory' for a kernel OOM kill, 'gpu' for a runtime that exited on a CUDA OOM, else None."""
    if not terminated:
        return None
    if terminated.get("reason") == "OOMKilled":
        return "memory"
    message = (terminated.get("message") or "").lower()
    if terminated.get("exitCode", 0) != 0 and any(marker in message for marker in GPU_OOM_MARKERS):
        return "gpu"
    return None


def _oom_message(pod: str, container: str, kind: str, terminated: dict[str, Any]) -> str:
    what = "was OOMKilled (host memory limit)" if kind == "memory" else "exited on GPU out-of-memory"
    when = terminated.get("finishedAt")
    return f"pod {pod} container {container} {what}" + (f" at {when}" if when else "")


def pod_problems(pod: dict[str, Any], now: datetime) -> list[PodProblem]:
    """Problems of one pod, most specific first."""
    md = pod.get("metadata", {})
    name = md.get("name", "?")
    chash = (md.get("annotations") or {}).get(CONFIG_HASH_ANNOTATION)
    status = pod.get("status", {})
    problems: list[PodProblem] = []

    for cond in status.get("conditions") or []:
        scheduled = cond.get("type") == "PodScheduled"
        if scheduled and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            problems.append(PodProblem(name, "Unschedulable", cond.get("message", ""), chash))

    for cs in status.get("containerStatuses") or []:
        cname = cs.get("name", "?")
        state = cs.get("state") or {}
        last = (cs.get("lastState") or {}).get("terminated")
        waiting = state.get("waiting") or {}
        terminated = state.get("terminated")
        oom_now = _oom_kind(terminated)
        oom_last = _oom_kind(last)
        if oom_now and terminated:
            problems.append(
                PodProblem(
                    name,
                    "OOMKilled",
                    _oom_message(name, cname, oom_now, terminated),
                    chash,
                    parse_time(terminated.get("finishedAt")) or now,
                    oom_now,
                )
            )
        elif oom_last and last:
            finished = parse_time(last.get("finishedAt")) or now
            crashlooping = waiting.get("reason") == "CrashLoopBackOff"
            if crashlooping or now - finished <= OOM_RECENT:
                problems.append(
                    PodProblem(
                        name,
                        "OOMKilled",
                        _oom_message(name, cname, oom_last, last),
                        chash,
                        finished,
                        oom_last,
                    )
                )
        reason = waiting.get("reason")
        if reason == "CrashLoopBackOff" and not (oom_now or oom_last):
            detail = (last or {}).get("message") or (last or {}).get("reason") or waiting.get("message", "")
            problems.append(
                PodProblem(
                    name,
                    "CrashLoopBackOff",
                    f"pod {name} container {cname} is crash-looping: {detail}".strip(),
                    chash,
                )
            )
        elif reason in PULL_REASONS:
            problems.append(
                PodProblem(
                    name,
                    "ImagePullBackOff",
                    f"pod {name}: {reason}: {waiting.get('message', '')}".strip(),
                    chash,
                )
            )
        elif reason in CONFIG_REASONS:
            problems.append(
                PodProblem(name, reason, f"pod {name}: {reason}: {waiting.get('message', '')}".strip(), chash)
            )
    problems += _init_problems(name, chash, status)
    return problems


def _init_problems(name: str, chash: str | None, status: dict[str, Any]) -> list[PodProblem]:
    """An init container (the hf:// fetch) that failed: the pod never starts its runtime, so the model
    would wait for a replica forever. Reported as CrashLoopBackOff (the kubelet retries it) with the
    container's own message (FallbackToLogsOnError: the fetch's last lines, e.g. a repository of
    several .gguf models and how to name one)."""
    out: list[PodProblem] = []
    for cs in status.get("initContainerStatuses") or []:
        state = cs.get("state") or {}
        failed = state.get("terminated")  # its first failure, before the kubelet backs off
        if (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff":
            failed = (cs.get("lastState") or {}).get("terminated")
        if not failed or failed.get("exitCode", 0) == 0:
            continue
        detail = (failed.get("message") or "").strip() or f"exit code {failed.get('exitCode')}"
        message = f"pod {name} init container {cs.get('name', '?')} failed: {detail}"
        out.append(PodProblem(name, "CrashLoopBackOff", message, chash))
    return out


def all_problems(pods: list[dict[str, Any]], now: datetime) -> list[PodProblem]:
    live = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
    return [
        problem
        for pod in sorted(live, key=lambda p: p["metadata"].get("name", ""))
        for problem in pod_problems(pod, now)
    ]


def fetching(pods: list[dict[str, Any]]) -> list[str]:
    """ "POD (INIT CONTAINER)" for each live pod whose init container is running: the hf:// download
    of the weights, which can take minutes for a large model; the model is not ready meanwhile and its
    status says why."""
    out = []
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        md = pod.get("metadata", {})
        if md.get("deletionTimestamp"):
            continue
        for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if (cs.get("state") or {}).get("running") is not None:
                out.append(f"{md.get('name', '?')} ({cs.get('name', '?')})")
    return out
