# The README's two commands are `make serve` and `make test`; both set everything up first.
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 50051
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast protos bench clean

setup:
	@VENV=$(VENV) scripts/setup.sh

serve: setup
	$(BIN)/kvserve serve --host $(HOST) --port $(PORT)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

protos:
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
