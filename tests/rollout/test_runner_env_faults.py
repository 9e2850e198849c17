"""Envs that misbehave inside a rollout on the tiny model's tokens: each ends its own episode as an error that
names the turn, is counted in the metrics and written with the batch; the other episodes play on untouched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.envs.toy_envs import Corridor
from tests.rollout.test_runner import TextPolicy, TokenPolicy, answer, play
from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs import EnvCheckError, check_env
from turnrl.envs.contract import MAX_TEXT_LENGTH
from turnrl.models.loading import load_processor
from turnrl.models.vision import ImageEncoder
from turnrl.policy.interface import Completion, Policy
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import DONE, ERROR, TRUNCATED, Trajectory, write_trajectories

MAX_TURNS = 3
BAD = 1
"""The slot of the batch whose env misbehaves."""


class Misbehaves(Corridor):
    """A long corridor (``Left`` is always a valid step and never ends the episode) whose ``fault`` strikes at the
    step of turn ``turn`` (1-based), or at reset for ``turn=0``."""

    def __init__(self, fault: str, turn: int = 2) -> None:
        super().__init__(length=50)
        self.fault, self.turn, self.steps = fault, turn, 0

    def reset(self, *, seed=None, options=None):
        obs, info = super().reset(seed=seed, options=options)
        self.steps = 0
        if self.turn == 0 and self.fault == "bare observation":
            return obs
        return (self.spoiled(obs), info) if self.turn == 0 else (obs, info)

    def step(self, action):
        self.steps += 1
        obs, reward, terminated, truncated, info = super().step(action)
        if self.steps != self.turn:
            return obs, reward, terminated, truncated, info
        if self.fault == "nan reward":
            return obs, float("nan"), terminated, truncated, info
        if self.fault == "inf reward":
            return obs, float("inf"), terminated, truncated, info
        if self.fault == "both flags":
            return obs, reward, True, True, info
        if self.fault == "str flags":
            return obs, reward, "False", "False", info
        if self.fault == "str reward":
            return obs, "1", terminated, truncated, info
        if self.fault == "str success":
            return obs, reward, terminated, truncated, {**info, "success": "False"}
        if self.fault == "info not dict":
            return obs, reward, terminated, truncated, None
        if self.fault == "numpy answers":  # Gymnasium's envs answer so: read, not refused
            return obs, np.float32(reward), np.bool_(terminated), np.bool_(truncated), \
                {**info, "success": np.bool_(False)}
        if self.fault == "unserializable info":
            return obs, reward, terminated, truncated, {**info, "handle": object(), "array": np.zeros(3),
                                                         "metrics": {"steps": np.float32(self.steps)}}
        return self.spoiled(obs), reward, terminated, truncated, info

    def spoiled(self, obs: dict[str, Any]) -> Any:
        if self.fault == "raises":
            raise RuntimeError("the simulator\ncrashed")
        if self.fault == "wrong type":
            return [obs["text"]]
        if self.fault == "text not str":
            return {"text": b"bytes"}
        if self.fault == "huge text":
            return {"text": "#" * 1_000_000}
        if self.fault == "9,000 characters":
            return {"text": "#" * 9000}
        if self.fault == "lone surrogate":
            return {"text": obs["text"] + " \ud800"}
        if self.fault == "world text":  # read, not refused
            return {"text": obs["text"] + " café 日本 ⬛"}
        return obs


def batch(fault: str, turn: int) -> list[EpisodeSlot]:
    envs = [Corridor(length=50), Misbehaves(fault, turn), Corridor(length=50)]
    return [EpisodeSlot(env=env, seed=k, group=k) for k, env in enumerate(envs)]


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity, which Python writes but JSON has not."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def written(trajectories: list[Trajectory], out: Path) -> list[dict[str, Any]]:
    path = write_trajectories(trajectories, out, name="step.jsonl")
    return [strict_json(line) for line in path.read_text().splitlines()]


def check_only_the_bad_episode_errs(trajectories: list[Trajectory], out: Path, says: str, turn: int) -> None:
    """The bad episode is an error saying ``says`` and its turn on one line, the others played every turn, the
    metrics count one error and stay finite, and the whole batch is written."""
    bad = trajectories[BAD]
    assert bad.status == ERROR and says in bad.error, bad.error
    assert "\n" not in bad.error and len(bad.error) < 1000, bad.error
    assert (f"turn {turn}" in bad.error) if turn else ("reset" in bad.error), bad.error
    assert len(bad.turns) == turn and not bad.trainable
    for good in trajectories[:BAD] + trajectories[BAD + 1:]:
        assert good.status == TRUNCATED and good.truncation_reason == "max_turns" and good.error is None
        assert len(good.turns) == MAX_TURNS and (good.trainable or good.tokens is None)
    metrics = rollout_metrics(trajectories)
    assert metrics["errors"] == 1.0 and metrics["episodes"] == 3.0
    assert all(np.isfinite(value) for value in metrics.values()), metrics
    records = written(trajectories, out)
    assert [record["status"] for record in records] == [TRUNCATED, ERROR, TRUNCATED]
    assert records[BAD]["error"] == bad.error and len(records[BAD]["turns"]) == turn


def play_tokens(tiny_tokenizer, slots: list[EpisodeSlot]) -> list[Trajectory]:
    """The batch played on the tiny model's tokens (a token-exact context), the policy answering ``Left``."""
    return play(TokenPolicy(tiny_tokenizer, answer("Left")), slots, max_turns=MAX_TURNS)


