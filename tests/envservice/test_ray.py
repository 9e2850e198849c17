"""Envs in Ray env workers: same trajectories as in process, the env contract, worker deaths and hangs."""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.rollout.trajectory_checks import same_trajectory
from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs import check_env, make
from turnrl.envs.contract import optional_methods, state_key
from turnrl.envs.seeds import SeedSplits
from turnrl.envservice.protocol import EnvRaisedError, RemoteEnvError
from turnrl.envservice.ray import EnvHost, EnvWorkerLostError, RayEnvOptions, ray_env_factory
from turnrl.policy.scripted import ExpertPolicy
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import DONE, ERROR

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
CORRIDOR = "tests.envs.toy_envs:Corridor"
RAISING = "tests.envs.toy_envs:BrokenRaisesOnBadAction"
PROBE = "tests.envservice.env_helpers:ProbeEnv"
RAY_BUDGET_S = 600.0
"""How long a worker may take to start or answer before the test fails: a guard against a hang, met by a CI
machine whose cores other jobs hold (two workers loading torch on two busy cores took over 120 s)."""


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray cluster for the module; its workers import the tests' own envs."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


def test_connecting_keeps_the_callers_sigterm_handler_where_ray_init_puts_its_own(monkeypatch):
    """ray.init sets a SIGTERM handler that ends the process at once (sys.exit); ``turnrl train``'s, which stops
    after the step in progress with a checkpoint, stays. Where there was none, Ray's stays (its shutdown at exit).
    Ray's own init here: a run on a cluster does it (tests/training/backends/test_ray_rollout.py, slow)."""
    import signal

    from turnrl.envservice import ray as ray_module

    def rays_handler(signum, frame):  # what ray.init installs
        raise SystemExit(signum)

    class Uninitialized:
        def is_initialized(self) -> bool:
            return False

        def init(self, **kwargs) -> None:
            signal.signal(signal.SIGTERM, rays_handler)

    monkeypatch.setattr(ray_module, "import_ray", Uninitialized)
    before = signal.getsignal(signal.SIGTERM)
    try:
        def runs_handler(signum, frame):
            pass

        signal.signal(signal.SIGTERM, runs_handler)
        ray_module.ensure_ray()
        assert signal.getsignal(signal.SIGTERM) is runs_handler
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ray_module.ensure_ray()
        assert signal.getsignal(signal.SIGTERM) is rays_handler
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.fixture(scope="module")
def sokoban():
    """Two workers of text Sokoban, shared by the module's tests (starting a worker takes seconds)."""
    make_env = ray_env_factory("Sokoban", {}, workers=2, timeout_s=RAY_BUDGET_S)
    yield make_env
    make_env.close()


def play(make_env, env_id: str, fmt_name: str, seeds: list[int], threads: int = 0):
    fmt = get_format(fmt_name, max_actions_per_turn=2)
    agent = AgentConfig(format=fmt_name, max_actions_per_turn=2, max_turns=6, max_actions_per_episode=12)
    executor = ThreadPoolExecutor(threads) if threads else None
    policy = ExpertPolicy(fmt, max_actions_per_turn=2, seed=0, random_action_share=0.3)
    slots = [EpisodeSlot(env=make_env(), seed=seed, group=k) for k, seed in enumerate(seeds)]
    return Rollout(policy, fmt, agent, env_id, executor=executor).run(slots, SamplingConfig())


SEEDS = [0, 1, 2, 3, 11, 12]


def test_a_rollout_over_envs_in_workers_gives_the_trajectories_of_the_same_envs_in_process(sokoban):
    here = play(lambda: make("Sokoban"), "Sokoban", "free_think", SEEDS)
    there = play(sokoban, "Sokoban", "free_think", SEEDS, threads=4)
    assert {t.status for t in here} <= {DONE, "truncated"} and any(t.success for t in here)
    for a, b in zip(here, there):
        same_trajectory(a, b)


