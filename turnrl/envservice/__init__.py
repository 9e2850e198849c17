"""The env service: envs that live outside the rollout's process, and where a run's envs live.

- :mod:`~turnrl.envservice.protocol`: the queries such an env answers, the encoding of values and answers, the
  errors, the headers and the token variable (written once, for every transport);
- :mod:`~turnrl.envservice.server`: ``turnrl serve-env``, a plain class behind a thin FastAPI router
  (:mod:`~turnrl.envservice.options`: its command-line options and limits; :mod:`~turnrl.envservice.request_bodies`: its
  request bodies; :mod:`~turnrl.envservice.sessions`: its sessions, counters and env calls);
- :mod:`~turnrl.envservice.client`: the HTTP client, a pool of servers with retries and failover
  (``env.remote``);
- :mod:`~turnrl.envservice.ray`: envs inside Ray actors (``distributed.env_workers``);
- :mod:`~turnrl.envservice.placement`: which of these a run uses (:func:`~turnrl.envservice.placement.env_factory`).

Nothing is imported here, so that reaching one module does not import the others' dependencies (FastAPI,
httpx, Ray).
"""
