"""From trajectories to padded training tensors.

Notation: b samples, s padded sequence length, t turns per sample (padded).

Two sample modes:

- ``trajectory`` (StarPO): one sample per episode, its whole token stream;
  each turn's reward sits at that turn's last sampled token.
- ``turn``: one sample per turn, the prompt the response was sampled from plus
  the response; valid with any context window.

Either way the tokens are the sampled ones (token-exact) and ``loss_mask`` is 1
exactly on sampled tokens.

Extra model inputs (a VLM's ``pixel_values`` and ``image_grid_thw``, say)
travel with their samples: each is a tensor whose first dimension runs over
the sample's items (image patches, images), concatenated over the samples of
a batch in row order, the layout Qwen-VL style models take. Every forward
pass of training passes them to the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from turnrl.models.devices import to_device
from turnrl.rollout.context import EpisodeTokens
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.image_features import IMAGE_KEYS, ImageFeatures


@dataclass
class Sample:
    """One training sequence (lists, before padding)."""

    input_ids: list[int]
    loss_mask: list[int]
    """1 on sampled tokens."""
    sampler_logprobs: list[float]
    """Sampling logprob of each sampled token, 0 elsewhere."""
    turn_ends: list[int]
    """Position of each turn's last sampled token, in turn order."""
    turn_rewards: list[float]
    """Reward of each turn in ``turn_ends``."""
    episode: int
    """Index of the trajectory in the rollout batch."""
    group: int
    """Group of the trajectory."""
    turn: int = -1
    """Turn number (turn mode); -1 for whole trajectories."""
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra inputs of the model for this sequence (e.g. ``pixel_values``), each concatenated along dim 0."""
    turn_state_keys: list[str | None] = field(default_factory=list)
    """The env state each turn in ``turn_ends`` started from (GiGPO); empty when unknown."""


@dataclass
class Batch:
    """Padded tensors of a list of samples (right padding)."""

    input_ids: torch.Tensor
    """Shape (b, s), long."""
    attention_mask: torch.Tensor
    """Shape (b, s), long."""
    loss_mask: torch.Tensor
    """Shape (b, s), float: 1 on sampled tokens."""
    sampler_logprobs: torch.Tensor
    """Shape (b, s), float."""
    turn_end_index: torch.Tensor
    """Shape (b, t), long: position of each turn's last sampled token, -1 for padding turns."""
    turn_rewards: torch.Tensor
    """Shape (b, t), float64: reward of each turn, 0 for padding turns. Double precision, so that episodes
    whose turns split the same total differently still have equal totals (GRPO compares them exactly)."""
    episode: torch.Tensor
    """Shape (b,), long."""
    group: torch.Tensor
    """Shape (b,), long."""
    turn: torch.Tensor
    """Shape (b,), long."""
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Extra model inputs, each the samples' tensors concatenated along dim 0 in row order."""
    model_input_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    """For each extra input, Shape (b,), long: how many of its dim-0 rows belong to each sample."""
    turn_states: torch.Tensor | None = None
    """Shape (b, t), long: an id of the env state each turn started from (equal ids for equal states in
    the batch), -1 for unknown or padding turns; None when no sample knows its states."""
    image_features: ImageFeatures | None = None
    """A frozen vision tower's features of the batch's images, encoded once and shared by every pass over
    the batch and its parts (see :mod:`~turnrl.training.image_features`); None encodes in every pass."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def turn_end_mask(self) -> torch.Tensor:
        """Shape (b, s), bool: True at each turn's last sampled token."""
        mask = torch.zeros_like(self.loss_mask, dtype=torch.bool)
        rows, turns = (self.turn_end_index >= 0).nonzero(as_tuple=True)
        mask[rows, self.turn_end_index[rows, turns]] = True
        return mask

    def to(self, device: torch.device) -> Batch:
        """The token tensors on ``device``; the extra model inputs stay where they are (a VLM's pixel values, the
        largest part of a visual batch: a forward pass moves its own micro-batch's,
        :func:`~turnrl.training.model_passes.states_before`)."""
        moved = {name: value.to(device) for name, value in vars(self).items() if isinstance(value, torch.Tensor)}
        return Batch(**moved, model_inputs=dict(self.model_inputs), model_input_rows=dict(self.model_input_rows),
                     image_features=self.image_features)

    def select(self, index: torch.Tensor | list[int]) -> Batch:
        """The samples at ``index``, in that order, with their extra model inputs."""
        index = torch.as_tensor(index, dtype=torch.long)
        placed: dict[torch.device, torch.Tensor] = {}  # the index copied once to each device it selects on

        def on(device: torch.device) -> torch.Tensor:
            if device not in placed:
                placed[device] = to_device(index, device)
            return placed[device]

        picked = {name: value[on(value.device)] for name, value in vars(self).items()
                  if isinstance(value, torch.Tensor)}
        inputs, rows = {}, {}
        for key, value in self.model_inputs.items():
            counts = self.model_input_rows[key]
            starts = counts.cumsum(0) - counts
            keep = [torch.arange(int(starts[i]), int(starts[i] + counts[i])) for i in index.tolist()]
            inputs[key] = value[to_device(torch.cat(keep), value.device)] if keep else value[:0]
            rows[key] = counts[index]
        return Batch(**picked, model_inputs=inputs, model_input_rows=rows, image_features=self.image_features)

    def with_image_features(self, rollout: Mapping[int, tuple[torch.Tensor, Sequence[torch.Tensor]]] | None = None
                            ) -> Batch:
        """This batch sharing one store of image features (a frozen tower's) among all its passes; its images
        named by their place in the batch where the samples carry no :data:`IMAGE_KEYS`. ``rollout``: features
        its rollout's engine computed, by digest, which the store starts with (:class:`ImageFeatures`)."""
        inputs, rows = dict(self.model_inputs), dict(self.model_input_rows)
        if IMAGE_KEYS not in inputs and "image_grid_thw" in inputs:
            inputs[IMAGE_KEYS] = torch.arange(len(inputs["image_grid_thw"]))
            rows[IMAGE_KEYS] = rows["image_grid_thw"]
        tensors = {name: value for name, value in vars(self).items() if isinstance(value, torch.Tensor)}
        return Batch(**tensors, model_inputs=inputs, model_input_rows=rows, image_features=ImageFeatures(rollout))


