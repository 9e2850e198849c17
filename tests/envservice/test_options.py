"""The options of ``turnrl serve-env``: what the command line refuses before the server starts."""

from __future__ import annotations

import argparse

import pytest

from turnrl.envservice.options import add_arguments


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


def test_every_kind_of_env_id_is_taken_as_given():
    envs = ["sokoban", "FrozenLake", "CartPole-v1", "gym:FrozenLake-v1", "my_package.envs:CorridorEnv"]
    assert parse("--port", "0", "--envs", *envs).envs == envs
    assert parse().port == 8100 and parse().envs is None


def test_the_limits_given_are_the_servers():
    args = parse("--max-sessions", "8", "--workers", "2", "--step-timeout", "inf", "--idle-timeout", "1.5")
    assert (args.max_sessions, args.workers, args.step_timeout, args.idle_timeout) == (8, 2, float("inf"), 1.5)
