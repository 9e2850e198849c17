"""Where a run's envs live: in this process, on the env servers of ``env.remote``, or in Ray actors.

:func:`env_factory` is the one place a command turns ``env.id``, its settings and where they run into a
``make_env`` for :class:`~turnrl.rollout.groups.EnvGroups`; :func:`build_env` builds one env here, with a
configuration error that names the setting at fault. Either way the env id and settings are checked before
the command goes on (before any model loads).
"""

from __future__ import annotations

from typing import Any, Protocol

from turnrl.config import ConfigError
from turnrl.envs import make
from turnrl.envservice.protocol import RemoteEnvError


class EnvFactory(Protocol):
    """A ``make_env``: each call builds one env. :meth:`close` releases what its envs hold outside this process
    (sessions on env servers, Ray env workers); a command calls it when it ends, however it ends."""

    def __call__(self) -> Any: ...

    def close(self) -> None: ...


class LocalEnvFactory:
    """A ``make_env`` of envs built in this process; the env built to check the settings is the first one handed
    out (an expensive env, a 3D world, is not built twice). Nothing to close: the envs go with the process."""

    def __init__(self, env_id: str, settings: dict[str, Any], checked: Any) -> None:
        self.env_id, self.settings = env_id, dict(settings)
        self._checked = [checked]

    def __call__(self) -> Any:
        try:
            return self._checked.pop()  # atomic: two threads never get the same env
        except IndexError:
            return make(self.env_id, **self.settings)

    def close(self) -> None:
        pass


def build_env(env_id: str, settings: dict[str, Any], where: str = "env.settings") -> Any:
    """``turnrl.envs.make(env_id, **settings)``, with a config error that names the setting at fault.

    An env that rejects a value in words of its own (``invalid literal for int()``, or ``size must be an int``,
    which names no config key) does not say where it was set; the settings are then tried one at a time to
    name it as the config does (``env.settings.size='abc'``).

    Raises:
        ConfigError: unknown env, unknown setting or a value the env refuses.
    """
    try:
        return make(env_id, **settings)
    except (ValueError, TypeError) as error:
        message = str(error)
        if settings and _makes(env_id, {}):
            for name, value in settings.items():
                if not _makes(env_id, {name: value}):
                    raise ConfigError(f"{where}.{name}={value!r} is refused by {env_id}: {message}") from error
            message = f"{where} {settings}: {message}"
        raise ConfigError(message) from error


def env_factory(env_id: str, settings: dict[str, Any], remote: list[str], where: str = "env.settings",
                ray_workers: int = 0, ray_address: str | None = None, timeout_s: float = 60.0) -> EnvFactory:
    """A ``make_env`` for the run's envs: built in this process, opened on the servers of ``env.remote``, or
    (``ray_workers`` above 0, ``distributed.env_workers``) built inside that many Ray actors. Its ``close()``
    closes the remote sessions or stops the Ray actors.

    The env id and settings are checked now, here, by the first server that answers, or in a Ray actor.

    Raises:
        ConfigError: unknown env or a refused setting, or (remote) no server answered.
    """
    if ray_workers > 0:
        if remote:
            raise ConfigError("env.remote and distributed.env_workers both say where the envs live; set one of them")
        from turnrl.envservice.ray import ray_env_factory  # Ray is imported only where it is used

        try:
            return ray_env_factory(env_id, settings, ray_workers, timeout_s=timeout_s, address=ray_address)
        except ValueError as error:
            raise ConfigError(f"env.id={env_id!r} with {where}={settings} in Ray env workers: {error}") from error
    if not remote:
        return LocalEnvFactory(env_id, settings, build_env(env_id, settings, where))
    from turnrl.envservice.client import remote_env_factory  # the HTTP client is imported only where it is used

    try:
        return remote_env_factory(env_id, settings, list(remote))
    except (ValueError, RemoteEnvError) as error:
        raise ConfigError(f"env.id={env_id!r} with {where}={settings} on env.remote={list(remote)}: {error}") \
            from error


def _makes(env_id: str, settings: dict[str, Any]) -> bool:
    """Whether ``env_id`` builds with ``settings`` (an unknown id builds with none)."""
    try:
        make(env_id, **settings)
    except (ValueError, TypeError):
        return False
    return True
