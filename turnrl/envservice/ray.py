"""Envs stepped inside Ray actors: :class:`RayEnv`, an :class:`~turnrl.envs.contract.AgentEnv` whose env lives in an
env worker.

An env worker is a Ray actor (the body is :class:`EnvHost`) that holds many envs of one id and settings, each
built by ``turnrl.envs.make`` the first time it is used. :class:`RayEnv` is the proxy a rollout holds: it answers
the env contract (``reset``, ``step``, ``close`` and the queries of :mod:`turnrl.envservice.protocol`:
``instructions``, ``action_names``, ``state_facts``, ``solve``, ``state_key``, ``text``, ``image``,
``action_budget``) by calling its worker. :func:`ray_env_factory` is what the trainer calls when
``distributed.env_workers`` is above 0: it starts the workers (joining or starting Ray) and hands out proxies
spread round robin over them.

What a caller can rely on (the contract of :class:`~turnrl.envservice.client.RemoteEnv`, whose errors these are):

- **Same trajectories.** Values cross as Python objects (Ray pickles them): observations, images, ``info``,
  tuples and numpy numbers come back equal, so a seeded episode in a worker equals the same episode in process.
- **Few round trips.** Each reset and step brings back the queries the rollout asks every turn
  (``action_names``, ``state_key``; ``instructions`` after a reset), cached until the state changes.
- **Faults end one episode, never the run.** A worker that dies (or does not answer within ``timeout_s``,
  and is then killed) is replaced at once by a fresh one. The steps of the episodes it held raise
  :class:`EnvWorkerLostError` (a :class:`~turnrl.envservice.protocol.SessionLostError`), which the rollout
  records as an env error of that episode; the next reset of the same env starts on the new worker. An env that
  raises gives :class:`~turnrl.envservice.protocol.EnvRaisedError` and is rebuilt at its next reset.

Ray is imported when a worker is started, so that the env service works without it.
"""

from __future__ import annotations

import copy
import itertools
import signal
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from turnrl.envs.catalog import make
from turnrl.envs.contract import AgentEnv, optional_methods, reset_answer
from turnrl.envservice.protocol import (
    RESET_QUERIES,
    STEP_QUERIES,
    EnvRaisedError,
    ItemResult,
    QueriedEnv,
    RemoteEnvError,
    SessionLostError,
    answer_query,
    check_prefetch,
    queries_to_bring,
    query_failure,
)

RAY_INSTALL_HINT = "pip install 'ray>=2.40'"


class EnvWorkerLostError(SessionLostError):
    """The env worker holding this episode died or hung (and was replaced): the episode's state is gone."""


