"""Shared fixtures: a session cache directory, the built-in tiny models, and what is made once per test run.

Tests never read or write ``~/.cache``: ``TURNRL_CACHE`` points at a temporary
directory for the whole session, and the built-in models are built once for the whole
run (every pytest-xdist worker reads the same builds).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from hypothesis import settings

# Hypothesis fails an example that takes over 200 ms by default: on two cores beside the suite's multi-process
# tests a pure function's example can, which says nothing of the function. Properties are what the tests check.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# The Ctrl-C tests send SIGINT to this process and to the commands they start. A suite started as a background
# job of a script (`make test &`, some CI runners) inherits SIGINT ignored, which turnrl rightly keeps ignoring;
# the tests need the terminal's default, so they get it (the commands they start inherit it too).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Triton kernels (the engine's attention) run in Triton's interpreter on CPU tensors when no GPU is there: the
# switch is read when Triton is imported, so it is set before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items) -> None:
    """``cpu_triton`` tests run the engine's Triton kernels on CPU tensors, which only the interpreter can (set above
    when no GPU is there): skipped without Triton, or on a GPU machine (tests/engine/test_llm_engine_gpu.py runs the
    kernels there)."""
    from turnrl.engine.attention import triton_available

    reason = ("Triton is not installed" if not triton_available() else
              "a GPU is here: Triton's interpreter (CPU tensors) is off" if torch.cuda.is_available() else None)
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("cpu_triton") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


# The tiny models are far too small for intra-op threads to pay off: on a
# shared machine they only add contention (a forward pass runs ~40x slower
# with two busy threads than with one).
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def turnrl_cache(tmp_path_factory) -> Path:
    """``TURNRL_CACHE`` for the session: a fresh temporary directory."""
    path = tmp_path_factory.mktemp("turnrl_cache")
    previous = os.environ.get("TURNRL_CACHE")
    os.environ["TURNRL_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("TURNRL_CACHE", None)
    else:
        os.environ["TURNRL_CACHE"] = previous


def run_temp_root(tmp_path_factory) -> Path:
    """The temporary folder of the whole test run: under pytest-xdist, the one above every worker's own (each worker
    is a session of its own, with a temporary folder of its own)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


OncePerRun = Callable[[str, Callable[[Path], None]], Path]
"""``once(name, make)``: a folder ``make`` filled once for the whole test run (see :func:`once_per_run`)."""


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory) -> OncePerRun:
    """``once(name, make) -> folder``: ``make(folder)`` runs once for the whole test run, in whichever pytest-xdist
    worker asks first; a worker that asks meanwhile waits for it, and every one then reads the same folder. For what
    is expensive to make and only read afterwards (a reference run, a launch of several processes): each worker
    would otherwise make its own, on the same two cores. A ``make`` that raised is made again by the next asker."""
    root = run_temp_root(tmp_path_factory)

    def once(name: str, make: Callable[[Path], None]) -> Path:
        folder, done = root / name, root / f"{name}.done"
        with FileLock(root / f"{name}.lock"):
            if not done.is_file():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed make left
                folder.mkdir()
                make(folder)
                done.touch()
        return folder

    return once


@pytest.fixture(scope="session")
def builtin_dir(tmp_path_factory) -> Path:
    """Directory that holds the test run's built-in model builds (pass as ``model.builtin_dir``): one folder for all
    the pytest-xdist workers, so each model is built once (a build takes a lock; the others wait for it and reuse
    it)."""
    path = run_temp_root(tmp_path_factory) / "builtin_models"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(builtin_dir) -> Path:
    """The built-in ``tiny`` Qwen2 model with its ChatML tokenizer, built once per session."""
    from turnrl.config import ModelConfig
    from turnrl.models.builtin import builtin_model_path

    return builtin_model_path(ModelConfig(builtin_preset="tiny", builtin_dir=str(builtin_dir)))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir):
    """An ``HFPolicy`` over the tiny model on CPU (shared: do not change its model)."""
    from turnrl.config import ModelConfig
    from turnrl.policy.hf import HFPolicy

    return HFPolicy.from_config(ModelConfig(device="cpu", dtype="float32"), str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_vlm_dir(builtin_dir) -> Path:
    """The built-in ``vlm-tiny`` Qwen2.5-VL with its processor, built once per session."""
    from turnrl.config import ModelConfig
    from turnrl.models.builtin import builtin_model_path

    return builtin_model_path(ModelConfig(builtin_preset="vlm-tiny", builtin_dir=str(builtin_dir)))


@pytest.fixture(scope="session")
def tiny_vlm_policy(tiny_vlm_dir):
    """An ``HFPolicy`` over the tiny VLM on CPU (shared: do not change its model)."""
    from turnrl.config import ModelConfig
    from turnrl.policy.hf import HFPolicy

    return HFPolicy.from_config(ModelConfig(device="cpu", dtype="float32"), str(tiny_vlm_dir))


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path) -> None:
    """No internet, as on the developers' machines: the Hugging Face hub at a closed port of this machine (every
    request refused at once), an empty Hugging Face cache, no token and no offline mode."""
    import socket

    import huggingface_hub
    from huggingface_hub import hf_api

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(hf_api.api, "endpoint", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture
def default_recursion_limit():
    """Python's default recursion limit (1,000) for the test's length, for tests of text nested deeper than it
    allows: a test run earlier in the same process may have left it raised (torch.compile's inductor raises it to
    2,000; a serial run of the whole suite met that)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(limit)
