"""Trajectory records on disk: one JSON line per episode, the images shown and the final ones as PNG files."""

from __future__ import annotations

import json
import math
import re
from functools import partial

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from turnrl.agent.formats import ParsedResponse
from turnrl.envs.contract import env_metrics
from turnrl.rollout.context import EpisodeTokens
from turnrl.rollout.trajectory import DONE, ERROR, Trajectory, TurnRecord, write_trajectories


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


# --------------------------------------------------------------------------- what a record says
def turn(**fields) -> TurnRecord:
    return TurnRecord(index=0, observation="o", response="r", response_ids=[1], response_logprobs=[-0.1],
                      finish_reason="stop", parsed=ParsedResponse((), {}, True), **fields)


def test_only_an_episode_that_ended_cleanly_with_sampled_tokens_and_turns_is_trainable(tiny_tokenizer):
    tokens = EpisodeTokens(tiny_tokenizer)
    episode = partial(Trajectory, env_id="Lake", seed=0, group=0, sample=0)
    assert episode(status=DONE, tokens=tokens, turns=[turn()]).trainable
    assert episode(tokens=tokens, turns=[turn()]).trainable  # truncated episodes train too
    assert not episode(status=ERROR, tokens=tokens, turns=[turn()]).trainable
    assert not episode(status=DONE, turns=[turn()]).trainable  # a text-only policy's: no tokens
    assert not episode(status=DONE, tokens=tokens).trainable  # no turn played


def test_a_new_episode_record_is_truncated_and_unsuccessful_until_the_rollout_says_otherwise(tmp_path):
    record = json.loads(write_trajectories([Trajectory(env_id="Lake", seed=0, group=0, sample=0)], tmp_path)
                        .read_text())
    assert (record["status"], record["success"], record["error"]) == ("truncated", False, None)


def test_a_turns_image_place_is_written_only_where_its_images_do_not_stand_before_the_text(tmp_path):
    episode = Trajectory(env_id="Lake", seed=0, group=0, sample=0, turns=[turn(), turn(image_at=7)])
    before_text, inside = json.loads(write_trajectories([episode], tmp_path).read_text())["turns"]
    assert "image_at" not in before_text and inside["image_at"] == 7


def test_rejection_reasons_are_written_only_for_a_turn_that_has_one(tmp_path):
    turns = [turn(actions=["Up", "Up"], actions_valid=[True, False], invalid_reasons=[None, "a wall"]),
             turn(actions=["Up"], actions_valid=[True], invalid_reasons=[None])]
    rejected, accepted = json.loads(write_trajectories(
        [Trajectory(env_id="Lake", seed=0, group=0, sample=0, turns=turns)], tmp_path).read_text())["turns"]
    assert rejected["invalid_reasons"] == [None, "a wall"] and "invalid_reasons" not in accepted


def test_trajectories_are_written_into_a_directory_made_on_the_way(tmp_path):
    out = tmp_path / "run" / "validation"
    episode = Trajectory(env_id="Lake", seed=0, group=0, sample=0, images=[frame(4)])
    path = write_trajectories([episode], out)
    assert path.parent == out and (out / json.loads(path.read_text())["images"][0]).is_file()