def import_ray() -> Any:
    """The ``ray`` module; ImportError saying how to install it where it is missing."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(f"Ray workers need the ray package: {RAY_INSTALL_HINT}") from error
    return ray


def ensure_ray(address: str | None = None) -> Any:
    """The ``ray`` module, connected: the running session if there is one, else ``ray.init(address)``.

    ``address`` None starts a local cluster on this machine; ``"auto"`` joins the cluster that
    ``ray start --head`` started here; ``ray://host:10001`` joins a remote one through Ray Client.
    """
    ray = import_ray()
    if not ray.is_initialized():
        extra = {"include_dashboard": False} if address is None else {}  # a cluster keeps its own dashboard
        # ray.init puts a handler of its own on SIGTERM, which ends the process at once (sys.exit): a handler the
        # caller had (``turnrl train``'s, which stops after the step in progress with a checkpoint) is put back.
        kept = signal.getsignal(signal.SIGTERM)
        ray.init(address=address, ignore_reinit_error=True, **extra)
        if callable(kept) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, kept)
    return ray


# --------------------------------------------------------------------------- inside the worker
class EnvHost:
    """The body of an env worker: envs of one id and settings, by index, each built on its first use (the first
    one when the worker starts: :meth:`start`).

    Plain Python (Ray wraps it in an actor), so its behaviour is the same in a test without Ray.
    An env that raises in ``reset`` or ``step`` is dropped (closed), and built afresh at its next use.
    """

    def __init__(self, env_id: str, settings: dict[str, Any]) -> None:
        self.env_id = env_id
        self.settings = dict(settings)
        self.envs: dict[int, AgentEnv] = {}
        self.last_obs: dict[int, dict[str, Any]] = {}
        self.spare: AgentEnv | None = None
        """An env built by :meth:`start` and not yet given an index."""

    def _env(self, index: int) -> AgentEnv:
        env = self.envs.get(index)
        if env is None:
            env, self.spare = (self.spare or make(self.env_id, **self.settings)), None
            self.envs[index] = env
        return env

    def validate(self, index: int) -> None:
        """Build env ``index`` now (kept for its first use): ValueError/TypeError for a bad id or setting."""
        self._env(index)

    def reset(self, index: int, seed: int | None, options: dict[str, Any] | None,
              queries: Sequence[str]) -> ItemResult:
        env = self._env(index)
        try:
            obs, info = reset_answer(env.reset(seed=seed, options=options))
        except Exception:
            self.close(index)
            raise
        self.last_obs[index] = obs
        return ItemResult(obs, info, queries=self.query(index, queries))

    def step(self, index: int, action: str, queries: Sequence[str]) -> ItemResult:
        env = self.envs.get(index)
        if env is None:  # a worker that replaced a dead one never saw this env's reset
            raise RemoteEnvError(f"env {index} has no episode on this worker; call reset() first")
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except Exception:
            self.close(index)
            raise
        self.last_obs[index] = obs
        return ItemResult(obs, info, float(reward), bool(terminated), bool(truncated), self.query(index, queries))

    def query(self, index: int, names: Sequence[str]) -> dict[str, Any]:
        """Each query's result, or a :class:`RemoteEnvError` where it raised (the env goes on)."""
        env = self._env(index)
        out: dict[str, Any] = {}
        for name in dict.fromkeys(names):
            try:
                out[name] = answer_query(env, name, self.last_obs.get(index, {}))
            except Exception as error:
                out[name] = RemoteEnvError(f"{name}() failed: {query_failure(error)}")
        return out

    def fork(self, index: int, new_index: int) -> None:
        """Env ``new_index`` becomes a deep copy of env ``index``, state included."""
        self.envs[new_index] = copy.deepcopy(self._env(index))
        self.last_obs[new_index] = copy.deepcopy(self.last_obs.get(index, {}))

    def close(self, index: int) -> None:
        """Close and forget env ``index``; never raises (a failing close must not take the worker down)."""
        env = self.envs.pop(index, None)
        self.last_obs.pop(index, None)
        if env is None:
            return
        try:
            optional_methods(env).close()
        except Exception:
            pass

    def size(self) -> int:
        """Envs held now."""
        return len(self.envs)

    def start(self) -> int:
        """Build one env now and keep it for the first index asked for: a fresh worker's first call then waits
        for the env's modules to import within the worker's start budget, not the call's timeout (a loaded
        machine takes seconds to import them). Returns the envs held."""
        if not self.envs and self.spare is None:
            self.spare = make(self.env_id, **self.settings)
        return len(self.envs)


