# The README's two commands are `make serve` and `make test`; both set everything up first.
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 50051
PYTEST_ARGS ?=
# Two pytest-xdist workers, a module to a worker (its module-scoped servers stay shared); pytest's
# 30 slowest tests; a stop that names the slowest ones past an hour (tests/time_budget.py).
TEST_REPORT := -n 2 --dist loadscope --durations=30 --time-budget-s=3600

.PHONY: setup serve test test-fast browser lint format protos clean

setup:
	@VENV=$(VENV) scripts/setup.sh

serve: setup
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT)

# The habits every change keeps: lint, formatting, types, import rules.
lint: setup
	@VENV=$(VENV) scripts/lint.sh

# Set-up, lint and every test, each timed (scripts/test.sh).
test:
	@VENV=$(VENV) scripts/test.sh $(TEST_REPORT) $(PYTEST_ARGS)

# The fast loop: the same without the slow real-model tests.
test-fast:
	@VENV=$(VENV) scripts/test.sh -m "not slow" $(TEST_REPORT) $(PYTEST_ARGS)

# Debian's Chromium for the web page's browser tests (tests/ui).
browser:
	@scripts/setup_browser.sh

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos:
	$(BIN)/python -m kvserve.protos.generate

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache .import_linter_cache

# Opt-in, not in CI: the containers for real on a machine without a GPU (root, dockerd, PyPI).
.PHONY: test-compose
test-compose: setup
	scripts/container_test.sh
