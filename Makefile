# `make demo` and `make test` set everything up on a fresh machine: a virtual environment in
# .venv with the CPU build of torch (pinned, so pip does not pull a multi-GB CUDA build), then
# this package in editable mode. Override TORCH_SPEC to pick another build.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: demo test gpu-test lint format bench clean

# The demo needs torch and the package only.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Tests and lint add pytest and ruff, and the optional integrations they cover.
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet numpy "pytest>=7" "ruff==0.16.9"
	# Optional: the Hugging Face tests skip cleanly when transformers cannot be installed.
	$(PY) -m pip install --quiet transformers || echo "transformers not installed: its tests skip"
	$(PY) -m pip install --quiet matplotlib || echo "matplotlib not installed: plot tests skip"
	touch $(DEV_STAMP)

demo: $(STAMP)
	$(VENV)/bin/torchoffload demo

test: $(DEV_STAMP)
	$(PY) -m pytest -q

SOURCES := torchoffload tests benchmarks examples

lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)

format: $(DEV_STAMP)
	$(VENV)/bin/ruff format $(SOURCES)

# On a GPU machine whose python3 already has torch with CUDA (no venv):
gpu-test:
	PYTHONPATH=. $(PYTHON) -m pytest -q -m gpu

bench:
	PYTHONPATH=. $(PYTHON) benchmarks/activations.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