# --------------------------------------------------------------------------- the workers, seen from outside
@dataclass(frozen=True)
class RayEnvOptions:
    """How env workers are started and called."""

    timeout_s: float = 60.0
    """Longest wait for one call; a worker that takes longer is taken for hung, killed and replaced."""
    start_timeout_s: float = 300.0
    """Longest wait for a new worker to start (a process, its imports, a busy cluster making room) and for
    the first env to be built."""
    num_cpus: float | None = None
    """CPUs each worker reserves in Ray's scheduling; None: Ray's default for actors (1 to place it, 0 to
    run, so that many workers share a node)."""
    prefetch: tuple[str, ...] = ()
    """Queries to bring back with every reset and step besides ``action_names`` and ``state_key``, e.g.
    ``("state_facts",)`` when state rewards read them every turn."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.start_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got {self.timeout_s} and {self.start_timeout_s}")
        if self.num_cpus is not None and self.num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0 or None, got {self.num_cpus}")
        check_prefetch(self.prefetch)


class EnvWorkerPool:
    """The env workers of one env id and settings; a worker that dies or hangs is replaced (thread-safe).

    Each worker has a generation, raised when it is replaced: an env whose episode began on an earlier
    generation knows that its state is gone.

    Args:
        env_id: the env id (``env.id``), built in each worker by ``turnrl.envs.make``.
        settings: its settings.
        workers: how many workers to start.
        options: timeout and resources.
        address: the Ray cluster to join when Ray is not running yet (see :func:`ensure_ray`).
    """

    def __init__(self, env_id: str, settings: dict[str, Any], workers: int, options: RayEnvOptions | None = None,
                 address: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"env workers: need at least 1, got {workers}")
        self.ray = ensure_ray(address)
        self.env_id, self.settings = env_id, dict(settings)
        self.options = options or RayEnvOptions()
        resources = {"num_cpus": self.options.num_cpus} if self.options.num_cpus is not None else {}
        self._actor_class = self.ray.remote(EnvHost).options(max_restarts=0, **resources)
        self._lock = threading.Lock()
        self.actors = [self._start() for _ in range(workers)]
        self.generations = [0] * workers
        self._started: set[tuple[int, int]] = set()
        """``(worker, generation)`` pairs that answered once: their calls no longer wait for a start."""
        self.closed = False
        self.replaced = 0
        """Workers replaced so far (dead or hung)."""
        self._fork_indices = itertools.count(-1, -1)

    def fork_index(self) -> int:
        """A fresh index for a copied env: negative, so that it never meets the factory's (0, 1, 2, ...)."""
        with self._lock:
            return next(self._fork_indices)

    def __len__(self) -> int:
        return len(self.actors)

    def _start(self) -> Any:
        return self._actor_class.remote(self.env_id, self.settings)

    def current(self, worker: int) -> tuple[Any, int]:
        """Worker ``worker``'s actor handle and generation."""
        with self._lock:
            if self.closed:
                raise RemoteEnvError(f"the env workers of {self.env_id!r} were shut down; build new envs")
            return self.actors[worker], self.generations[worker]

    def replace(self, worker: int, generation: int) -> None:
        """Start a new actor in place of generation ``generation`` of ``worker`` (once, whichever thread
        asks first); the old one is killed in case it only hung."""
        with self._lock:
            if self.generations[worker] != generation:
                return  # another caller replaced it already
            old = self.actors[worker]
            self.actors[worker] = self._start()
            self.generations[worker] += 1
            self.replaced += 1
        try:
            self.ray.kill(old, no_restart=True)
        except Exception:  # dead already
            pass

    def call(self, worker: int, generation: int, method: str, *args: Any) -> Any:
        """``method(*args)`` on generation ``generation`` of ``worker``, waited for at most ``timeout_s``.

        Raises:
            EnvWorkerLostError: that generation is gone (replaced earlier, or it died or hung now: it is
                replaced before this raises).
            EnvRaisedError: the env raised in the worker.
        """
        actor, current = self.current(worker)
        where = f"env worker {worker} ({self.env_id})"
        if current != generation:
            raise EnvWorkerLostError(f"{where} was replaced after it died or hung; this episode is lost (the "
                                     "next reset starts on the new worker)")
        exceptions = self.ray.exceptions
        waited, timeout = f"{method}()", self.options.timeout_s
        try:
            if (worker, generation) not in self._started:
                waited, timeout = "when started", self.options.start_timeout_s
                self.ray.get(actor.start.remote(), timeout=timeout)
                with self._lock:
                    self._started.add((worker, generation))
                waited, timeout = f"{method}()", self.options.timeout_s
            return self.ray.get(getattr(actor, method).remote(*args), timeout=timeout)
        except exceptions.GetTimeoutError:
            self.replace(worker, generation)
            raise EnvWorkerLostError(
                f"{where} did not answer {waited} within {timeout:g} s; it was replaced and this episode is lost "
                "(raise distributed.timeout_s for envs this slow)") from None
        except (exceptions.RayActorError, exceptions.ActorUnavailableError) as error:
            self.replace(worker, generation)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise EnvWorkerLostError(f"{where} died ({reason}); it was replaced and this episode is lost (the next "
                                     "reset starts on the new worker)") from None
        except exceptions.RayTaskError as error:
            cause = error.cause if isinstance(error.cause, BaseException) else error
            if isinstance(cause, RemoteEnvError):
                raise type(cause)(f"{where}: {cause}") from None
            raise EnvRaisedError(f"{where}: {method}() raised {type(cause).__name__}: {cause}") from None

    def send(self, worker: int, generation: int, method: str, *args: Any) -> None:
        """``method(*args)`` without waiting for it (closing envs); nothing if that generation is gone."""
        with self._lock:
            if self.closed:
                return
            actor, current = self.actors[worker], self.generations[worker]
        if current == generation:
            try:
                getattr(actor, method).remote(*args)
            except Exception:  # Ray shut down: nothing left to close
                pass

    def validate(self, index: int = 0) -> None:
        """Build env ``index`` on worker 0 now (it is then the first env handed out).

        Raises:
            ValueError: the env id or a setting was refused (as ``turnrl.envs.make`` raises it).
        """
        actor, generation = self.current(0)
        try:
            self.ray.get(actor.validate.remote(index), timeout=self.options.start_timeout_s)
            with self._lock:
                self._started.add((0, generation))
        except self.ray.exceptions.RayTaskError as error:
            cause = error.cause if isinstance(error.cause, BaseException) else error
            raise ValueError(f"the env workers cannot build {self.env_id!r} with {self.settings}: {cause}") from None
        except self.ray.exceptions.GetTimeoutError:
            raise EnvWorkerLostError(f"env worker 0 did not start and build {self.env_id!r} within "
                                     f"{self.options.start_timeout_s:g} s; is the Ray cluster short of CPUs?") from None

    def shutdown(self) -> None:
        """Kill every worker (their envs are gone; proxies raise on their next call)."""
        with self._lock:
            self.closed = True
            actors = list(self.actors)
        for actor in actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass


