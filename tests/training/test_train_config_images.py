"""TrainConfig's ``agent.max_images`` check against what a rollout does: a whole-episode sample is refused
exactly when some prompt of the episode leaves an image out."""

from __future__ import annotations

import pytest

from turnrl.agent.formats import get_format
from turnrl.config import ConfigError, SamplingConfig, load_config
from turnrl.envs import make
from turnrl.models.loading import load_processor
from turnrl.models.vision import ImageEncoder
from turnrl.policy.interface import Completion, Policy
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.train_config import TrainConfig


class WalkUp(Policy):
    """A VLM that answers ``up`` every turn (the maze's walls keep the episode going to its last turn)."""

    def __init__(self, processor) -> None:
        self.tokenizer = processor.tokenizer
        self.image_encoder = ImageEncoder(processor)

    def generate(self, requests, sampling):
        text = "<answer>up</answer>"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return [Completion(text=text, token_ids=ids, logprobs=[-0.5] * len(ids)) for _ in requests]


def accepted(max_turns: int, max_images: int) -> bool:
    try:
        load_config(TrainConfig, None, [f"agent.max_turns={max_turns}", f"agent.max_images={max_images}"])
    except ConfigError as error:
        assert "algorithm.sample_mode=turn" in str(error) and f"agent.max_turns={max_turns}" in str(error)
        return False
    return True


def played(policy: Policy, max_turns: int, max_images: int) -> Trajectory:
    config = load_config(TrainConfig, None, [f"agent.max_turns={max_turns}", f"agent.max_images={max_images}",
                                             "agent.format=no_think", "algorithm.sample_mode=turn"]).agent
    rollout = Rollout(policy, get_format("no_think"), config, "Maze2D")
    (trajectory,) = rollout.run([EpisodeSlot(env=make("Maze2D", mode="image"), seed=0, group=0)],
                                SamplingConfig(max_new_tokens=12))
    return trajectory


@pytest.mark.parametrize("max_turns", [1, 3])
def test_max_images_is_refused_exactly_when_a_prompt_drops_an_image(tiny_vlm_dir, max_turns):
    policy = WalkUp(load_processor(tiny_vlm_dir))
    for max_images in (max_turns - 1, max_turns):
        trajectory = played(policy, max_turns, max_images)
        assert len(trajectory.turns) == len(trajectory.images) == max_turns  # one image an observation
        assert trajectory.tokens is not None
        assert accepted(max_turns, max_images) == (not trajectory.tokens.window_cut)