@pytest.mark.slow  # the same path runs in tests/training/backends/test_ray_rollout.py's Ray run
def test_an_image_env_in_a_worker_gives_the_same_images_and_the_expert_plans_on_forks():
    # The world-modeling expert plans on deep copies of the env: in a worker, forks of its env there.
    here = play(lambda: make("Sokoban", mode="image"), "Sokoban", "grounding_worldmodeling", SEEDS)
    make_env = ray_env_factory("Sokoban", {"mode": "image"}, workers=1)
    there = play(make_env, "Sokoban", "grounding_worldmodeling", SEEDS)
    for a, b in zip(here, there):
        same_trajectory(a, b)
    assert there[0].images and there[0].images[0].shape[2] == 3 and there[0].images[0].dtype == np.uint8
    make_env.close()


def test_a_sokoban_env_in_a_worker_passes_the_env_checker(sokoban):
    check_env(sokoban(), seed=3)


@pytest.mark.slow
@pytest.mark.parametrize(("env_id", "settings"), [("FrozenLake", {"mode": "image"}), (CORRIDOR, {})])
def test_an_env_in_a_worker_passes_the_env_checker(env_id, settings):
    make_env = ray_env_factory(env_id, settings, workers=1)
    env = make_env()
    check_env(env, seed=3)
    env.reset(seed=3)
    local = make(env_id, **settings)
    obs, _ = local.reset(seed=3)
    # An env without state_key() or text(): the worker answers as the rollout would (a hash, "").
    assert env.state_key() == state_key(local, obs)
    assert env.text() == optional_methods(local).text()
    make_env.close()


def kill(actor) -> None:
    """``ray.kill``, waited for (it returns before the process is gone)."""
    ray.kill(actor)
    with pytest.raises(ray.exceptions.RayActorError):
        for _ in range(100):
            ray.get(actor.size.remote(), timeout=10)
            time.sleep(0.05)


def test_a_worker_killed_mid_episode_ends_its_episodes_as_errors_and_is_replaced(sokoban):
    fmt = get_format("free_think")
    agent = AgentConfig(format="free_think", max_turns=12, max_actions_per_episode=12)
    make_env, pool = sokoban, sokoban.pool
    replaced = pool.replaced
    doomed = pool.actors[0]

    class KillingPolicy(ExpertPolicy):
        """The expert, which kills worker 0 after its first batch of responses."""

        calls = 0

        def generate(self, requests, sampling):
            out = super().generate(requests, sampling)
            self.calls += 1
            if self.calls == 1:
                kill(doomed)
            return out

    groups = EnvGroups(make_env, n_groups=2, group_size=2, seeds=SeedSplits())
    first = Rollout(KillingPolicy(fmt), fmt, agent, "Sokoban").run(groups.train_slots(0), SamplingConfig())
    on_doomed = [env.worker == 0 for env in groups._envs]
    assert sum(on_doomed) == 2  # round robin over the two workers
    assert [t.status for t, lost in zip(first, on_doomed) if lost] == [ERROR, ERROR]
    errors = [t.error for t, lost in zip(first, on_doomed) if lost]
    assert all("EnvWorkerLostError" in error and "env worker 0" in error for error in errors)
    assert "died" in errors[0] and "replaced" in errors[1]  # the first step found it dead, the second its successor
    assert all(t.status == DONE and t.success for t, lost in zip(first, on_doomed) if not lost)
    assert pool.replaced == replaced + 1 and pool.actors[0] is not doomed

    # The next batch: the resets start on the new worker; every episode succeeds.
    second = Rollout(ExpertPolicy(fmt), fmt, agent, "Sokoban").run(groups.train_slots(1), SamplingConfig())
    assert all(t.status == DONE and t.success for t in second)


@pytest.mark.slow
def test_a_worker_that_hangs_past_the_timeout_is_replaced_and_the_reset_after_works():
    # The replacement's first reset imports and builds its env within the worker's start budget, not the call's
    # second (a loaded machine takes longer than that to import the env's modules).
    make_env = ray_env_factory(PROBE, {"delay_s": 3.0}, workers=1, timeout_s=1.0)
    env, neighbour = make_env(), make_env()
    env.reset(seed=0)
    neighbour.reset(seed=1)
    with pytest.raises(EnvWorkerLostError, match="did not answer step\\(\\) within 1 s"):
        env.step("slow")
    # Its neighbour's episode lived on the same worker: it is gone too, and says so without a call.
    with pytest.raises(EnvWorkerLostError, match="replaced"):
        neighbour.step("inc")
    obs, _ = env.reset(seed=0)
    assert obs["text"] == make(PROBE).reset(seed=0)[0]["text"] and env.step("inc")[1] == 1.0
    make_env.close()


@pytest.mark.slow
def test_an_env_that_raises_ends_its_episode_and_is_rebuilt_at_the_next_reset():
    make_env = ray_env_factory(RAISING, {}, workers=1)
    env = make_env()
    env.reset(seed=0)
    with pytest.raises(EnvRaisedError, match="KeyError"):
        env.step("jump")
    with pytest.raises(RemoteEnvError, match="no episode running"):
        env.step("Right")
    env.reset(seed=0)
    assert env.step("Right")[4]["action_is_valid"]
    assert make_env.pool.replaced == 0  # the worker itself was fine
    make_env.close()


@pytest.mark.slow
def test_a_bad_env_id_or_setting_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="no setting colour"):
        ray_env_factory("Sokoban", {"colour": "red"}, workers=1)
    with pytest.raises(ValueError, match="unknown Ray env options"):
        ray_env_factory("Sokoban", {}, workers=1, retries=3)
    with pytest.raises(ValueError, match="prefetch"):
        RayEnvOptions(prefetch=("everything",))


def test_the_host_tells_a_reset_that_returns_the_bare_observation():
    with pytest.raises(TypeError, match=r"reset\(\) must return \(observation, info\), got a dict"):
        EnvHost("tests.envs.toy_envs:BrokenBareReset", {}).reset(0, 0, None, [])


def test_the_host_answers_queries_and_forks_without_ray():
    host = EnvHost("Sokoban", {})
    answer = host.reset(0, 5, None, ["instructions", "action_names", "state_key", "nonsense"])
    local = make("Sokoban")
    obs, _ = local.reset(seed=5)
    assert answer.observation["text"] == obs["text"]
    assert answer.queries["action_names"] == local.action_names()
    assert "unknown query" in str(answer.queries["nonsense"])
    host.fork(0, -1)
    host.step(-1, local.solve()[0], [])
    assert host.query(0, ["text"])["text"] == obs["text"]  # the copy moved, the original did not
    host.close(0)
    assert host.size() == 1


def test_a_copy_of_a_ray_env_is_an_env_of_its_own_in_the_same_worker(sokoban):
    env = sokoban()
    env.reset(seed=7)
    twin = copy.deepcopy(env)
    assert twin.worker == env.worker and twin.index != env.index
    plan = env.solve()
    twin.step(plan[0])
    assert twin.text() != env.text() and env.solve() == plan


def test_a_worker_closes_an_env_where_it_offers_close():
    host = EnvHost("tests.envs.toy_envs:CorridorWithExtras", {})
    host.reset(0, 0, None, ())
    env = host.envs[0]
    host.close(0)
    assert env.closed == 1 and host.size() == 0
    bare = EnvHost("tests.envs.toy_envs:Corridor", {})
    bare.reset(0, 0, None, ())
    bare.close(0)  # an env without close(): forgotten, no error
    assert bare.size() == 0


def test_a_started_worker_builds_its_first_env_once_and_gives_it_to_the_first_index():
    host = EnvHost("tests.envs.toy_envs:CorridorWithExtras", {})
    assert host.start() == 0 and host.spare is not None
    built = host.spare
    host.start()  # a second start builds nothing more
    assert host.spare is built
    host.reset(3, 0, None, ())
    assert host.envs[3] is built and host.spare is None
    host.reset(4, 0, None, ())
    assert host.envs[4] is not built  # the next index builds its own
