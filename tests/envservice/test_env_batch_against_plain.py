"""A batch of sessions on an env server, reset and stepped one request at a time, against the same envs in process:
the same observations, rewards, ends and infos, while the sessions' episodes end at different steps (a hole, the
goal, the step limit) and after a second reset of the same sessions.

Slippery FrozenLake draws each move from its seeded generator, so a session stepped with another's action, or an
env reset with another session's seed, plays differently.
"""

from __future__ import annotations

import random

from tests.envservice.env_helpers import FAST
from turnrl.envs import make
from turnrl.envservice.client import ClientOptions, EnvServerPool, RemoteEnvBatch

SETTINGS = {"max_steps": 5, "is_slippery": True}
SESSIONS = 6
ROUNDS = ([0, 1, 2, 3, 4, 5], [17, 16, 15, 14, 13, 12])
"""The seeds of each reset of the batch."""


def test_a_batch_plays_the_episodes_of_envs_in_process_as_they_end_apart(server):
    pool = EnvServerPool([server], ClientOptions(**FAST))
    batch = RemoteEnvBatch(pool, "FrozenLake", SETTINGS, SESSIONS)
    names = make("FrozenLake").action_names()
    choose = random.Random(0)
    ends: list[tuple[int, bool, bool]] = []  # (step, terminated, truncated) of each episode
    try:
        for seeds in ROUNDS:
            local = [make("FrozenLake", **SETTINGS) for _ in seeds]
            for env, seed, got in zip(local, seeds, batch.reset(seeds), strict=True):
                assert got == env.reset(seed=seed), seed
            running = [True] * SESSIONS
            for step in range(1, SETTINGS["max_steps"] + 2):
                actions = [choose.choice(names) for _ in seeds]
                for k, (env, action, got) in enumerate(zip(local, actions, batch.step(actions), strict=True)):
                    if not running[k]:  # its episode is over: no request, an error in its place
                        assert got.error is not None and "reset first" in str(got.error), (seeds[k], step)
                        continue
                    observation, reward, terminated, truncated, info = env.step(action)
                    assert got.error is None, (seeds[k], step, got.error)
                    assert (got.observation, got.reward, got.terminated, got.truncated, got.info) == (
                        observation, reward, terminated, truncated, info), (seeds[k], step)
                    if terminated or truncated:
                        running[k] = False
                        ends.append((step, terminated, truncated))
            assert not any(running)  # the step limit ends every episode within the loop
    finally:
        batch.close()
        pool.close()
    assert len(ends) == SESSIONS * len(ROUNDS)
    assert len({step for step, _, _ in ends}) >= 3  # the episodes end apart
    assert any(terminated for _, terminated, _ in ends) and any(truncated for _, _, truncated in ends)
