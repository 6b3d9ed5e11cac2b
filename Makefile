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

test: $(STAMP)
	$(PY) -m pytest -q
