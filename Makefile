# Both entry points create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-all bench clean schema

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,plots]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m gearshift.demo

test: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m pytest -q

test-all: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m pytest -q -m ''

clean:
	rm -rf $(VENV) .numba_cache .pytest_cache build *.egg-info

schema: $(STAMP)
	$(BIN)/python -m gearshift.cli schema > schema/bus.json
