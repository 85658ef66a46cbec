# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# Each creates .venv on first use; `make venv` re-installs when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Two cores on the reference machine: one pytest worker per core. Each worker takes whole files
# (a module's servers, fixtures and compiled steps are built once, not once per worker), the
# longest first (tests/conftest.py longest_files_first), so that no long file is left for last.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: venv run test test-fast lint format bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

# The main job (configs/arith_main.yaml): supervised warm-up (cached in runs/sft_cache), a local
# rollout server, then async SAT-GRPO with routing replay on CPU; prints held-out accuracy
# before/after, writes runs/arith_main/.
run: $(STAMP)
	$(PY) -m train --config configs/arith_main.yaml

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(XDIST) --durations=25 tests

# The edit-test loop: the unit tests of a few seconds, no test marked slow (servers, trainers and
# commands in processes) or heavy (tests/conftest.py), no notebook and no benchmark runs.
# `make test` (what CI runs) has them all.
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(XDIST) -m "not slow and not heavy" --ignore=tests/notebooks \
		--ignore=tests/benchmarks tests

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/objective_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
