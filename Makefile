# Two entry points: `make check` (the main job) and `make test` (the CPU test suite).
# Both create .venv on first use; torch is pinned so that a CPU machine takes the local CPU wheel.
PY := .venv/bin/python

.venv/installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch .venv/installed

install: .venv/installed

check: .venv/installed
	.venv/bin/lockstep check

test: .venv/installed
	$(PY) -m pytest -q

gpu-test:
	PYTHONPATH=. python3 -m pytest -m gpu -q

.PHONY: install check test gpu-test
