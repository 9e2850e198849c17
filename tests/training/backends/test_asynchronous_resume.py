"""Resumes of an asynchronous run lose nothing: stopped after a step (the stop file) or killed mid-step (SIGKILL)
while the rollout thread plays ahead, then resumed, a run trains the episodes the seeding plan draws for each step
(its groups' seeds) once each, as an uninterrupted run does."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.training.test_commands import config, kinds, overrides, python
from turnrl.envs.seeds import SeedSplits
from turnrl.training.checkpoint import latest_checkpoint, load_trainer_state
from turnrl.training.commands import STOP_FILE, train
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer

STEPS = 4
# One update behind: the rollout thread plays step k + 1 while step k updates, so a stop or a kill always finds
# a batch of episodes rolled out ahead (finished or in flight) that no update has used.
ASYNC = ["distributed.async_rollout=true", "distributed.max_staleness=1", "algorithm.old_logprobs=recompute",
         "algorithm.tis_cap=2.0", f"run.steps={STEPS}", "run.save_every=1"]
Episode = tuple[int, int, int]
"""(group, seed, sample) of one episode of a step."""


def async_config(model_dir: Path, out: Path, *extra: str) -> TrainConfig:
    return config(model_dir, out, *ASYNC, *extra)


def planned_episodes(run: TrainConfig, step: int) -> list[Episode]:
    """The episodes the seeding plan draws for step ``step`` (counted from 1): group ``g`` plays the step's
    ``g``-th training seed, ``groups.group_size`` times."""
    splits = SeedSplits(run.seeds.first_train_seed(), run.seeds.val_start, run.seeds.val_size)
    seeds = splits.train_seeds(step - 1, run.groups.n_groups)
    return sorted((group, seed, sample) for group, seed in enumerate(seeds) for sample in range(run.groups.group_size))


def played_episodes(run: Path) -> dict[int, list[Episode]]:
    """Each logged step's episodes, as its trajectory file holds them."""
    played = {}
    for path in sorted((run / "trajectories").glob("step_*.jsonl")):
        if ".advantages." in path.name:
            continue
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        played[int(path.name.removeprefix("step_").split(".")[0])] = sorted(
            (t["group"], t["seed"], t["sample"]) for t in lines)
    return played


def assert_every_planned_episode_trained_once(run: Path, settings: TrainConfig) -> None:
    """Each step logged once, its trajectory file holding its planned episodes once, no episode in two steps, and
    the final weights updated once per step (the scheduler counts the actor's updates)."""
    assert [step for step, kind in kinds(run) if kind == "step"] == list(range(1, STEPS + 1))
    played = played_episodes(run)
    assert played == {step: planned_episodes(settings, step) for step in range(1, STEPS + 1)}
    every = [episode for episodes in played.values() for episode in episodes]
    assert len({(seed, sample) for _, seed, sample in every}) == len(every)
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "rollout/success" in r}
    assert all(records[step]["batch/samples"] == len(played[step]) for step in played)  # every episode trained
    final = latest_checkpoint(run)
    assert final is not None and final.name == f"step_{STEPS:06d}"
    assert load_trainer_state(final)["actor_scheduler"]["last_epoch"] == STEPS


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, once_per_run) -> Path:
    """The asynchronous run, from its start to its end without a stop (read, never changed, by the tests; run once
    for all the pytest-xdist workers)."""
    return once_per_run("asynchronous_uninterrupted", lambda out: train(async_config(tiny_model_dir, out))) / "run"


def test_the_uninterrupted_run_trains_its_planned_episodes_once(uninterrupted, tiny_model_dir, tmp_path):
    assert_every_planned_episode_trained_once(uninterrupted, async_config(tiny_model_dir, tmp_path))
    staleness = [r.get("async/staleness") for r in map(json.loads, (uninterrupted / "metrics.jsonl").read_text()
                                                       .splitlines()) if "rollout/success" in r]
    assert staleness[1:].count(1.0) >= 1  # it did run ahead


def test_a_run_stopped_after_a_step_and_resumed_trains_each_planned_episode_once(uninterrupted, tiny_model_dir,
                                                                                 tmp_path, monkeypatch, capsys):
    """The stop file, touched during step 2 (as a user does while the rollout thread plays step 3 ahead): the run
    stops after step 2 with its checkpoint and says which rollouts played ahead it drops; the resumed run trains
    steps 3 and 4 on their planned episodes."""
    run = tmp_path / "run"
    step = Trainer.step

    def step_then_stop(self: Trainer, index: int):
        if index == 1:
            (self.run_dir / STOP_FILE).touch()
        return step(self, index)

    monkeypatch.setattr(Trainer, "step", step_then_stop)
    stopped = train(async_config(tiny_model_dir, tmp_path))
    monkeypatch.undo()
    assert stopped["interrupted_at_step"] == 2 and latest_checkpoint(run).name == "step_000002"
    # Step 3 was in flight or finished when the stop came (step 4 too, where step 3 finished during the save).
    said = " ".join(capsys.readouterr().out.split())
    assert "rollouts played ahead and not trained, dropped: step 3" in said or \
        "rollouts played ahead and not trained, dropped: steps 3, 4" in said, said[-2000:]
    assert "(a resume from the last checkpoint plays them again, on the same seeds)" in said
    train(async_config(tiny_model_dir, tmp_path, f"resume={run}"))
    assert "rollouts played ahead" not in capsys.readouterr().out  # a run that ends drops nothing
    settings = async_config(tiny_model_dir, tmp_path)
    assert_every_planned_episode_trained_once(run, settings)
    assert played_episodes(run) == played_episodes(uninterrupted)


KILLED_MID_STEP = """
import os, signal, sys
from turnrl.config import load_config
from turnrl.training.commands import train
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer

update = Trainer.update

def update_or_die(self, step, rollout, keep):
    if step == int(sys.argv[1]):  # its episodes handed to the trainer, the next step's playing ahead
        os.kill(os.getpid(), signal.SIGKILL)
    return update(self, step, rollout, keep)

Trainer.update = update_or_die
train(load_config(TrainConfig, None, sys.argv[2:]))
"""


def test_a_run_killed_mid_step_and_resumed_trains_each_planned_episode_once(uninterrupted, tiny_model_dir,
                                                                            tmp_path):
    """SIGKILL in the update of step 3 (its batch taken from the queue, step 4's played ahead), a checkpoint after
    step 2: the resumed run trains steps 3 and 4 on their planned episodes, step 2's not again."""
    run = tmp_path / "run"
    killed = python(KILLED_MID_STEP, "2", *overrides(tiny_model_dir, tmp_path, *ASYNC))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert latest_checkpoint(run).name == "step_000002"
    train(async_config(tiny_model_dir, tmp_path, f"resume={run}"))
    assert_every_planned_episode_trained_once(run, async_config(tiny_model_dir, tmp_path))
    assert played_episodes(run) == played_episodes(uninterrupted)
