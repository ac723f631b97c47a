# Two entry points: `make check` (the main job) and `make test` (the CPU test suite).
# Both create .venv in this directory on first use and install into it only. torch is pinned;
# which wheel pip takes depends on the index: set TORCH_INDEX (for example
# https://download.pytorch.org/whl/cpu) to install torch from that index alone.
PY := .venv/bin/python
TORCH_INDEX ?=

# A TORCH_INDEX other than the one .venv was built from rebuilds .venv from scratch: pip would
# keep the torch already there, since the same version from another index satisfies the pin.
# An unset TORCH_INDEX keeps whatever .venv holds.
BUILT_INDEX := $(shell cat .venv/torch-index 2>/dev/null)
INDEX_CHANGED := $(if $(TORCH_INDEX),$(filter-out $(BUILT_INDEX),$(TORCH_INDEX)))
ifneq ($(INDEX_CHANGED),)
.PHONY: .venv/installed
endif

.venv/installed: pyproject.toml
	python3 -m venv $(if $(INDEX_CHANGED),--clear) .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e .
	printf '%s\n' '$(TORCH_INDEX)' > .venv/torch-index
	touch .venv/installed

install: .venv/installed

check: .venv/installed
	.venv/bin/lockstep check

# One pytest worker per CPU, at most 8 (pytest-xdist; a test may start 2-4 rank processes).
# On this project's 2-core machine, 2026-12-07: 533-593 s with 2 workers against 12-13 minutes
# in one process, which had brought CI (install included) to 916 s.
# `.venv/bin/python -m pytest FILE` still runs in one process.
test: .venv/installed
	$(PY) -m pytest -q -n auto --maxprocesses 8

gpu-test:
	@python3 -c "import torch, triton, transformers, safetensors, pytest" 2>/dev/null || { \
	  echo "make gpu-test: python3 lacks one of torch, triton, transformers, safetensors, pytest: this target runs the GPU tests with the system Python of a CUDA machine (README, Set-up); .venv/bin/python -m pytest -m gpu skips them on a machine without CUDA"; exit 2; }
	@python3 -c "import torch; raise SystemExit(0 if torch.cuda.is_available() else 1)" || { \
	  echo "make gpu-test: python3's torch sees no CUDA GPU (torch.cuda.is_available() is False), so every GPU test would skip: run it on a CUDA machine (README, Set-up)"; exit 2; }
	PYTHONPATH=. python3 -m pytest -m gpu -q

# Mutation testing of protocol/ (docs/mutation.md): a deterministic sample of the generated
# mutants, each put to tests/protocol, `lockstep check` and the fast simulator tests; about 21
# minutes of a quiet 2-core machine (estimated from CPU times; 78 minutes on shared cores).
# MUTATION_SAMPLE=0 runs every mutant.
MUTATION_SAMPLE ?= 300
mutation: .venv/installed
	nice -n 19 $(PY) tools/mutation.py --jobs 2 $(if $(filter 0,$(MUTATION_SAMPLE)),,--sample $(MUTATION_SAMPLE)) --out mutation-results

.PHONY: install check test gpu-test mutation
