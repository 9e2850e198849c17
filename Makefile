# Two commands on a fresh machine: `make quickstart` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build is enough for the quickstart and the tests; pass TORCH=torch to take your platform's default build.
TORCH ?= torch==2.13.0

.PHONY: quickstart test test-slow bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

quickstart: $(VENV)/.installed
	$(VENV)/bin/turnrl train --config configs/quickstart.yaml

test: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache
