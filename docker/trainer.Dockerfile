# syntax=docker/dockerfile:1.7
# searchr1 trainer: GRPO from the trajectory bus, checkpoints, weight pushes to the engines
# (NCCL on GPU). Based on the PyTorch CUDA image, whose torch is reused (never re-downloaded).
# Multi-node: the Helm chart runs `torchrun --no-python ... searchr1 trainer run` in this image.
#   docker build -f docker/trainer.Dockerfile -t searchr1/trainer .
# A CPU image (the compose `cpu` profile): --build-arg BASE_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
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
RUN (getent group 10001 || groupadd --gid 10001 searchr1) \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/searchr1 searchr1 \
    && mkdir -p /index /corpus /models /data /checkpoints \
    && chown 10001:10001 /index /corpus /models /data /checkpoints
COPY --from=build /opt/venv /opt/venv
COPY docker/healthcheck.py /opt/searchr1/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    SEARCHR1_TRAINER__HTTP__HOST=0.0.0.0
USER 10001:10001
WORKDIR /home/searchr1
# 8200: HTTP (health, metrics); 29500: torchrun rendezvous; 29600: the weight-update group.
EXPOSE 8200 29500 29600
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/searchr1/healthcheck.py", "trainer", "/ready"]
ENTRYPOINT ["searchr1", "trainer"]
CMD ["run"]
