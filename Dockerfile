# syntax=docker/dockerfile:1
# Images for the two processes (targets), both from the one `omnibus` wheel:
#   docker build --target router -t omnibus-router .   # the torch-free base install
#   docker build --target engine -t omnibus-engine .   # omnibus[engine]: CUDA torch wheels
#   docker build --target engine --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                -t omnibus-engine-cpu .               # CPU-only torch
# The GPU image runs torch 2.13.0's PyPI CUDA wheel: the host needs an NVIDIA driver new
# enough for the CUDA runtime it bundles (torch.version.cuda) and the NVIDIA container
# toolkit. Models and adapters are mounted at run time (compose.yaml); nothing is downloaded.

FROM python:3.11-slim-bookworm AS base
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src

# The wheel is built once; neither runtime image carries the source tree or build tools.
FROM base AS wheel
COPY pyproject.toml README.md ./
COPY protos protos
COPY common common
COPY router router
COPY engine engine
COPY kernels kernels
COPY bench bench
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS router
COPY --from=wheel /wheels /wheels
COPY requirements.txt /tmp/requirements.txt
# The base install (torch-free), pinned by the development lock as constraints.
RUN pip install -c /tmp/requirements.txt /wheels/omnibus-*.whl && rm -rf /wheels /tmp/requirements.txt
USER 65534
EXPOSE 50051 9090
ENTRYPOINT ["omnibus-router"]
CMD ["serve", "--help"]

FROM base AS engine
# Triton JIT-compiles a small C launcher for each kernel on first use, so the runtime
# needs a C compiler and libc headers (gcc, libc6-dev); nothing else is built here.
# Mooncake's transfer engine (--kv-transfer) links libibverbs1, even over TCP.
# Unpinned on purpose (DL3008): Debian's security updates replace pinned point releases.
ARG TORCH_INDEX_URL=https://pypi.org/simple
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libibverbs1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels /wheels
COPY requirements.txt /tmp/requirements.txt
# torch first from its index (CUDA or CPU build), then the engine extra pinned by the
# development lock, less its Triton: pip keeps the Triton torch's CUDA build pins (3.7.1).
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && grep -v '^triton==' /tmp/requirements.txt > /tmp/constraints.txt \
    && whl="$(ls /wheels/omnibus-*.whl)" && pip install -c /tmp/constraints.txt "${whl}[engine]" \
    && rm -rf /wheels /tmp/requirements.txt /tmp/constraints.txt \
    && useradd --system --uid 10001 --create-home --home-dir /home/omnibus omnibus
USER 10001
ENV TRITON_CACHE_DIR=/home/omnibus/.triton
EXPOSE 50061 9091
ENTRYPOINT ["omnibus-engine"]
CMD ["serve", "--help"]
