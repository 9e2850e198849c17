"""A run says on its console when episodes errored: they count as failures, so an env (or an env server) that
fails would otherwise read as a policy that solves nothing."""

from __future__ import annotations

import json

import pytest

from tests.envs.toy_envs import Corridor
from tests.training.test_commands import overrides
from turnrl.cli import main


class BrokenOnOddSeeds(Corridor):
    """Its reset fails on odd seeds (a lost simulator, say), so some episodes of every rollout error."""

    def reset(self, *, seed=None, options=None):
        if seed is not None and seed % 2:
            raise ConnectionError(f"simulator {seed} is gone")
        return super().reset(seed=seed, options=options)


ENV = f"env.id={__name__}:BrokenOnOddSeeds"


def test_errored_episodes_are_said_once_a_kind_in_steps_and_after_each_validation(tiny_model_dir, tmp_path, capsys):
    main(["train", *overrides(tiny_model_dir, tmp_path, ENV, "run.steps=3", "validation.every=2",
                              "groups.n_groups=4", "validation.episodes=4")])
    out = " ".join(capsys.readouterr().out.split())
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validations = {r["step"]: r["val/errors"] for r in records if "val/errors" in r}
    assert set(validations) == {0, 2, 3} and all(errors > 0 for errors in validations.values())
    episodes = {r["step"]: int(r["val/episodes"]) for r in records if "val/episodes" in r}
    for what, step in (("validation before RL", 0), ("validation after step 2", 2), ("validation after RL", 3)):
        assert (f"{what}: {int(validations[step])} of {episodes[step]} episodes errored (counted as failures): "
                "env reset failed in turn 1: ConnectionError: simulator") in out
    # The steps' errors: one kind (the seeds' numbers aside), said once, at the first step that had it.
    steps = [r for r in records if r.get("rollout/errors")]
    assert steps, "every step's rollout plays odd seeds"
    first = steps[0]["step"]
    assert out.count("episodes errored (counted as failures): env reset failed") == 4
    assert f"step {first}: {int(steps[0]['rollout/errors'])} of" in out
    assert "further steps count them in rollout/errors" in out
    assert f"after RL: {records[-1]['val/success']:.3f} ({int(validations[3])} of {episodes[3]} episodes errored, " \
           "counted as failures: their errors are in trajectories/val_after_rl.jsonl)" in out


def test_a_run_whose_episodes_all_end_well_says_nothing_of_errors(tiny_model_dir, tmp_path, capsys):
    main(["train", *overrides(tiny_model_dir, tmp_path, f"env.id={Corridor.__module__}:Corridor", "run.steps=1")])
    out = capsys.readouterr().out
    assert "errored" not in out and "errors" not in out


class BrokenInEveryStep(Corridor):
    """Resets well, then its simulator fails at the first move."""

    def step(self, action):
        raise ConnectionError("simulator is gone")


def test_expert_demos_that_errored_are_said_and_left_out_of_the_sft_data(tiny_model_dir, tmp_path, capsys):
    """They were dropped unsaid, leaving SFT with the levels the env did not fail on."""
    main(["sft", *overrides(tiny_model_dir, tmp_path, ENV, "sft.episodes=8", "sft.epochs=1")])
    out = " ".join(capsys.readouterr().out.split())
    assert ("SFT demos: 4 of 8 episodes errored (left out of the SFT data): env reset failed in turn 1: "
            "ConnectionError: simulator 1000001 is gone") in out
    assert "SFT data: 4 chats" in out


def test_sft_whose_expert_episodes_all_errored_stops_in_one_line(tiny_model_dir, tmp_path):
    env = f"env.id={__name__}:BrokenInEveryStep"
    with pytest.raises(SystemExit) as stopped:
        main(["sft", *overrides(tiny_model_dir, tmp_path, env, "sft.episodes=4", "sft.epochs=1")])
    assert str(stopped.value) == (
        f"error: env.id='{env.removeprefix('env.id=')}': none of the 4 expert episodes gave a demo (the commonest "
        "error: env step failed in turn 1: ConnectionError: simulator is gone (raised in step at "
        f"test_commands_errors.py:{BrokenInEveryStep.step.__code__.co_firstlineno + 1}) (4 episodes)); check the "
        f"env with `turnrl check-env {env.removeprefix('env.id=')}`, or give SFT chats with sft.data")
    assert not (tmp_path / "run" / "sft" / "model").exists()
