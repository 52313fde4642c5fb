# `make demo` and `make test` work on a fresh machine with Python 3.11 and pip: the first run creates .venv.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build is enough for the demo and the tests; users with a GPU install their own torch first.
TORCH ?= torch==2.13.0

.PHONY: demo test mutants bench experiments gpu-wheels clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev,hf]"  # hf: the Hugging Face tests run in CI too
	touch $@

demo: $(VENV)/.installed
	$(PY) -m lit_growattn fit --config configs/recall_grow.yaml

# Two test processes (pytest-xdist): most tests are small single-threaded runs, so two cores halve the wall time.
# LIT_GROWATTN_REQUIRE_OPTIONAL: the hf extra is installed here, so a test that cannot import it fails, not skips.
# --durations=15: the 15 slowest tests are listed after the summary, so a test that grew slow shows in every run.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	LIT_GROWATTN_REQUIRE_OPTIONAL=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15

# Mutation testing of the core (docs/testing.md): tens of minutes, so neither in `make test` nor in CI.
# `make mutants MUTANTS='lit_growattn.training.optimization.*'` runs one module's mutants (mutmut's names, globs allowed).
MUTANT_WORKERS ?= 2
MUTANTS ?=
mutants: $(VENV)/.installed
	$(PY) scripts/mutants.py --workers $(MUTANT_WORKERS) $(MUTANTS)

# `make bench BENCH_ARGS=` runs the full preset; `make experiments ARGS="--text tinyshakespeare.txt"`.
BENCH_ARGS ?= --quick
bench: $(VENV)/.installed
	$(PY) scripts/bench.py $(BENCH_ARGS)

experiments: $(VENV)/.installed
	$(PY) studies/growth_pays/experiments.py $(ARGS)

# The wheels a bare GPU machine lacks (Python 3.12 with torch, lightning, transformers 5.17 and the rest of its own
# list, no package index: docs/gpu.md), at the versions the tests ran with when set. scripts/gpu/check.sh installs them.
GPU_WHEELS := jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0 ruamel.yaml==0.19.1 \
	datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.23.0
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
	manylinux1_x86_64
GPU_WHEELS_MAX_MIB := 60
# Downloaded beside .whl/ and swapped in whole, so that a failed download leaves the old set as it was.
gpu-wheels:
	rm -rf .whl.partial
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d .whl.partial $(GPU_WHEELS)
	@size=$$(du -sm .whl.partial | cut -f1); if [ $$size -gt $(GPU_WHEELS_MAX_MIB) ]; then \
		echo "gpu-wheels: $$size MiB, more than the $(GPU_WHEELS_MAX_MIB) MiB the GPU machine takes"; exit 1; fi
	rm -rf .whl && mv .whl.partial .whl
	@du -sh .whl

clean:
	rm -rf $(VENV)
