# syntax=docker/dockerfile:1
# Images for the two processes (targets), both from the one `omnibus` wheel:
#   docker build --target router -t omnibus-router .   # the torch-free base install
#   docker build --target engine -t omnibus-engine .   # omnibus[engine]: CUDA torch wheels
#   docker build --target engine --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                -t omnibus-engine-cpu .               # CPU-only torch
# The GPU image runs torch 2.13.0's CUDA 12.8 wheels: the host needs an NVIDIA driver
# >= 570 (CUDA 12.8) and the NVIDIA container toolkit. Models and adapters are mounted at
# run time (compose.yaml); nothing is downloaded then.

FROM python:3.11-slim-bookworm AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

# The wheel is built once; neither runtime image carries the source tree or build tools.
FROM base AS wheel
COPY pyproject.toml README.md ./
COPY protos protos
COPY router router
COPY engine engine
COPY kernels kernels
COPY bench bench
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS router
COPY --from=wheel /wheels /wheels
RUN pip install /wheels/omnibus-*.whl && rm -rf /wheels
USER nobody
EXPOSE 50051 9090
ENTRYPOINT ["omnibus-router"]
CMD ["serve", "--help"]

FROM base AS engine
# Triton JIT-compiles a small C launcher for each kernel on first use, so the runtime
# needs a C compiler and libc headers (gcc, libc6-dev); nothing else is built here.
# Unpinned on purpose (DL3008): Debian's security updates replace pinned point releases.
ARG TORCH_INDEX_URL=https://pypi.org/simple
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /wheels
# torch first from its index (CUDA or CPU build), then the engine extra: with torch pinned,
# pip takes the Triton that torch's CUDA build pins (the extra's range admits it).
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && whl="$(ls /wheels/omnibus-*.whl)" && pip install "${whl}[engine]" && rm -rf /wheels \
    && useradd --system --create-home --home-dir /home/omnibus omnibus
USER omnibus
ENV TRITON_CACHE_DIR=/home/omnibus/.triton
EXPOSE 50061 9091
ENTRYPOINT ["omnibus-engine"]
CMD ["serve", "--help"]