# --------------------------------------------------------------------------- one env
class RayEnv(QueriedEnv):
    """One env in an env worker; an :class:`~turnrl.envs.contract.AgentEnv`.

    Args:
        pool: the workers.
        worker: the worker that holds this env.
        index: the env's key in its worker (unique in the pool).
    """

    def __init__(self, pool: EnvWorkerPool, worker: int, index: int) -> None:
        self.pool = pool
        self.env_id = pool.env_id
        self.worker = worker
        self.index = index
        self._generation: int | None = None
        """The worker generation this env's current state lives on (None: nothing there yet)."""
        self._episode = False
        self._cache: dict[str, Any] = {}
        self._finalizer: weakref.finalize | None = None

    def _bind(self, generation: int) -> None:
        """This env's state now lives on ``generation``; close it there when this proxy is collected."""
        if self._generation != generation:
            if self._finalizer is not None:
                self._finalizer.detach()
            self._finalizer = weakref.finalize(self, self.pool.send, self.worker, generation, "close", self.index)
            self._finalizer.atexit = False
        self._generation = generation

    def _forget(self) -> None:
        """The episode ended badly (worker lost, env raised): nothing to continue, the next reset starts over."""
        self._episode = False
        self._cache = {}

    # ------------------------------------------------------------------ the contract
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode; on a worker that died just now, on its replacement instead (once)."""
        queries = queries_to_bring(RESET_QUERIES, self.pool.options.prefetch)
        seed = None if seed is None else int(seed)  # a numpy integer pickles as one, but prints oddly in errors
        for attempt in range(2):
            _, generation = self.pool.current(self.worker)
            try:
                answer = self.pool.call(self.worker, generation, "reset", self.index, seed, options, queries)
            except EnvWorkerLostError:
                self._forget()
                if attempt:
                    raise
                continue  # a reset loses nothing: start the episode on the new worker
            except RemoteEnvError:
                self._forget()
                raise
            self._bind(generation)
            self._episode = True
            self._cache = answer.queries
            return answer.observation, answer.info
        raise AssertionError("unreachable")

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Apply one action in the worker: ``(observation, reward, terminated, truncated, info)``.

        Raises:
            EnvWorkerLostError: the worker died or hung; this episode cannot go on.
            EnvRaisedError: the env raised in the worker (it is rebuilt at the next reset).
            RemoteEnvError: no episode is running (reset first, or the last one ended).
        """
        if not self._episode or self._generation is None:
            raise RemoteEnvError(f"{self.env_id}: step() with no episode running; call reset() first")
        queries = queries_to_bring(STEP_QUERIES, self.pool.options.prefetch)
        try:
            answer = self.pool.call(self.worker, self._generation, "step", self.index, action, queries)
        except RemoteEnvError:
            self._forget()
            raise
        self._cache = answer.queries
        if answer.terminated or answer.truncated:
            self._episode = False
        return answer.observation, answer.reward, answer.terminated, answer.truncated, answer.info

    def _query(self, name: str) -> Any:
        """A query's result for the current state: from the cache, else one call (cached until the state
        changes)."""
        if name not in self._cache:
            _, generation = self.pool.current(self.worker)
            if self._generation is not None and generation != self._generation:
                self._forget()
                raise EnvWorkerLostError(f"env worker {self.worker} ({self.env_id}) was replaced; {name}() of the "
                                         "lost state cannot be answered (reset first)")
            answer = self.pool.call(self.worker, generation, "query", self.index, [name])
            self._bind(generation)
            self._cache.update(answer)
        value = self._cache[name]
        if isinstance(value, RemoteEnvError):
            raise RemoteEnvError(f"env worker {self.worker} ({self.env_id}): {value}")
        return copy.deepcopy(value)  # callers may change what they get; the cache must not change

    def close(self) -> None:
        """Close the env in its worker (it can be reset again: the worker builds another)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._generation is not None:
            self.pool.send(self.worker, self._generation, "close", self.index)
        self._generation = None
        self._forget()

    def __deepcopy__(self, memo: dict[int, Any]) -> RayEnv:
        """A copy with an env of its own in the same worker, state included (the expert plans on copies)."""
        twin = RayEnv(self.pool, self.worker, self.pool.fork_index())
        if self._generation is None:
            return twin
        self.pool.call(self.worker, self._generation, "fork", self.index, twin.index)
        twin._bind(self._generation)
        twin._episode = self._episode
        twin._cache = copy.deepcopy(self._cache)
        return twin

    def __repr__(self) -> str:
        return f"RayEnv({self.env_id!r}, worker {self.worker}, env {self.index}, generation {self._generation})"


# --------------------------------------------------------------------------- what the trainer calls
class RayEnvFactory:
    """A ``make_env`` whose envs live in env workers: the k-th env on worker ``k mod workers``.

    Built by :func:`ray_env_factory`; ``pool`` holds the workers, :meth:`close` kills them.
    """

    def __init__(self, pool: EnvWorkerPool) -> None:
        self.pool = pool
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def __call__(self) -> RayEnv:
        with self._lock:
            index = next(self._counter)
        return RayEnv(self.pool, index % len(self.pool), index)

    def close(self) -> None:
        self.pool.shutdown()


def ray_env_factory(env_id: str, settings: dict[str, Any], workers: int, timeout_s: float = 60.0,
                    address: str | None = None, **options: Any) -> RayEnvFactory:
    """A ``make_env`` for :class:`~turnrl.rollout.groups.EnvGroups` whose envs live in ``workers`` Ray actors.

    Starts the workers (joining the Ray session of this process, or ``address``, or a local cluster) and
    checks now, on the first worker, that it builds ``env_id`` with ``settings``; that env is the first
    one handed out.

    Args:
        env_id: the env id (``env.id``).
        settings: its settings (``env.settings``).
        workers: how many env workers (``distributed.env_workers``).
        timeout_s: longest wait for one reset, step or query (``distributed.timeout_s``).
        address: the Ray cluster when Ray is not running yet (``distributed.ray_address``).
        options: other fields of :class:`RayEnvOptions` (``num_cpus``, ``prefetch``).

    Raises:
        ValueError: an env id or setting the worker refused, or a bad option.
        ImportError: Ray is not installed.
    """
    known = set(RayEnvOptions.__dataclass_fields__) - {"timeout_s"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown Ray env options {unknown}; allowed: {sorted(known)}")
    pool = EnvWorkerPool(env_id, settings, workers, RayEnvOptions(timeout_s=timeout_s, **options), address)
    try:
        pool.validate(0)
    except Exception:
        pool.shutdown()
        raise
    return RayEnvFactory(pool)
