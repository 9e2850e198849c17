"""The options of ``turnrl serve-env`` and the server's limits, apart from the server itself.

The command line builds every subcommand's parser at start; this module imports nothing heavy, so that
``turnrl envs`` does not pay for FastAPI.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from turnrl.envservice.protocol import TOKEN_ENV_VAR


@dataclass(frozen=True)
class ServerLimits:
    """What one server accepts."""

    max_body_bytes: int = 1 << 20
    """Largest request body (bytes); a larger one is a 413."""
    max_batch: int = 1024
    """Most items (sessions) in one request."""
    max_sessions: int = 4096
    """Open sessions in total."""
    max_sessions_per_client: int = 1024
    """Open sessions per client."""
    idle_timeout_s: float = 600.0
    """A session not used for this long is closed."""
    workers: int = 16
    """Threads that run env calls (a slow env holds one of them; a batch's sessions are stepped on up to this
    many at once)."""
    step_timeout_s: float = 30.0
    """Deadline of one session's reset, step or queries in a request, and of building or copying an env (open,
    validate, fork): a call still running after this long is abandoned and its thread replaced; a reset, step or
    query closes its session with an ``env_timeout`` error item, a build fails its request with a 500
    ``env_timeout``. Below the client's default timeout (60 s), so that a client reads the error rather than timing
    out; ``inf``: no deadline."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_batch", "max_sessions", "max_sessions_per_client", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 (inf for no deadline), got {self.step_timeout_s}")


def port(text: str) -> int:
    """``--port`` of the env and policy servers: 0 to 65535 (0: one the system picks); out of that range a server's
    bind fails with a traceback once it starts."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0 to 65535)")
    return value


def count(text: str) -> int:
    """A count from the command line (sessions, items, bytes, threads, episodes): a whole number from 1. Checked by
    the parser, so that the message names the option (:class:`ServerLimits` names its field)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1")
    return value


def seconds(text: str) -> float:
    """A time limit of ``turnrl serve-env`` or ``serve-policy``: a number of seconds above 0, or ``inf`` for none."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:  # NaN too: it compares false with every time, so the limit would never act
        raise argparse.ArgumentTypeError(f"{text} is not above 0 seconds (inf for no limit)")
    return value


def env_id(text: str) -> str:
    """An id of ``--envs``, checked at start where it can be without building the env: a built-in name, a
    registered Gymnasium id, ``gym:<id>``, or ``module:Class``, whose module is imported (only for such an id) and
    the class looked up as the env catalog does. The server would serve a misspelled id, or a module that does not
    import, and refuse every session of it."""
    import gymnasium as gym

    from turnrl.envs.catalog import builtin_name, unknown_env_message
    from turnrl.envs.gym_adapter import GYM_PREFIX

    if text.startswith(GYM_PREFIX):
        known = text.removeprefix(GYM_PREFIX) in gym.registry
    elif ":" in text:  # no registered name has a colon
        _check_entry_point(text)
        known = True
    else:
        known = builtin_name(text) is not None or text in gym.registry
    if not known:
        raise argparse.ArgumentTypeError(unknown_env_message(text).replace("env.id takes", "--envs takes"))
    return text


def _check_entry_point(text: str) -> None:
    """Import a ``module:Class`` id's module and find what it names, as :func:`turnrl.envs.catalog.make` does; a
    usage error says what failed: the module not on the Python path, an import inside it, or no such attribute."""
    from turnrl.envs.catalog import entry_point
    from turnrl.registry import RegistryError

    try:
        entry_point(text)
    except RegistryError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``turnrl serve-env``."""
    defaults = ServerLimits()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=port, default=8100,
                        help="port to listen on; 0 picks a free one and says which (default: 8100)")
    parser.add_argument("--token", default=None,
                        help=f"bearer token clients must send (default: ${TOKEN_ENV_VAR} if set, else no auth)")
    parser.add_argument("--envs", nargs="+", type=env_id, default=None, metavar="ENV_ID",
                        help="env ids clients may open (default: every built-in env)")
    parser.add_argument("--max-sessions", type=count, default=defaults.max_sessions,
                        help=f"open sessions in total at most (default: {defaults.max_sessions})")
    parser.add_argument("--max-sessions-per-client", type=count, default=defaults.max_sessions_per_client,
                        help=f"open sessions per client at most (default: {defaults.max_sessions_per_client})")
    parser.add_argument("--idle-timeout", type=seconds, default=defaults.idle_timeout_s,
                        help=f"seconds before an unused session is closed (default: {defaults.idle_timeout_s:g})")
    parser.add_argument("--max-body-bytes", type=count, default=defaults.max_body_bytes,
                        help=f"largest request body in bytes (default: {defaults.max_body_bytes})")
    parser.add_argument("--max-batch", type=count, default=defaults.max_batch,
                        help=f"items per request at most (default: {defaults.max_batch})")
    parser.add_argument("--workers", type=count, default=defaults.workers,
                        help=f"threads running env calls; a batch's sessions step on up to this many at once "
                             f"(default: {defaults.workers})")
    parser.add_argument("--step-timeout", type=seconds, default=defaults.step_timeout_s,
                        help="seconds one session's reset, step or queries, or one env's build or fork copy, may run "
                             f"before it is abandoned (env_timeout); inf for no deadline (default: "
                             f"{defaults.step_timeout_s:g})")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level (default: info)")
    parser.add_argument("--access-log", action="store_true",
                        help="log every request (one line each, at info); off by default: a run makes thousands")
