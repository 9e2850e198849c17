# Two commands on a fresh machine: `make quickstart` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torchvision is what transformers' Qwen-VL processors need. The pinned pair is a CUDA build, which runs on a
# CPU too; pass TORCH="torch torchvision" (or a CPU build of your own) to choose another.
TORCH ?= torch==2.14.1 torchvision==0.29.1

.PHONY: quickstart check test test-slow clean

# The 3D envs render with OpenGL: headless through EGL (Mesa's software renderer on a machine without a GPU),
# or through Xvfb (a virtual display) when EGL is unavailable. The viewer's tests drive a real headless
# Chromium. All are Debian packages, installed when missing and when we are root (otherwise the tests that
# need them say why they cannot run).
$(VENV)/.installed: pyproject.toml
	@missing=""; command -v Xvfb >/dev/null || missing="$$missing xvfb"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	ldconfig -p 2>/dev/null | grep -q libEGL_mesa || missing="$$missing libegl1 libegl-mesa0 libgl1-mesa-dri"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	elif [ -n "$$missing" ]; then echo "note: missing system packages:$$missing (apt-get install$$missing as root)"; fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# A second run stops with how to continue the first (resume) or start afresh (run.overwrite=true): a run is
# never deleted unasked.
quickstart: $(VENV)/.installed
	$(VENV)/bin/turnrl train --config configs/quickstart.yaml

# Lint, one-way imports (the layers in pyproject.toml) and types, over the package.
check: $(VENV)/.installed
	$(VENV)/bin/ruff check turnrl
	$(VENV)/bin/lint-imports --no-logo --cache-dir .import_linter_cache
	$(VENV)/bin/mypy

# Two workers (pytest-xdist): most tests wait on a single core (imports, Python loops, a process's start), so
# two at once on two cores take about two thirds of the time one at a time does. TEST_WORKERS=0 runs them in
# this process, one at a time. Tests marked with one xdist_group run on one worker (loadgroup): those of a Ray
# cluster that its runs join with address `auto`, which picks the cluster started last on the machine.
TEST_WORKERS ?= 2
test: check
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadgroup

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
