# Both entry points create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: chromium venv demo test test-all bench clean schema chaos authz fuzz switch-check profile-accuracy

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 'setuptools>=68' wheel
	# torch (CPU build, ~190 MB, ~1.5 min): the reference workload of the demo, switch_check and profile_accuracy
	$(BIN)/python -m pip install -q -e '.[dev,plots,torch]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m gearshift.demo

# issue 12: the dashboard's browser tests drive Debian's chromium (no browser download);
# installed once, skipped when already there (as root on CI; sudo otherwise)
CHROMIUM ?= /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium
chromium: $(CHROMIUM)

test: $(STAMP) openssl $(CHROMIUM)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m pytest -q

test-all: $(STAMP) openssl $(CHROMIUM)
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
	$(BIN)/gearshift schema > schema/bus.json

# issue 6: plan switches of the PyTorch reference workload, and the profiled model's accuracy
switch-check: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m loadtest.switch_check --json

profile-accuracy: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m loadtest.profile_accuracy --json

# issue 5: regenerate docs/evaluation.md (simulated comparison of rubick and the baselines)
.PHONY: evaluation
evaluation: $(STAMP)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m gearshift.sim.evaluation --out docs/evaluation.md --json-dir docs/evaluation-runs

# issue 12: deploy/make-certs.sh (and its test) use the openssl command
.PHONY: openssl
openssl:
	@command -v openssl >/dev/null || (apt-get update -qq && apt-get install -y -qq openssl)

# the observability check (issue 12)
.PHONY: observability
observability: $(STAMP) $(CHROMIUM)
	NUMBA_CACHE_DIR=$(CURDIR)/.numba_cache $(BIN)/python -m loadtest.observability --json