def trajectory_samples(trajectories: list[Trajectory], episode_ids: list[int]) -> list[Sample]:
    """One sample per trajectory: its whole stream, cut after the last sampled token."""
    samples = []
    for episode, trajectory in zip(episode_ids, trajectories):
        assert trajectory.tokens is not None
        stream = trajectory.tokens.stream()
        ends = stream.turn_end_positions[: len(trajectory.turns)]
        cut = ends[-1] + 1
        samples.append(
            Sample(
                input_ids=stream.input_ids[:cut],
                loss_mask=stream.loss_mask[:cut],
                sampler_logprobs=stream.logprobs[:cut],
                turn_ends=list(ends),
                turn_rewards=[turn.reward for turn in trajectory.turns[: len(ends)]],
                turn_state_keys=[turn.state_key for turn in trajectory.turns[: len(ends)]],
                episode=episode,
                group=trajectory.group,
                # The sample ends with the last response: an observation after it (the episode was cut
                # there) and its images are not part of it.
                model_inputs=keyed_inputs(trajectory.tokens, len(ends)),
            )
        )
    return samples


def keyed_inputs(tokens: EpisodeTokens, answered: int) -> dict[str, torch.Tensor]:
    """The model inputs of the episode's first ``answered`` turns (views of its buffers: the batch copies them
    once, into its own), with :data:`IMAGE_KEYS` (their images' digests) where every image has one."""
    turns = tokens.turns[:answered]
    inputs = tokens.turns_model_inputs(0, answered - 1)
    if any(turn.image_token_counts for turn in turns) and all(
            len(turn.image_digests) == len(turn.image_token_counts) for turn in turns):
        inputs[IMAGE_KEYS] = torch.tensor([digest for turn in turns for digest in turn.image_digests])
    return inputs


