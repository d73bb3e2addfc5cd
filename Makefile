# `make demo` and `make test` set everything up on a fresh machine: a virtual environment in
# .venv with the CPU build of torch (pinned, so pip does not pull a multi-GB CUDA build), then
# this package in editable mode. Override TORCH_SPEC to pick another build. PIP_INSTALL
# byte-compiles what it installs (pip's default; the demo's set-up). The tests' set-up does not
# (PIP_DEV): byte-compiling every module of torch, transformers and the tools is most of what
# pip spends, and the tests import about a third of them. tests/run_suite.py lets its
# processes write the bytecode of what they import instead, once, where PYTHONDONTWRITEBYTECODE
# is set (this machine, and so perhaps CI; without that every process compiled every module it
# imported from source: the tests took 119 s longer, 2026-11-28). Measured on this two-core
# machine, 2026-11-29, each pip alone (s, compiled / not): torch 45.6 / 19.2, the test tools
# 18.6 / 9.0, matplotlib 15.3 / 6.4, transformers and accelerate 42.4 / 18.8. A fresh clone's
# `CI=true bash .ci/run` took 11m49, 11m42, 11m57 and 12m18 (the last three with the warm-up
# below) against 12m22 the day before (and 10m46 to 12m36 for earlier code on this machine):
# set-up about 56 s shorter, the two test processes 20-80 s longer (640 / 614 s, 636 / 624,
# 646 / 644 and 667 / 649 against 617 / 589). The CPU time of the whole run did not drop
# (1355-1429 CPU-s against 1375): what set-up no longer compiles, the tests compile, some
# modules in several processes at once.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PIP_INSTALL = $(PY) -m pip install --quiet
PIP_DEV = $(PIP_INSTALL) --no-compile
TOOLS := numpy "pytest>=7" "ruff==0.16.9" "hypothesis==6.170.17"

.PHONY: demo test docs fuzz fuzz-gpu gpu-test lint format bench clean

# The demo needs torch and the package only.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PIP_INSTALL) --no-deps -e .
	touch $(STAMP)

# Tests and lint add pytest and ruff, and the optional integrations they cover. Each pip
# install runs on one core, so torch (19 s on a two-core machine, not byte-compiled) is
# installed beside the test tools and matplotlib (15 s): the two sets share no package, so the
# two pips never write the same files. transformers and accelerate come after both (they share
# numpy, packaging, and accelerate needs torch). Set-up from a fresh clone, two cores,
# byte-compiled: 104 s one after another; 81 s so, with .ci/run's docs set-up and build (31 s)
# beside it (2026-11-28).
$(DEV_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_DEV) "$(TORCH_SPEC)" & torch=$$!; \
	$(PIP_DEV) $(TOOLS); tools=$$?; \
	$(PIP_DEV) matplotlib || echo "matplotlib not installed: plot tests skip"; \
	wait $$torch && test $$tools = 0
	$(PIP_DEV) --no-deps -e .
	touch $(STAMP)
	# Optional: the Hugging Face tests skip cleanly when transformers cannot be installed;
	# accelerate for the Trainer and accelerate loops (tests/test_loops.py, examples/train_loops.py).
	# Beside that pip, on the core it leaves idle, the modules the tests import first are
	# byte-compiled by importing them (torch, Inductor, this package; PIP_DEV compiled none):
	# otherwise both test processes compile them at once as they start. Only a speed-up: its
	# failure changes nothing.
	env -u PYTHONDONTWRITEBYTECODE $(PY) -c "import torchoffload, torch._inductor.compile_fx, \
		torch.testing, hypothesis, pytest" > /dev/null 2>&1 & warm=$$!; \
	$(PIP_DEV) transformers accelerate || { \
		$(PIP_DEV) transformers || echo "transformers not installed: its tests skip"; \
		$(PIP_DEV) accelerate || echo "accelerate not installed: its tests skip"; }; \
	wait $$warm || true
	touch $(DEV_STAMP)

# The documentation site (mkdocs.yml, docs/) needs MkDocs only: mkdocstrings reads the source
# statically, so neither torch nor the package is imported, and it has its own environment
# (.venv-docs), which .ci/run sets up and builds while the tests' set-up runs. Pinned, with the
# packages that parse docstrings and resolve references (griffelib, mkdocstrings,
# mkdocs-autorefs): a newer release can add warnings that --strict turns into errors.
DOCS_VENV ?= .venv-docs
DOCS_STAMP := $(DOCS_VENV)/.installed-docs
$(DOCS_STAMP): Makefile
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet "mkdocs==1.6.1" "mkdocs-material==9.8.2" \
		"mkdocstrings-python==2.0.11" "mkdocstrings==1.0.8" "mkdocs-autorefs==1.4.5" \
		"griffelib==2.4.1"
	touch $(DOCS_STAMP)

# Into site/ (git-ignored); --strict fails on a broken link or anchor, or a docstring that
# mkdocstrings cannot parse.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --quiet

# The demo and the fuzzer write the bytecode of what they import (PIP_DEV compiled none, and
# `make test`'s set-up also serves `make demo`): where PYTHONDONTWRITEBYTECODE is set, each run
# would otherwise compile every module it imports from source.
WRITE_BYTECODE := env -u PYTHONDONTWRITEBYTECODE

demo: $(STAMP)
	$(WRITE_BYTECODE) $(VENV)/bin/torchoffload demo

# Two pytest processes at once, the compile-heavy files and the docs examples in the second
# (tests/run_suite.py says why, with its measurement); `$(PY) -m pytest -q` runs them in one.
test: $(DEV_STAMP)
	$(PY) tests/run_suite.py

# The differential fuzzer, long: FUZZ_EXAMPLES examples per engine, random seeds, failures kept
# in .hypothesis/ and replayed first next time (`make test` runs it small and derandomized).
# `make fuzz FUZZ_EXAMPLES=5000 FUZZ_ENGINE=stream_weights` runs one engine for longer.
FUZZ_EXAMPLES ?= 500
FUZZ_ENGINE ?=
fuzz: $(DEV_STAMP)
	HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(WRITE_BYTECODE) $(PY) -m pytest -q -s \
		tests/test_fuzz.py::test_fuzz $(if $(FUZZ_ENGINE),-k "$(FUZZ_ENGINE)")

# The same machines on a GPU (tests/test_fuzz.py::test_fuzz_gpu), copy streams slowed or not.
fuzz-gpu:
	HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PYTHONPATH=. $(PYTHON) -m pytest -q -s \
		-m gpu tests/test_fuzz.py::test_fuzz_gpu $(if $(FUZZ_ENGINE),-k "$(FUZZ_ENGINE)")

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
	rm -rf $(VENV) $(DOCS_VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis site
