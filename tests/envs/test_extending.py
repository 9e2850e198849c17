"""The env of docs/extending.md, written to its own package, runs through make() without editing turnrl."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gymnasium as gym
import pytest

from turnrl.envs import AgentEnvWrapper, check_env, make

DOCS = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
DOCS_ID = "my/Corridor-v0"


@pytest.fixture
def my_package(tmp_path, monkeypatch):
    """``my_package.envs``: the docs' env class and its Gymnasium registration, importable."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    env_code = next(block for block in blocks if "class CorridorEnv" in block)
    register_code = next(block for block in blocks if "gymnasium.register" in block)
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(f"{env_code}\n{register_code}")
    monkeypatch.syspath_prepend(str(tmp_path))
    gym.registry.pop(DOCS_ID, None)  # the docs test may have run the registration already
    yield package
    for name in ("my_package.envs", "my_package"):
        sys.modules.pop(name, None)
    gym.registry.pop(DOCS_ID, None)


def test_docs_env_by_module_class(my_package):
    env = make("my_package.envs:CorridorEnv", length=8)
    assert type(env).__module__ == "my_package.envs" and env.length == 8
    check_env(env)


def test_docs_env_by_gymnasium_id_after_importing_its_module(my_package):
    env = make(f"my_package.envs:{DOCS_ID}", length=8)
    assert isinstance(env, AgentEnvWrapper) and env.unwrapped.length == 8
    check_env(env)
    assert make(DOCS_ID).spec.max_episode_steps == 50  # registered now; the TimeLimit is kept