def prompt_inputs(tokens: EpisodeTokens, turn: int, model_inputs: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """A turn sample's model inputs, with :data:`IMAGE_KEYS` (its prompt's images' digests) where all are known."""
    digests = tokens.prompt_image_digests(turn)
    if not digests:
        return model_inputs
    return {**model_inputs, IMAGE_KEYS: torch.tensor(digests)}


def turn_samples(trajectories: list[Trajectory], episode_ids: list[int]) -> list[Sample]:
    """One sample per turn: the prompt it was sampled from plus the response."""
    samples = []
    for episode, trajectory in zip(episode_ids, trajectories):
        assert trajectory.tokens is not None
        for sample, turn in zip(trajectory.tokens.turn_samples(), trajectory.turns):
            prompt, response = sample.prompt_ids, sample.response_ids
            samples.append(
                Sample(
                    input_ids=prompt + response,
                    loss_mask=[0] * len(prompt) + [1] * len(response),
                    sampler_logprobs=[0.0] * len(prompt) + sample.logprobs,
                    turn_ends=[len(prompt) + len(response) - 1],
                    turn_rewards=[turn.reward],
                    turn_state_keys=[turn.state_key],
                    episode=episode,
                    group=trajectory.group,
                    turn=sample.turn,
                    model_inputs=prompt_inputs(trajectory.tokens, sample.turn, sample.model_inputs),
                )
            )
    return samples


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad samples into a :class:`Batch`."""
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    width = max(len(s.input_ids) for s in samples)
    turns = max(len(s.turn_ends) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    loss_mask = torch.zeros((b, width))
    logprobs = torch.zeros((b, width))
    turn_end_index = torch.full((b, turns), -1, dtype=torch.long)
    turn_rewards = torch.zeros((b, turns), dtype=torch.float64)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = torch.tensor(sample.input_ids)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.float)
        logprobs[row, :n] = torch.tensor(sample.sampler_logprobs, dtype=torch.float)
        turn_end_index[row, : len(sample.turn_ends)] = torch.tensor(sample.turn_ends)
        turn_rewards[row, : len(sample.turn_rewards)] = torch.tensor(sample.turn_rewards, dtype=torch.float64)
    turn_states = None
    if any(sample.turn_state_keys for sample in samples):
        ids: dict[str, int] = {}
        turn_states = torch.full((b, turns), -1, dtype=torch.long)
        for row, sample in enumerate(samples):
            for turn, key in enumerate(sample.turn_state_keys):
                if key is not None:
                    turn_states[row, turn] = ids.setdefault(key, len(ids))
    # A sample without model inputs (a text-only chat or turn in a VLM's batch) has none of their rows.
    inputs = [sample.model_inputs for sample in samples if sample.model_inputs]
    keys = sorted({key for given in inputs for key in given})
    if IMAGE_KEYS in keys and any(IMAGE_KEYS not in given for given in inputs):
        keys.remove(IMAGE_KEYS)  # names, not inputs: where some images have none, the batch names them by place
    no_rows: dict[str, torch.Tensor] = {}
    for key in keys:
        if any(key not in given for given in inputs):
            raise ValueError(
                f"model input {key!r} is missing from some samples: every sample must carry the same inputs"
            )
        like = inputs[0][key]
        no_rows[key] = like.new_empty((0, *like.shape[1:]))
    rows = [{key: sample.model_inputs.get(key, no_rows[key]) for key in keys} for sample in samples]
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        sampler_logprobs=logprobs,
        turn_end_index=turn_end_index,
        turn_rewards=turn_rewards,
        episode=torch.tensor([s.episode for s in samples]),
        group=torch.tensor([s.group for s in samples]),
        turn=torch.tensor([s.turn for s in samples]),
        model_inputs={key: torch.cat([given[key] for given in rows]) for key in keys},
        model_input_rows={key: torch.tensor([len(given[key]) for given in rows]) for key in keys},
        turn_states=turn_states,
    )
