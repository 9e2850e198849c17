"""The env server's env calls: closing an env."""

from __future__ import annotations

from tests.envs.toy_envs import Corridor, CorridorWithExtras
from turnrl.envservice.sessions import close_env


def test_closing_a_session_closes_its_env_where_it_offers_close():
    env = CorridorWithExtras()
    close_env(env)
    close_env(Corridor())  # offers none: nothing to do, and no error
    assert env.closed == 1


def test_the_failed_calls_remembered_for_retries_are_bounded(monkeypatch):
    """An env that always raises must not grow the server's records of failed calls without bound."""
    from turnrl.envservice import sessions as module

    monkeypatch.setattr(module, "RECENTLY_FAILED", 3)
    table = module.SessionTable()
    for k in range(10):
        session = module.Session(id=f"s{k}", env_id="Corridor", settings={}, owner="me", env=Corridor())
        table.add(session)
        table.failed[session.id] = module.Applied("step", 1, "{}", {"ok": False})
        table.remove(session, "env_error")
    assert list(table.failed) == ["s7", "s8", "s9"] and len(table.closed) == 10
