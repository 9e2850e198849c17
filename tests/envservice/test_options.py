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
])
def test_a_port_or_env_that_cannot_be_served_is_a_usage_error(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_every_kind_of_env_id_is_taken_as_given():
    envs = ["sokoban", "FrozenLake", "CartPole-v1", "gym:FrozenLake-v1", "my_package.envs:CorridorEnv"]
    assert parse("--port", "0", "--envs", *envs).envs == envs
    assert parse().port == 8100 and parse().envs is None
