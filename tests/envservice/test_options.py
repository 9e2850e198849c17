"""The options of ``turnrl serve-env``: what the command line refuses before the server starts."""

from __future__ import annotations

import argparse
import sys

import gymnasium as gym
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.envs.catalog import ENVS
from turnrl.envservice.options import add_arguments, port, seconds


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="turnrl serve-env")
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "needle"), [
    # A port out of range reached the server's bind, which failed with three tracebacks.
    (["--port", "99999"], "argument --port: 99999 is not a port number (0 to 65535)"),
    (["--port", "-1"], "argument --port: -1 is not a port number (0 to 65535)"),
    (["--port", "http"], "argument --port: 'http' is not a port number (0 to 65535)"),
    # A misspelled env was served, and every session of it refused.
    (["--envs", "Sokoban", "FrozenLak"], "argument --envs: unknown env 'FrozenLak'; did you mean FrozenLake? --envs "
                                         "takes a built-in name"),
    (["--envs", "gym:NoSuch-v0"], "argument --envs: unknown env 'gym:NoSuch-v0'"),
    # A module:Class whose module does not import was served, and every session of it refused.
    (["--envs", "no_such_package.envs:CorridorEnv"], "argument --envs: env 'no_such_package.envs:CorridorEnv': "
                                                     "cannot import module 'no_such_package.envs' (No module named "
                                                     "'no_such_package'); is its package on the Python path"),
    (["--envs", "tests.envs.toy_envs:Coridor"], "argument --envs: env 'tests.envs.toy_envs:Coridor': module "
                                                "'tests.envs.toy_envs' has no attribute 'Coridor'; did you mean "
                                                "Corridor?"),
    # The limits were checked by the server's settings, whose message named the field (max_sessions), not the option.
    (["--max-sessions", "0"], "argument --max-sessions: 0 is below 1"),
    (["--workers", "0"], "argument --workers: 0 is below 1"),
    (["--max-batch", "two"], "argument --max-batch: 'two' is not a whole number"),
    (["--step-timeout", "0"], "argument --step-timeout: 0 is not above 0 seconds (inf for no limit)"),
    (["--idle-timeout", "nan"], "argument --idle-timeout: nan is not above 0 seconds (inf for no limit)"),
])
def test_a_port_env_or_limit_that_cannot_be_served_is_a_usage_error(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("0123456789-+_ ")))
def test_any_port_text_is_a_port_or_an_argument_error(text):
    try:
        number = port(text)
    except argparse.ArgumentTypeError as error:
        assert "is not a port number (0 to 65535)" in str(error), error
        return
    assert isinstance(number, int) and 0 <= number <= 65535


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("0123456789.-+eEinfa_ ")))
def test_any_seconds_text_is_a_time_above_0_or_an_argument_error(text):
    """inf is taken (no limit); NaN is not (it compares false with every time)."""
    try:
        limit = seconds(text)
    except argparse.ArgumentTypeError as error:
        assert "seconds" in str(error), error
        return
    assert limit > 0


def test_every_kind_of_env_id_is_taken_as_given():
    envs = ["sokoban", "FrozenLake", "CartPole-v1", "gym:FrozenLake-v1", "tests.envs.toy_envs:Corridor"]
    assert parse("--port", "0", "--envs", *envs).envs == envs
    assert parse().port == 8100 and parse().envs is None


def test_only_a_module_class_id_is_imported(monkeypatch):
    """The other ids are checked by name, with no env module imported."""
    looked_up = []
    monkeypatch.setattr(ENVS, "get", looked_up.append)
    parse("--envs", "sokoban", "turnrl/FrozenLake-v0", "CartPole-v1", "gym:FrozenLake-v1")
    assert looked_up == []
    parse("--envs", "tests.envs.toy_envs:Corridor")
    assert looked_up == ["tests.envs.toy_envs:Corridor"]


def test_a_module_that_registers_the_gymnasium_id_it_names_is_taken(monkeypatch, tmp_path):
    """``module:registered/Id-v0``, as env.id takes it: the import registers the id."""
    (tmp_path / "registers_corridor.py").write_text(
        "import gymnasium\n"
        "gymnasium.register('turnrl-test/OptionsCorridor-v0', entry_point='tests.envs.toy_envs:CorridorGymEnv')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "registers_corridor:turnrl-test/OptionsCorridor-v0"
    try:
        assert parse("--envs", spec).envs == [spec]
    finally:
        gym.registry.pop("turnrl-test/OptionsCorridor-v0", None)
        sys.modules.pop("registers_corridor", None)


def test_the_limits_given_are_the_servers():
    args = parse("--max-sessions", "8", "--workers", "2", "--step-timeout", "inf", "--idle-timeout", "1.5")
    assert (args.max_sessions, args.workers, args.step_timeout, args.idle_timeout) == (8, 2, float("inf"), 1.5)
