"""The visual-turns benchmark plays observations as a rollout's groups do."""

from __future__ import annotations

from benchmarks.visual_turns import rollout_observations
from turnrl.models.vision import content_digest


def digests(observations) -> list[int]:
    return [content_digest([obs["image"]]) for obs in observations]


def test_a_settled_policy_plays_a_groups_episodes_alike_and_random_moves_part_them():
    settled = digests(rollout_observations(groups=2, group_size=4, turns=6, noise=0.0, seed=7))
    # Round by round: each round's frames come episode by episode, a group's four together and alike.
    first_round = settled[:8]
    assert first_round[:4] == [first_round[0]] * 4 and first_round[4:] == [first_round[4]] * 4
    assert first_round[0] != first_round[4]  # two groups, two levels
    assert len(set(settled)) * 4 == len(settled)  # every frame a group's episodes meet, they meet alike
    noisy = digests(rollout_observations(groups=2, group_size=4, turns=6, noise=1.0, seed=7))
    assert noisy[:8] == first_round and set(noisy) - set(settled)  # random moves reach states the solver skips
