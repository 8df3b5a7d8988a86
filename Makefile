# Two entry points, both idempotent:
#   make run   - set up .venv and run `bertology analyze` on the bundled model and sample corpus
#   make test  - set up .venv (with test extras) and run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUT ?= runs/sample

.PHONY: run test setup setup-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, from the CPU wheel on this machine's disk; otherwise a multi-GB CUDA build is pulled in.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -m pip install -q torch==2.13.0
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/bertology analyze --out $(OUT)

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
