# The two commands of the README: `make demo` (the main job on this machine's CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DATA := data/mnist

.PHONY: venv demo test test-fast system-deps bench clean

# Packages go in through uv (pinned below; pip puts it in the venv first): the same locks, installed in
# seconds where pip took minutes (benchmarks/RESULTS.md, "make demo and make test"). --native-tls: uv trusts
# the system's certificates, as pip does here. --compile-bytecode writes every package's .pyc at install: where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) Python never writes them itself, and each
# `import tensorflow` then compiled TensorFlow's sources again: 7-8 s instead of 3 (benchmarks/RESULTS.md).
UV_VERSION := 0.13.9
UV := $(BIN)/uv pip install --quiet --native-tls --compile-bytecode --python $(BIN)/python

$(STAMP): pyproject.toml requirements.lock requirements-hub-nodeps.txt requirements-data.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/pip install -q --disable-pip-version-check uv==$(UV_VERSION)
	$(UV) -r requirements.lock
	$(UV) --no-deps -r requirements-hub-nodeps.txt
	$(UV) --no-deps -r requirements-data.txt
	$(UV) --no-deps -e .
	touch $@

# The test suite's own packages (requirements-test.lock) only for the targets that run tests.
$(TEST_STAMP): $(STAMP) requirements-test.lock requirements-engines.txt requirements-engines-nodeps.txt
	$(UV) -r requirements-test.lock --constraint requirements.lock
	$(UV) -r requirements-engines.txt --constraint requirements.lock
	$(UV) --no-deps -r requirements-engines-nodeps.txt
	touch $@

# xpk in a venv of its own (its pins differ from requirements.lock): tests/test_engines_gke.py runs its parser.
XPK_STAMP := .venv-xpk/.installed
$(XPK_STAMP): requirements-xpk.txt | $(STAMP)
	test -x .venv-xpk/bin/python || $(PYTHON) -m venv .venv-xpk
	$(BIN)/uv pip install --quiet --native-tls --python .venv-xpk/bin/python --no-deps -r requirements-xpk.txt
	touch $@

venv: $(STAMP)

$(DATA)/manifest.json: | $(STAMP)
	$(BIN)/runner prepare mnist --out $(DATA)

demo: $(STAMP) $(DATA)/manifest.json
	$(BIN)/runner run jobs/mnist_cnn.yaml

system-deps:
	bash scripts/system-deps.sh

# ruff first (pyproject.toml: pyflakes, lines of at most 120, import order, bugbear, pyupgrade): seconds,
# before the suite's minutes.
# The suite on TEST_WORKERS pytest-xdist workers (most of its time is child processes starting TensorFlow and
# waiting on signals, servers and saves); the tests that drive the Docker engine share one worker.
TEST_WORKERS ?= 2

test: $(TEST_STAMP) $(XPK_STAMP) system-deps
	$(BIN)/ruff check --quiet runner tests benchmarks examples scripts
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=15

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .venv-xpk runs data
