# Two commands on a fresh machine: `make quickstart` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build is enough for the quickstart and the tests; pass TORCH=torch to take your platform's default build.
TORCH ?= torch==2.13.0

.PHONY: quickstart check test test-slow clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

quickstart: $(VENV)/.installed
	$(VENV)/bin/turnrl train --config configs/quickstart.yaml

# Lint, one-way imports (the layers in pyproject.toml) and types, over the package.
check: $(VENV)/.installed
	$(VENV)/bin/ruff check turnrl
	$(VENV)/bin/lint-imports --no-logo --cache-dir .import_linter_cache
	$(VENV)/bin/mypy

test: check
	$(PY) -m pytest -q -m "not slow"

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
