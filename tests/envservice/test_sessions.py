"""The env server's env calls: closing an env."""

from __future__ import annotations

from tests.envs.toy_envs import Corridor, CorridorWithExtras
from turnrl.envservice.sessions import close_env


def test_closing_a_session_closes_its_env_where_it_offers_close():
    env = CorridorWithExtras()
    close_env(env)
    close_env(Corridor())  # offers none: nothing to do, and no error
    assert env.closed == 1
