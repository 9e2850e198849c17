# Two commands on a fresh machine: `make quickstart` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torchvision is what transformers' Qwen-VL processors need. The pinned pair is a CUDA build, which runs on a
# CPU too; pass TORCH="torch torchvision" (or a CPU build of your own) to choose another.
TORCH ?= torch==2.14.1 torchvision==0.29.1

.PHONY: quickstart check test test-slow clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
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
