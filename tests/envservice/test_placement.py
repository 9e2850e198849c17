"""Where envs live: built here with errors that name the setting at fault (env.remote and Ray workers are
tested with a server and a Ray cluster in tests/envservice/test_server.py and test_ray.py)."""

from __future__ import annotations

import re

import pytest

from turnrl.config import ConfigError
from turnrl.envservice.placement import build_env, env_factory


@pytest.mark.parametrize(
    ("env_id", "settings", "needle"),
    [
        ("Chess", {"size": 4}, "unknown env 'Chess'"),  # the id is at fault, not the setting
        ("Sokoban", {"size": "abc", "num_boxes": 1}, "env.settings.size='abc' is refused by Sokoban"),
        ("Countdown", {"max_steps": "abc"}, "env.settings.max_steps='abc'"),
        ("FrozenLake", {"sizee": 4}, "no setting sizee"),
        ("FrozenLake", {"size": 1}, "env.settings.size=1 is refused by FrozenLake: size must be"),
        ("FrozenLake", {"size": "banana", "is_slippery": False}, "env.settings.size='banana' is refused by "
                                                                 "FrozenLake: size must be an int"),
    ],
)
def test_build_env_names_the_setting_at_fault(env_id, settings, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build_env(env_id, settings)


def test_build_env_builds_the_env():
    assert build_env("FrozenLake", {"size": 5}).size == 5


def test_envs_here_hand_out_the_checked_env_first_then_new_ones():
    make_env = env_factory("FrozenLake", {"size": 5}, [])
    first, second = make_env(), make_env()
    assert first is not second and first.size == second.size == 5


def test_servers_and_ray_workers_at_once_are_a_config_error():
    with pytest.raises(ConfigError, match="env.remote and distributed.env_workers"):
        env_factory("FrozenLake", {}, ["http://127.0.0.1:9"], ray_workers=2)