# --------------------------------------------------------------------------- text mode, the tiny model's tokens
@pytest.mark.parametrize("fault, says", [
    ("raises", "RuntimeError: the simulator crashed"),
    ("wrong type", "an observation must be a dict"),
    ("text not str", "an observation must be a dict"),
])
def test_an_env_that_fails_at_reset_errs_only_its_episode(tiny_tokenizer, tmp_path, fault, says):
    trajectories = play_tokens(tiny_tokenizer, batch(fault, turn=0))
    check_only_the_bad_episode_errs(trajectories, tmp_path, says, turn=0)


@pytest.mark.parametrize("turn", [1, 2, 3])
@pytest.mark.parametrize("fault, says", [
    ("raises", "RuntimeError: the simulator crashed"),
    ("wrong type", "an observation must be a dict"),
    ("text not str", "an observation must be a dict"),
])
def test_an_env_step_that_fails_in_turn_k_errs_only_its_episode(tiny_tokenizer, tmp_path, fault, says, turn):
    trajectories = play_tokens(tiny_tokenizer, batch(fault, turn))
    check_only_the_bad_episode_errs(trajectories, tmp_path, says, turn)
    bad = trajectories[BAD]
    assert [turn.actions for turn in bad.turns[:-1]] == [["Left"]] * (turn - 1)
    assert bad.turns[-1].actions == [] and np.isfinite(bad.total_reward)


@pytest.mark.parametrize("fault, says", [
    ("str flags", "TypeError: terminated must be a bool, got a str: 'False'; truncated must be a bool, got a str: "
                  "'False'"),
    ("str reward", "TypeError: the reward must be a number, got a str: '1'"),
    ("str success", "TypeError: info['success'] must be a bool, got a str: 'False'"),
    ("info not dict", "TypeError: step()'s info must be a dict, got a NoneType"),
])
def test_a_step_answer_of_the_wrong_types_errs_only_its_episode(tiny_tokenizer, tmp_path, fault, says):
    """Read with ``bool()``, the str "False" ended the episode as the task done; read with ``float()``, the str "1"
    was a reward: what ``check_env`` refuses, the rollout refuses too, in the turn it happens."""
    trajectories = play_tokens(tiny_tokenizer, batch(fault, 2))
    check_only_the_bad_episode_errs(trajectories, tmp_path, says, 2)
    assert trajectories[BAD].error.startswith("env step failed in turn 2: TypeError: ")


def test_numpy_flags_and_rewards_are_read_as_plain_ones(tiny_tokenizer, tmp_path):
    trajectories = play_tokens(tiny_tokenizer, batch("numpy answers", 2))
    assert [t.status for t in trajectories] == [TRUNCATED] * 3 and trajectories[BAD].error is None
    assert trajectories[BAD].total_reward == trajectories[0].total_reward
    written(trajectories, tmp_path)


