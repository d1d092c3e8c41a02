# syntax=docker/dockerfile:1
# Images for the two processes (targets): `router` (no torch) and `engine`.
#   docker build --target router -t omnibus-router .
#   docker build --target engine -t omnibus-engine .                     # CUDA torch wheels
#   docker build --target engine --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                -t omnibus-engine-cpu .                                 # CPU-only torch
# Models and adapters are mounted at run time (see compose.yaml); nothing is downloaded then.

FROM python:3.11-slim AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app:/app/protos/gen
WORKDIR /app
COPY requirements.txt .

FROM base AS router
# Only what the router imports, at the versions requirements.txt pins.
RUN pip install $(grep -E '^(grpcio|grpcio-tools|grpcio-health-checking|grpcio-reflection|protobuf|tokenizers|structlog|prometheus-client|uvloop)==' requirements.txt)
COPY protos/omnibus protos/omnibus
RUN mkdir -p protos/gen && python -m grpc_tools.protoc -Iprotos --python_out=protos/gen --pyi_out=protos/gen \
      --grpc_python_out=protos/gen protos/omnibus/v1/*.proto
COPY router router
# the one engine module the router shares: the adapter-name rule (no torch)
COPY engine/__init__.py engine/adapter_names.py engine/
USER nobody
EXPOSE 50051 9090
ENTRYPOINT ["python", "-m", "router"]
CMD ["serve", "--help"]

FROM base AS engine
# PyPI's Linux torch wheels bundle CUDA; the GPU driver comes from the host (NVIDIA
# container toolkit). Triton compiles a small launcher at run time, hence gcc.
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "$TORCH_INDEX_URL" "$(grep -E '^torch==' requirements.txt)" \
    && pip install $(grep -vE '^(#|$|torch==|pytest|pytest-asyncio|hypothesis|transformers|peft|accelerate)' requirements.txt)
COPY . .
RUN mkdir -p protos/gen && python -m grpc_tools.protoc -Iprotos --python_out=protos/gen --pyi_out=protos/gen \
      --grpc_python_out=protos/gen protos/omnibus/v1/*.proto
EXPOSE 50061 9091
ENTRYPOINT ["python", "-m", "engine"]
CMD ["serve", "--help"]
