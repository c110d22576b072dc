# The README's two commands are `make serve` and `make test`; both set everything up first.
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 50051
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast browser lint format protos clean

setup:
	@VENV=$(VENV) scripts/setup.sh

serve: setup
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT)

# The habits every change keeps: lint, formatting, types of the core and the contract, import rules.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

test: lint browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The fast loop: lint and every test but the slow real-model ones.
test-fast: lint browser
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

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
