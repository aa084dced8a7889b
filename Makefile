# Both entry points create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-all bench clean schema chaos authz fuzz

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

# issue 7: fault injection, authorisation and the full fuzz run (see README "Guarantees")
chaos: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m loadtest.chaos --jobs 50 --json

authz: $(STAMP)
	$(BIN)/python -m loadtest.authz --json

fuzz: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m pytest -q -m slow tests/test_fuzz.py -s

clean:
	rm -rf $(VENV) .numba_cache .pytest_cache build *.egg-info

schema: $(STAMP)
	$(BIN)/python -m gearshift.cli schema > schema/bus.json

# issue 5: regenerate docs/evaluation.md (simulated comparison of rubick and the baselines)
.PHONY: evaluation
evaluation: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m sim.evaluation --out docs/evaluation.md
