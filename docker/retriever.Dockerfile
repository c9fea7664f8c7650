# searchr1 retriever: POST /retrieve (HTTP :8000) and Retriever.Search (gRPC :8001).
# CPU by default (faiss-cpu; the MiniLM encoder ships as a PyPI package). For a GPU index
# (exact search as a CUDA matmul + top-k) build on a PyTorch CUDA base:
#   docker build -f docker/retriever.Dockerfile -t searchr1/retriever .
#   docker build -f docker/retriever.Dockerfile -t searchr1/retriever:cuda \
#       --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime .
# Built by the engine's own BuildKit (DOCKER_BUILDKIT=1 or buildx): no `# syntax=` line, so no
# frontend image is fetched from a registry. Everything above the service's ENV lines is the
# same in every Dockerfile: on one base the images share every layer (one venv on disk).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS deps
# Optional: a torch index (a mirror, or a local PEP 503 folder), pip's index settings.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
COPY docker/ca-certificates/ /usr/local/share/ca-certificates/
# Dependencies first (cached until pyproject.toml, constraints.txt or requirements.lock change),
# then the code. CPU bases install from requirements.lock (hashes); see install-deps.sh.
COPY pyproject.toml constraints.txt requirements.lock /src/
COPY docker/install-deps.sh docker/requirements.py /src/docker/
RUN --mount=type=cache,target=/root/.cache/pip sh /src/docker/install-deps.sh

FROM deps AS wheel
# (build arguments are per stage: pip's settings again, for the build backend's download)
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
COPY README.md /src/
COPY searchr1 /src/searchr1
COPY protos /src/protos
COPY retriever /src/retriever
COPY inference /src/inference
COPY engine_client /src/engine_client
COPY orchestrator /src/orchestrator
COPY trainer /src/trainer
COPY inspector /src/inspector
COPY gateway /src/gateway
COPY stack /src/stack
COPY demos /src/demos
RUN --mount=type=cache,target=/root/.cache/pip sh /src/docker/install-deps.sh wheel

FROM ${BASE_IMAGE}
COPY docker/ca-certificates/ /usr/local/share/ca-certificates/
# `sglang-python` runs the base image's interpreter (where sglang and sglang-router live),
# whatever its path; elsewhere it is simply unused. A fixed numeric uid: Kubernetes'
# runAsNonRoot can only verify a numeric USER.
RUN printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /usr/local/bin/sglang-python \
    && chmod 755 /usr/local/bin/sglang-python \
    && if ls /usr/local/share/ca-certificates/*.crt >/dev/null 2>&1; then update-ca-certificates; fi \
    && (getent group 10001 || groupadd --gid 10001 searchr1) \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/searchr1 searchr1 \
    && mkdir -p /index /corpus /models /data /checkpoints /runs \
    && chown 10001:10001 /index /corpus /models /data /checkpoints /runs
# The venv (1 GB+) is one layer that changes only with the dependencies; the code is a small
# layer on top, so a code edit never ships a new venv.
COPY --from=deps /opt/venv /opt/venv
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    /opt/venv/bin/pip install --no-cache-dir --no-deps --no-index /wheels/*.whl
COPY docker/healthcheck.py /opt/searchr1/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    SEARCHR1_RETRIEVER__HTTP__HOST=0.0.0.0
LABEL searchr1.image=retriever
USER 10001:10001
WORKDIR /home/searchr1
EXPOSE 8000 8001
# /ready: healthy once the index is loaded (compose starts dependants only then).
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/searchr1/healthcheck.py", "retriever", "/ready"]
ENTRYPOINT ["searchr1", "retriever"]
CMD ["serve", "--index", "/index"]
