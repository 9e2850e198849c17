"""Trajectory records on disk: one JSON line per episode, the images shown and the final ones as PNG files."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from turnrl.agent.formats import ParsedResponse
from turnrl.envs.contract import env_metrics
from turnrl.rollout.trajectory import DONE, Trajectory, TurnRecord, write_trajectories


def frame(value: int) -> np.ndarray:
    return np.full((4, 6, 3), value, dtype=np.uint8)


def test_the_final_observations_image_is_written_beside_the_images_shown(tmp_path):
    episodes = [
        Trajectory(env_id="Lake", seed=0, group=0, sample=0, status=DONE, images=[frame(1), frame(2)],
                   final_images=[frame(3)], final_observation="fell in"),
        Trajectory(env_id="Lake", seed=1, group=1, sample=0),  # text mode: no images at all
    ]
    path = write_trajectories(episodes, tmp_path, name="val.jsonl")
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first["images"] == ["images/val_00000_000.png", "images/val_00000_001.png"]
    assert first["final_images"] == ["images/val_00000_final0.png"] and first["final_observation"] == "fell in"
    written = [np.asarray(Image.open(tmp_path / name)) for name in first["images"] + first["final_images"]]
    assert [int(image[0, 0, 0]) for image in written] == [1, 2, 3]
    assert second["images"] == [] and second["final_images"] == []


def test_each_turn_is_written_with_the_version_of_the_weights_that_sampled_it(tmp_path):
    turns = [TurnRecord(index=k, observation="o", response="r", response_ids=[1], response_logprobs=[-0.1],
                        finish_reason="stop", parsed=ParsedResponse((), {}, True), weights_version=version)
             for k, version in enumerate([2, 3, None])]
    episode = Trajectory(env_id="Lake", seed=0, group=0, sample=0, turns=turns)
    record = json.loads(write_trajectories([episode], tmp_path).read_text())
    assert [turn["weights_version"] for turn in record["turns"]] == [2, 3, None]


def test_an_expert_turn_is_written_with_the_solvers_actions_and_others_without(tmp_path):
    turns = [TurnRecord(index=k, observation="o", response="r", response_ids=[], response_logprobs=[],
                        finish_reason="stop", parsed=ParsedResponse((), {}, True), expert_actions=expert)
             for k, expert in enumerate([["Up"], []])]
    episode = Trajectory(env_id="Lake", seed=0, group=0, sample=0, turns=turns)
    expert, other = json.loads(write_trajectories([episode], tmp_path).read_text())["turns"]
    assert expert["expert_actions"] == ["Up"] and "expert_actions" not in other


# --------------------------------------------------------------------------- the env's figures
def test_the_envs_figures_are_read_as_floats_and_written_with_the_episode(tmp_path):
    assert env_metrics({"success": True}) is None
    figures = env_metrics({"metrics": {"boxes_on_target": 1, "box_cornered": np.float32(0.5), "solved": np.bool_(True)}})
    assert figures == {"boxes_on_target": 1.0, "box_cornered": 0.5, "solved": 1.0}
    assert all(type(value) is float for value in figures.values())
    episode = Trajectory(env_id="Sokoban", seed=0, group=0, sample=0, env_metrics=figures)
    record = json.loads(write_trajectories([episode], tmp_path).read_text())
    assert record["env_metrics"] == figures


@pytest.mark.parametrize("metrics, says", [
    ([1.0], "a dict of names to numbers, got a list"),
    ({"boxes": "two"}, "map names to numbers, got 'boxes': 'two'"),
    ({3: 1.0}, "map names to numbers, got 3: 1.0"),
    ({"boxes": None}, "map names to numbers, got 'boxes': None"),
    ({"boxes": float("nan")}, "info['metrics']['boxes'] must be finite"),
])
def test_figures_that_are_not_names_to_finite_numbers_are_refused_saying_what(metrics, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        env_metrics({"metrics": metrics})


@given(st.dictionaries(st.text(max_size=5), st.one_of(st.none(), st.text(max_size=3), st.floats(), st.integers(),
                                                       st.booleans(), st.lists(st.integers(), max_size=2)),
                       max_size=4))
def test_any_figures_give_floats_or_a_value_error(metrics):
    try:
        figures = env_metrics({"metrics": metrics})
    except ValueError:
        return
    assert figures is not None and all(isinstance(value, float) and math.isfinite(value) for value in figures.values())


def test_a_write_that_fails_midway_leaves_the_steps_earlier_file_whole(tmp_path, monkeypatch):
    """A run killed or refused by the disk while it writes a step's trajectories leaves no file cut short for the
    viewer or a resume to read: the earlier file stays as it was, and no temporary file is left."""
    episodes = [Trajectory(env_id="Lake", seed=seed, group=seed, sample=0) for seed in range(3)]
    path = write_trajectories(episodes[:1], tmp_path, name="step_000001.jsonl")
    before = path.read_text()
    written = []

    def fails_on_the_third(self, shown, final):
        if len(written) == 2:
            raise OSError("the disk went away")
        written.append(self.seed)
        return {"seed": self.seed}

    monkeypatch.setattr(Trajectory, "to_json", fails_on_the_third)
    with pytest.raises(OSError, match="went away"):
        write_trajectories(episodes, tmp_path, name="step_000001.jsonl")
    assert path.read_text() == before and len(before.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001.jsonl"]