@pytest.mark.parametrize("fault", ["nan reward", "inf reward"])
def test_a_reward_that_is_not_finite_is_an_error_of_its_turn(tiny_tokenizer, tmp_path, fault):
    """One NaN in a turn reward would make the whole batch's advantages NaN: the turn scores the rewards'
    ``on_error`` (0) and says why in its reward errors, which the metrics count; the episode plays on."""
    trajectories = play_tokens(tiny_tokenizer, batch(fault, 2))
    assert [t.status for t in trajectories] == [TRUNCATED] * 3
    bad = trajectories[BAD].turns[1]
    assert bad.reward_errors == [f"env: non-finite reward ({float(fault.split()[0])})"]
    assert bad.rewards["env"] == 0.0 and np.isfinite(bad.reward)
    metrics = rollout_metrics(trajectories)
    assert metrics["reward_errors"] == 1.0 and all(np.isfinite(value) for value in metrics.values())
    records = written(trajectories, tmp_path)
    assert records[BAD]["turns"][1]["reward_errors"] == bad.reward_errors


@pytest.mark.parametrize("turn", [0, 2])
@pytest.mark.parametrize("tokens", [True, False], ids=["tokens", "text policy"])
def test_a_huge_text_observation_errs_only_its_episode(tiny_tokenizer, tmp_path, turn, tokens):
    """A megabyte of text was a context-budget truncation (after a second of tokenizing) for a token policy, and
    for a text policy (an HTTP endpoint) sent on and written again every turn."""
    slots = batch("huge text", turn)
    trajectories = (play_tokens(tiny_tokenizer, slots) if tokens else
                    play(TextPolicy(answer("Left")), slots, max_turns=MAX_TURNS))
    check_only_the_bad_episode_errs(trajectories, tmp_path, f"may hold {MAX_TEXT_LENGTH} characters, got 1000000",
                                    turn)
    assert (tmp_path / "step.jsonl").stat().st_size < 100_000


def check_env_says(env: Misbehaves) -> str:
    """What ``check_env`` says first of ``env``'s fault at reset, without the calls it was seen at."""
    with pytest.raises(EnvCheckError) as info:
        check_env(env)
    return info.value.failures[0].split(" (at reset(")[0]


@pytest.mark.parametrize("turn", [0, 2])
@pytest.mark.parametrize("fault", ["9,000 characters", "lone surrogate"])
def test_a_text_check_env_refuses_errs_only_its_episode_in_the_same_words(tiny_tokenizer, tmp_path, fault, turn):
    """A lone surrogate went on to the tokenizer, which cannot encode it: what check_env refuses, the rollout refuses
    too, with its words."""
    says = check_env_says(Misbehaves(fault, turn=0))
    assert says.startswith("an observation's text may hold ")
    trajectories = play_tokens(tiny_tokenizer, batch(fault, turn))
    check_only_the_bad_episode_errs(trajectories, tmp_path, f"ValueError: {says}", turn)


def test_text_from_around_the_world_is_played(tiny_tokenizer, tmp_path):
    trajectories = play_tokens(tiny_tokenizer, batch("world text", 0))
    assert [t.status for t in trajectories] == [TRUNCATED] * 3 and trajectories[BAD].error is None
    assert len(trajectories[BAD].turns) == MAX_TURNS and trajectories[BAD].trainable
    assert "café 日本 ⬛" in written(trajectories, tmp_path)[BAD]["turns"][0]["prompt"]


def test_a_reset_that_returns_the_observation_alone_errs_only_its_episode_as_check_env_says(tiny_tokenizer,
                                                                                             tmp_path):
    """The episode ended with "not enough values to unpack (expected 2, got 1)"."""
    says = check_env_says(Misbehaves("bare observation", turn=0))
    assert says.startswith("reset() must return (observation, info), got a dict: {'text': ")
    trajectories = play_tokens(tiny_tokenizer, batch("bare observation", 0))
    check_only_the_bad_episode_errs(trajectories, tmp_path, "env reset failed in turn 1: TypeError: reset() must "
                                                            "return (observation, info), got a dict: {'text': ", 0)


def test_a_step_both_terminated_and_truncated_is_the_task_ending(tiny_tokenizer, tmp_path):
    """Gymnasium allows both (a time limit reached on the winning step): the task ended, so the episode is done."""
    trajectories = play_tokens(tiny_tokenizer, batch("both flags", 2))
    bad = trajectories[BAD]
    assert bad.status == DONE and bad.truncation_reason is None and bad.error is None and len(bad.turns) == 2
    assert rollout_metrics(trajectories)["errors"] == 0.0
    assert [record["status"] for record in written(trajectories, tmp_path)] == [TRUNCATED, DONE, TRUNCATED]


def test_an_info_that_json_cannot_write_is_read_not_written(tiny_tokenizer, tmp_path):
    """The rollout reads the info's known keys as plain values; the rest never reaches the record."""
    trajectories = play_tokens(tiny_tokenizer, batch("unserializable info", 1))
    assert [t.status for t in trajectories] == [TRUNCATED] * 3
    assert trajectories[BAD].env_metrics == {"steps": 1.0}
    records = written(trajectories, tmp_path)
    assert records[BAD]["env_metrics"] == {"steps": 1.0} and "handle" not in json.dumps(records)


def test_with_the_tiny_model_sampling_an_env_that_fails_at_reset_errs_only_its_episode(tiny_policy, tmp_path):
    """The same batch with the tiny model itself answering (random weights: its answers step nothing)."""
    agent = AgentConfig(format="no_think", max_turns=MAX_TURNS)
    rollout = Rollout(tiny_policy, get_format("no_think"), agent, "Corridor")
    trajectories = rollout.run(batch("raises", turn=0), SamplingConfig(max_new_tokens=4))
    check_only_the_bad_episode_errs(trajectories, tmp_path, "the simulator crashed", turn=0)


# --------------------------------------------------------------------------- image mode, the tiny VLM's processor
class ImageCorridor(Corridor):
    """The corridor in an image mode: an 8x8 picture of the position."""

    def observation(self):
        return {**super().observation(), "image": np.full((8, 8, 3), self.position, dtype=np.uint8)}


class PaintsBadly(Misbehaves, ImageCorridor):
    """The corridor in an image mode; at the step of turn ``turn`` (or at reset for 0) its image is ``bad``."""

    def __init__(self, bad: np.ndarray, turn: int) -> None:
        super().__init__("bad image", turn)
        self.bad = bad

    def spoiled(self, obs):
        return {**obs, "image": self.bad}


class SeesAndSaysLeft(Policy):
    """Answers ``Left`` in the tiny VLM's tokens; takes images through its processor."""

    def __init__(self, processor: Any) -> None:
        self.tokenizer = processor.tokenizer
        self.image_encoder = ImageEncoder(processor)

    def generate(self, requests, sampling):
        ids = self.tokenizer.encode("<answer>Left</answer>", add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return [Completion(text="<answer>Left</answer>", token_ids=ids, logprobs=[-0.5] * len(ids)) for _ in requests]


@pytest.fixture(scope="module")
def vlm_processor(tiny_vlm_dir):
    return load_processor(tiny_vlm_dir)


@pytest.mark.parametrize("turn", [0, 2])
@pytest.mark.parametrize("image", [
    np.zeros((8, 8, 3), dtype=np.float64),
    np.zeros((8, 8), dtype=np.uint8),
    np.zeros((8, 8, 4), dtype=np.uint8),
    np.zeros((0, 8, 3), dtype=np.uint8),
    np.zeros((8, 8, 3), dtype=np.int64) - 5,
    [[[0, 0, 0]]],
], ids=["float64", "grey", "rgba", "empty", "negative ints", "nested list"])
def test_an_image_of_the_wrong_shape_or_dtype_errs_only_its_episode(vlm_processor, tmp_path, image, turn):
    envs = [ImageCorridor(length=50), PaintsBadly(image, turn), ImageCorridor(length=50)]
    slots = [EpisodeSlot(env=env, seed=k, group=k) for k, env in enumerate(envs)]
    agent = AgentConfig(format="no_think", max_turns=MAX_TURNS, max_actions_per_episode=20)
    trajectories = Rollout(SeesAndSaysLeft(vlm_processor), get_format("no_think"), agent, "mixed").run(
        slots, SamplingConfig(max_new_tokens=8))
    check_only_the_bad_episode_errs(trajectories, tmp_path, "image", turn)
    assert all(image.dtype == np.uint8 and image.ndim == 3 for t in trajectories for image in t.images)
