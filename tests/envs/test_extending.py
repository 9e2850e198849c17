"""The env of docs/extending.md, written to its own package, runs through make() without editing turnrl."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from turnrl.envs import AgentEnvWrapper, check_env, make
from turnrl.envs.contract import IMAGE_CAPTION

DOCS = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
DOCS_ID = "my/Corridor-v0"


@pytest.fixture
def my_package(tmp_path, monkeypatch):
    """``my_package.envs``: the docs' env classes and the Gymnasium registration, importable."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    env_code = next(block for block in blocks if "class CorridorEnv" in block)
    register_code = next(block for block in blocks if "gymnasium.register" in block)
    image_code = next(block for block in blocks if "class ImageCorridorEnv" in block)
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(f"{env_code}\n{register_code}\n{image_code}")
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


@pytest.mark.filterwarnings("error")  # a warning of Gymnasium's checker is a failure too
def test_docs_image_env_passes_in_both_modes_and_keys_states_by_its_board(my_package):
    """The guide named no image_shape: an env written from it failed with "an image mode needs image_shape"."""
    for mode in ("text", "image"):
        check_env(make("my_package.envs:ImageCorridorEnv", mode=mode, length=6))
    env = make("my_package.envs:ImageCorridorEnv", mode="image", length=6)
    obs, _ = env.reset(seed=0)
    assert obs["text"] == IMAGE_CAPTION and obs["image"].shape == (16, 96, 3) and obs["image"].dtype == np.uint8
    assert env.observation_space.contains(obs)
    key = env.state_key()
    env.step("Right")
    assert env.state_key() != key and env.observation()["text"] == IMAGE_CAPTION
    assert "P" in make("my_package.envs:ImageCorridorEnv", mode="text").reset(seed=0)[0]["text"]
