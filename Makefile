# Two entry points, both idempotent:
#   make run   - set up .venv and run `bertology analyze` on the bundled model and sample corpus
#   make test  - set up .venv (with test extras), check the layering and style (make lint), run the whole test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
OUT ?= runs/sample

.PHONY: run test lint setup chromium clean

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

# The viewer's browser tests drive Debian's chromium through Playwright (no browser download).
chromium:
	@command -v chromium >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

run: setup
	$(BIN)/bertology analyze --out $(OUT)

# The layering (core < render < families < studies < api/cli) and the style, import order included; then every test.
lint: setup
	$(BIN)/lint-imports --no-cache
	$(BIN)/ruff check src tests bench tools

test: lint chromium
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs
