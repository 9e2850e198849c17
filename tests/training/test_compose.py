"""One trainer, composed: no subclass of it anywhere in turnrl, every backend and strategy satisfies its declared
protocol, the trainer takes the parts a caller gives it, and the factory picks them from the config."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

import turnrl
from tests.training.trainer_runs import COMMON
from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, load_config
from turnrl.rewards import Rewards
from turnrl.rollout.ray_workers import RayRollout
from turnrl.rollout.runner import Rollout, RolloutTimings
from turnrl.training import compose
from turnrl.training.backends.asynchronous import AsyncRollout
from turnrl.training.backends.backend import EpisodeRunner, RolloutBackend, RolloutParts, Rollouts, WeightsVersion
from turnrl.training.backends.local import LocalRollout
from turnrl.training.backends.ray_rollout import RayBackend
from turnrl.training.backends.sharded import ShardedRollout
from turnrl.training.parallel.fsdp2 import FSDP2
from turnrl.training.parallel.single import SingleProcess
from turnrl.training.parallel.strategy import ParallelStrategy
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer


def turnrl_modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(turnrl.__path__, prefix="turnrl.")]


def test_no_class_in_turnrl_derives_from_the_trainer():
    subclasses = []
    for name in turnrl_modules():
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional dependency (ray, gymnasium extras) this venv lacks
            continue
        subclasses += [f"{name}.{cls.__name__}" for _, cls in inspect.getmembers(module, inspect.isclass)
                       if issubclass(cls, Trainer) and cls is not Trainer]
    assert "turnrl.training.trainer" in turnrl_modules()
    assert subclasses == []


def protocol_members(protocol: type) -> set[str]:
    """The names a typing.Protocol declares (its own and its bases')."""
    return {name for cls in protocol.__mro__ if cls not in (object, typing.Protocol, typing.Generic)
            for name in vars(cls) if not name.startswith("_")} - {"mro"}


def member(owner: object, name: str) -> Any:
    """``owner``'s ``name``, without calling a property: what its class defines or annotates, or (``owner`` a real
    instance) what its ``__init__`` set; None where it has none."""
    found = inspect.getattr_static(owner, name, None)
    if found is None:
        found = typing.get_type_hints(owner if isinstance(owner, type) else type(owner)).get(name)
    return found


@pytest.fixture(scope="module")
def runner(tiny_policy) -> Rollout:
    agent = AgentConfig(format="no_think")
    return Rollout(tiny_policy, get_format(agent.format), agent, env_id="FrozenLake")


def asynchronous(runner: Rollout) -> AsyncRollout:
    model = runner.policy.model
    assert model is not None
    return AsyncRollout(runner, model, torch.device("cpu"), torch.float32, max_staleness=0, end_step=1)


# Real instances, built as compose builds them; the Ray backend's class (an instance needs Ray workers running).
BACKENDS: dict[str, Callable[[Rollout], object]] = {
    "local": lambda runner: LocalRollout(runner, nullcontext),
    "sharded": lambda runner: ShardedRollout(runner, None, nullcontext),
    "ray": lambda runner: RayBackend,
    "asynchronous": asynchronous,
}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_rollout_backend_has_the_protocols_members_with_its_signatures(name, runner):
    backend = BACKENDS[name](runner)
    for member_name in protocol_members(RolloutBackend):
        declared, given = inspect.getattr_static(RolloutBackend, member_name), member(backend, member_name)
        assert given is not None, f"{name} lacks {member_name}"
        if inspect.isfunction(declared):
            assert list(inspect.signature(given).parameters)[:len(inspect.signature(declared).parameters)] == \
                list(inspect.signature(declared).parameters), (name, member_name)


@pytest.mark.parametrize("make", [SingleProcess, lambda: FSDP2(cpu_offload=False)], ids=["single", "fsdp2"])
def test_every_parallel_strategy_has_the_protocols_members_with_its_signatures(make):
    strategy = make()
    for name in protocol_members(ParallelStrategy) | {"startup"}:  # an attribute the protocol annotates
        declared, given = inspect.getattr_static(ParallelStrategy, name, None), member(strategy, name)
        assert given is not None, f"{type(strategy).__name__} lacks {name}"
        if inspect.isfunction(declared):
            assert list(inspect.signature(given).parameters) == list(inspect.signature(declared).parameters), \
                (type(strategy).__name__, name)


def test_a_member_set_only_by_init_is_found_on_an_instance_and_not_on_its_class(runner):
    # ShardedRollout's timings and rewards are set by its __init__: only a real instance has them.
    assert member(ShardedRollout, "timings") is None
    assert isinstance(member(ShardedRollout(runner, None, nullcontext), "timings"), RolloutTimings)


def typed_assignments(runner: Rollout, workers: RayRollout, asynchronous: AsyncRollout) -> None:
    """Never called: `mypy tests/training/test_compose.py` checks that each implementation is what its protocol
    declares (compose.py's return types check the same inside the package)."""
    backends: list[RolloutBackend] = [LocalRollout(runner, nullcontext), ShardedRollout(runner, None, nullcontext),
                                      RayBackend(workers, nullcontext), asynchronous]
    runners: list[EpisodeRunner] = [runner, workers, *backends]
    strategies: list[ParallelStrategy] = [SingleProcess(), FSDP2(cpu_offload=False)]
    del backends, runners, strategies


def config(model_dir: Path, out: Path, *overrides: str) -> TrainConfig:
    return load_config(TrainConfig, None, [*COMMON, f"model.path={model_dir}", f"run.output_dir={out}", *overrides])


def test_the_factory_picks_the_parts_from_the_config(tmp_path):
    plain = compose.parts(config(tmp_path, tmp_path))
    assert isinstance(plain.parallel, SingleProcess) and plain.rollouts is compose.local_rollouts
    assert compose.parts(config(tmp_path, tmp_path, "distributed.async_rollout=true",
                                "distributed.max_staleness=0")).rollouts is \
        compose.asynchronous_rollouts
    assert compose.parts(config(tmp_path, tmp_path, "distributed.backend=ray")).rollouts is compose.ray_rollouts


class RecordingRollouts:
    """Local backends that record what the trainer handed them: every step's weights and each validation."""

    def __init__(self) -> None:
        self.versions: list[WeightsVersion] = []
        self.made: Rollouts | None = None

    def __call__(self, parts: RolloutParts) -> Rollouts:
        made = compose.local_rollouts(parts)
        train = made.train
        assert isinstance(train, LocalRollout)
        versions = self.versions

        class Recorded(LocalRollout):
            def set_weights(self, model: torch.nn.Module, version: WeightsVersion) -> dict[str, float]:
                versions.append(version)
                return {"recorded/steps": float(version.steps)}

        self.made = Rollouts(Recorded(train.runner, parts.precision), made.validation)
        return self.made


def test_the_trainer_runs_with_the_parts_a_caller_gives_it(tiny_model_dir, tmp_path):
    rollouts, parallel = RecordingRollouts(), SingleProcess()
    trainer = Trainer(config(tiny_model_dir, tmp_path, "algorithm.critic_warmup_steps=1"), rewards=Rewards(),
                      parallel=parallel, rollouts=rollouts)
    try:
        assert trainer.parallel is parallel and rollouts.made is not None
        assert trainer.rollout is rollouts.made.train and trainer.val_rollout is rollouts.made.validation
        outputs = [trainer.step(step) for step in range(2)]
    finally:
        trainer.close()
    # Once built, then after each step: the steps done, and the actor's updates (none in the critic's warm-up).
    assert rollouts.versions == [WeightsVersion(0, 0), WeightsVersion(1, 0), WeightsVersion(2, 1)]
    assert [output.metrics["recorded/steps"] for output in outputs] == [1.0, 2.0]


class SecondRank(SingleProcess):
    """What FSDP2 says on any process but rank 0, in this one process."""

    rank = 1


def test_the_trainer_asks_its_strategy_which_process_writes_the_runs_files(tiny_model_dir, tmp_path):
    trainer = Trainer(config(tiny_model_dir, tmp_path, "algorithm.kl_coef=0.1"), rewards=Rewards(),
                      parallel=SecondRank(), rollouts=compose.local_rollouts)
    trainer.close()
    assert trainer.reference is not None and not (trainer.run_dir / "reference").exists()  # rank 0 saves it
