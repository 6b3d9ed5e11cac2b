# Quick start: `make run` (demo model) and `make test` (the suite). Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: run test setup
setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dsv4 serve

# the suite in parallel workers (pytest-xdist; at most 4: each holds a torch and its threads,
# tests/conftest.py shares the cores between them): 2 cores take it from 15 to about 8 minutes
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4
