# syntax=docker/dockerfile:1.7
# kvpilot operator image: runs `kvpilot operator`, `kvpilot autoscaler run` and `kvpilot router` (the chart uses it for all three).
#
#   docker build -f deploy/docker/operator.Dockerfile -t ghcr.io/kvpilot/kvpilot-operator:0.1.0 .
#
# Multi-stage: a virtualenv is built in the first stage and copied into a clean slim image. Non-root
# (uid 10001), nothing writable but /tmp (HOME points there), so it runs with readOnlyRootFilesystem.
# The install command is the README's (`pip install .`, without the runtime extra: no torch, which the
# operator, router and autoscaler never import); PIP_CONSTRAINT pins the tested versions.
# Pin the base by digest in production: --build-arg PYTHON_IMAGE=python:3.12.12-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# Wheels from PyPI (no torch here); a mirror can be passed as build args.
ARG PIP_INDEX_URL=https://pypi.org/simple
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
COPY kvpilot/ kvpilot/
COPY api/ api/
COPY kube/ kube/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY autoscaler/ autoscaler/
COPY router/ router/
RUN pip install . \
    && python -m compileall -q /opt/kvpilot \
    && kvpilot --version

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kvpilot-operator" \
      org.opencontainers.image.description="kvpilot operator, autoscaler and router" \
      org.opencontainers.image.source="https://github.com/kvpilot/kvpilot" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}"
RUN groupadd --system --gid 10001 kvpilot \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvpilot
COPY --from=build /opt/kvpilot /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 8080 8081
ENTRYPOINT ["kvpilot"]
CMD ["operator"]
