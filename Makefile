# `make demo` and `make test` work on a fresh machine with Python 3.11 and pip: the first run creates .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build is enough for the demo and the tests; users with a GPU install their own torch first.
TORCH ?= torch==2.13.0

.PHONY: demo test mutants bench experiments clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev,hf]"  # hf: the Hugging Face tests run in CI too
	touch $@

demo: $(VENV)/.installed
	$(PY) -m lit_growattn fit --config configs/recall_grow.yaml

# Two test processes (pytest-xdist): most tests are small single-threaded runs, so two cores halve the wall time.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# Mutation testing of the core (docs/testing.md): tens of minutes, so neither in `make test` nor in CI.
# `make mutants MUTANTS='lit_growattn.optimization.*'` runs one module's mutants (mutmut's names, globs allowed).
MUTANT_WORKERS ?= 2
MUTANTS ?=
mutants: $(VENV)/.installed
	$(PY) scripts/mutants.py --workers $(MUTANT_WORKERS) $(MUTANTS)

# `make bench BENCH_ARGS=` runs the full preset; `make experiments ARGS="--text ../shared/data/tinyshakespeare.txt"`.
BENCH_ARGS ?= --quick
bench: $(VENV)/.installed
	$(PY) scripts/bench.py $(BENCH_ARGS)

experiments: $(VENV)/.installed
	$(PY) scripts/experiments.py $(ARGS)

clean:
	rm -rf $(VENV)
