# One command to run, one to test. Both set up everything on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt | md5sum | cut -c1-8)
PROTO_OUT := protos/gen
PROTO_SRC := $(wildcard protos/omnibus/v1/*.proto)
PROTO_STAMP := $(PROTO_OUT)/.stamp
export PYTHONPATH := $(CURDIR):$(CURDIR)/$(PROTO_OUT)

.PHONY: setup proto test test-gpu gpu-wheels run bench-offline bench-strategies bench-lora bench-gpu clean

setup: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	touch $@

proto: $(PROTO_STAMP)

$(PROTO_STAMP): $(STAMP) $(PROTO_SRC)
	rm -rf $(PROTO_OUT) && mkdir -p $(PROTO_OUT)
	if [ -n "$(PROTO_SRC)" ]; then $(PY) -m grpc_tools.protoc -Iprotos --python_out=$(PROTO_OUT) \
	  --pyi_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) $(PROTO_SRC); fi
	touch $@

# The whole CPU suite (Triton kernels run under the interpreter).
test: setup proto
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" tests

# On a CUDA host: kernels at real shapes, CUDA graphs vs eager. These use the host's own
# Python (GPU_PY) with its CUDA torch and triton: the venv's torch is the CPU build.
# If that Python lacks structlog / pytest-asyncio, `make gpu-wheels` (here, with network)
# fetches them into .whl/ and these targets install them into .gpu-site/ first.
GPU_PY ?= python3
GPU_ENV = if [ -d .whl ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile \
	  --upgrade --target .gpu-site .whl/*.whl && export PYTHONPATH=$(CURDIR)/.gpu-site:$$PYTHONPATH; fi;
test-gpu:
	$(GPU_ENV) $(GPU_PY) -m pytest -q -m gpu tests/test_kernels_gpu.py tests/test_engine_gpu.py

gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  $$(grep -E '^(structlog|pytest-asyncio)==' requirements.txt)

# `make run`: one engine worker and the router on localhost, serving MODEL (by default
# the demo checkpoint, built on first use without any download; delete models/demo to
# rebuild it). Ctrl-C stops both.
# Then, in another shell: $(PY) -m router.client "Once upon a time"
DEMO_MODEL := models/demo
MODEL ?= $(DEMO_MODEL)
ENGINE_PORT ?= 50061
ROUTER_PORT ?= 50051
ENGINE_FLAGS ?=
ROUTER_FLAGS ?=

$(DEMO_MODEL)/config.json: | setup
	$(PY) scripts/build_demo_model.py --out $(DEMO_MODEL) --steps 300

run: setup proto $(MODEL)/config.json
	@trap 'kill $$engine 2>/dev/null; wait $$engine 2>/dev/null' EXIT; \
	$(PY) -m engine serve --port $(ENGINE_PORT) --model $(MODEL) $(ENGINE_FLAGS) & engine=$$!; \
	$(PY) -m router serve --port $(ROUTER_PORT) --engine localhost:$(ENGINE_PORT) --model $(MODEL) $(ROUTER_FLAGS)

bench-offline: setup
	$(PY) -m bench.offline --out docs/benchmarks/offline.md

# The four batching policies on one CPU model and workload (~6 min on 2 cores).
bench-strategies: setup proto
	$(PY) -m bench strategies --out docs/benchmarks/strategies.md

# On a CUDA host: Llama-3-8B-shaped roofline, throughput vs transformers, multi-LoRA.
bench-gpu:
	$(GPU_ENV) $(GPU_PY) -m bench.gpu --out docs/benchmarks/gpu.md

# Multi-LoRA throughput: 1, 8, 32 and 128 adapters against the base model, in one run.
bench-lora: setup proto
	$(PY) -m bench.lora --out docs/benchmarks/lora.md

clean:
	rm -rf $(PROTO_OUT) .pytest_cache
