"""Trajectories to training tensors: token-exact samples, turn ends and rewards aligned, right padding."""

from __future__ import annotations

import itertools

import pytest
import torch

from turnrl.agent.formats import ParsedResponse, get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs.contract import StepOutcome, TurnEnv
from turnrl.models.loading import load_processor
from turnrl.models.vision import content_digest
from turnrl.policy.interface import Completion, Policy
from turnrl.rollout.context import EpisodeTokens
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import Trajectory, TurnRecord
from turnrl.training.batch import Sample, collate, trajectory_samples, turn_samples
from turnrl.training.image_features import IMAGE_KEYS


# --------------------------------------------------------------------------- drivers
class StairsEnv(TurnEnv):
    """``up`` pays the new height (1, 2, 3, ...), so every turn has its own reward; ``stop`` ends the episode."""

    description = "stairs for tests"

    def _reset(self, rng, options):
        self.height = 0

    def _step(self, action):
        if action == "stop":
            return StepOutcome(0.5, terminated=True, success=True)
        self.height += 1
        return StepOutcome(float(self.height))

    def text(self):
        return f"height {self.height}"

    def instructions(self):
        return "Climb with up, end with stop."

    def action_names(self):
        return ["up", "stop"]


# Responses of different lengths; one has no action (penalty), one is cut before its end-of-turn token.
RESPONSES = ["<answer>up</answer>", "let me think <answer>up</answer>", "no idea", "<answer>up</answer>"]


class ScriptedTokenPolicy(Policy):
    """Samples the ids of scripted texts, each with a distinct logprob; records the prompts it was given.

    Episode ``k`` plays ``RESPONSES`` rotated by ``k``; a response whose text starts with ``"let"`` is returned
    without its end-of-turn token (cut at the token limit).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: dict[int, list[list[int]]] = {}
        self._logprob = itertools.count(1)

    def generate(self, requests, sampling):
        out = []
        for request in requests:
            key = id(request.env)
            prompts = self.prompts.setdefault(key, [])
            turn = len(prompts)
            prompts.append(list(request.prompt_ids))
            text = RESPONSES[(turn + request.env.offset) % len(RESPONSES)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            cut = text.startswith("let")
            if not cut:
                ids.append(self.tokenizer.eos_token_id)
            logprobs = [-next(self._logprob) / 1000 for _ in ids]
            finish = "length" if cut else "stop"
            out.append(Completion(text=text, token_ids=ids, logprobs=logprobs, finish_reason=finish))
        return out


def play(tokenizer, n_episodes=3, max_turns=3, window=None):
    policy = ScriptedTokenPolicy(tokenizer)
    envs = [StairsEnv() for _ in range(n_episodes)]
    for k, env in enumerate(envs):
        env.offset = k
    slots = [EpisodeSlot(env=env, seed=k, group=k // 2, sample=k % 2) for k, env in enumerate(envs)]
    agent = AgentConfig(format="no_think", max_turns=max_turns, max_context_window=window)
    rollout = Rollout(policy, get_format("no_think"), agent, env_id="Stairs")
    trajectories = rollout.run(slots, SamplingConfig(max_new_tokens=32))
    prompts = [policy.prompts[id(env)] for env in envs]
    return trajectories, prompts


@pytest.fixture(scope="module")
def played(tiny_tokenizer):
    return play(tiny_tokenizer)


# --------------------------------------------------------------------------- trajectory samples
def test_trajectory_samples_are_the_sampled_ids_in_the_prompts_the_policy_saw(played):
    trajectories, prompts = played
    assert {len(t.turns) for t in trajectories} == {3}
    samples = trajectory_samples(trajectories, [7, 8, 9])
    for sample, trajectory, seen in zip(samples, trajectories, prompts):
        assert len(sample.turn_ends) == len(trajectory.turns) == len(seen)
        for turn, end, prompt in zip(trajectory.turns, sample.turn_ends, seen):
            start = end - len(turn.response_ids) + 1
            assert sample.input_ids[:start] == prompt  # what the policy was conditioned on
            assert sample.input_ids[start : end + 1] == turn.response_ids
            assert sample.sampler_logprobs[start : end + 1] == turn.response_logprobs


def test_trajectory_loss_mask_is_exactly_the_sampled_tokens(played):
    trajectories, _ = played
    for sample, trajectory in zip(trajectory_samples(trajectories, [0, 1, 2]), trajectories):
        n = len(sample.input_ids)
        assert len(sample.loss_mask) == len(sample.sampler_logprobs) == n
        sampled = [i for i in range(n) if sample.loss_mask[i]]
        spans = [range(end - len(t.response_ids) + 1, end + 1) for t, end in zip(trajectory.turns, sample.turn_ends)]
        assert sampled == [i for span in spans for i in span]
        assert [sample.input_ids[i] for i in sampled] == [i for t in trajectory.turns for i in t.response_ids]
        assert all(sample.sampler_logprobs[i] == 0.0 for i in range(n) if not sample.loss_mask[i])
        assert all(sample.sampler_logprobs[i] < 0 for i in sampled)


def test_trajectory_turn_ends_and_rewards_are_aligned(played):
    trajectories, _ = played
    for sample, trajectory in zip(trajectory_samples(trajectories, [0, 1, 2]), trajectories):
        assert sample.turn_ends == sorted(sample.turn_ends)
        for end, turn in zip(sample.turn_ends, trajectory.turns):
            assert sample.input_ids[end] == turn.response_ids[-1] and sample.loss_mask[end] == 1
            assert end + 1 == len(sample.input_ids) or sample.loss_mask[end + 1] == 0
        assert sample.turn_rewards == [turn.reward for turn in trajectory.turns]
    # the rewards really differ per turn (up pays the height, no action pays the penalty)
    assert len({r for t in trajectories for r in (turn.reward for turn in t.turns)}) >= 3


def test_trajectory_stream_is_cut_after_the_last_sampled_token(played):
    trajectories, _ = played
    for sample, trajectory in zip(trajectory_samples(trajectories, [0, 1, 2]), trajectories):
        stream = trajectory.tokens.stream()
        assert sample.input_ids[-1] == trajectory.turns[-1].response_ids[-1]
        assert sample.turn_ends[-1] == len(sample.input_ids) - 1
        assert stream.input_ids[: len(sample.input_ids)] == sample.input_ids
        assert stream.input_ids[len(sample.input_ids) :] == trajectory.tokens.turns[-1].closing_ids


def test_trajectory_sample_ids_group_and_turn(played):
    trajectories, _ = played
    samples = trajectory_samples(trajectories, [4, 5, 6])
    assert [s.episode for s in samples] == [4, 5, 6]
    assert [s.group for s in samples] == [t.group for t in trajectories] == [0, 0, 1]
    assert {s.turn for s in samples} == {-1}


def test_a_response_cut_at_the_token_limit_keeps_only_its_sampled_ids(played):
    trajectories, _ = played
    cut = [(t, k) for t in trajectories for k, turn in enumerate(t.turns) if turn.finish_reason == "length"]
    assert cut, "the scripted policy cuts one response per episode"
    for trajectory, k in cut:
        sample = trajectory_samples([trajectory], [0])[0]
        end = sample.turn_ends[k]
        assert sample.input_ids[end] == trajectory.turns[k].response_ids[-1]
        closing = trajectory.tokens.turns[k].closing_ids
        if k + 1 < len(trajectory.turns):  # the template's closing follows, unmasked
            assert sample.input_ids[end + 1 : end + 1 + len(closing)] == closing
            assert sample.loss_mask[end + 1 : end + 1 + len(closing)] == [0] * len(closing)


def test_trajectory_samples_carry_the_start_state_of_each_turn(played):
    trajectories, _ = played
    for sample, trajectory in zip(trajectory_samples(trajectories, [0, 1, 2]), trajectories):
        assert sample.turn_state_keys == [turn.state_key for turn in trajectory.turns]
    assert len({turn.state_key for t in trajectories for turn in t.turns} - {None}) > 1  # states the env tells apart


# --------------------------------------------------------------------------- turn samples
@pytest.mark.parametrize("window", [None, 1, 2])
def test_turn_samples_are_the_windowed_prompts_plus_responses(tiny_tokenizer, window):
    trajectories, prompts = play(tiny_tokenizer, max_turns=4, window=window)
    samples = turn_samples(trajectories, [10, 11, 12])
    expected = [(e, t, s) for e, t in zip([10, 11, 12], trajectories) for s in t.tokens.turn_samples()]
    assert len(samples) == len(expected) == sum(len(t.turns) for t in trajectories)
    seen = [p for per_episode in prompts for p in per_episode]
    for sample, (episode, trajectory, ts), prompt in zip(samples, expected, seen):
        assert ts.prompt_ids == prompt  # the windowed prompt the policy was given
        assert sample.input_ids == ts.prompt_ids + ts.response_ids
        assert sample.loss_mask == [0] * len(ts.prompt_ids) + [1] * len(ts.response_ids)
        assert sample.sampler_logprobs == [0.0] * len(ts.prompt_ids) + ts.logprobs
        assert sample.turn_ends == [len(sample.input_ids) - 1]
        assert sample.turn_rewards == [trajectory.turns[ts.turn].reward]
        assert (sample.episode, sample.group, sample.turn) == (episode, trajectory.group, ts.turn)
    if window == 1:  # a window of one turn: every prompt is the head of its own observation
        last = [s for s in samples if s.turn == 3]
        full = play(tiny_tokenizer, max_turns=4)[0]
        assert all(len(s.input_ids) < len(f.tokens.turn_samples()[3].prompt_ids) for s, f in zip(last, full))


# --------------------------------------------------------------------------- collate
def make_samples() -> list[Sample]:
    return [
        Sample([5, 6, 7, 8, 9], [0, 1, 1, 0, 1], [0.0, -0.1, -0.2, 0.0, -0.3], [2, 4], [1.0, 2.0], episode=0, group=0),
        Sample([3, 4], [0, 1], [0.0, -0.5], [1], [-1.0], episode=1, group=0, turn=2),
        Sample([1, 2, 3, 4, 5, 6, 7], [0, 0, 1, 0, 1, 1, 1], [0.0, 0.0, -1.0, 0.0, -2.0, -3.0, -4.0], [2, 4, 6],
               [0.5, 0.0, 3.0], episode=2, group=1),
    ]


def test_collate_pads_on_the_right_and_keeps_every_field():
    samples = make_samples()
    batch = collate(samples, pad_id=99)
    assert batch.input_ids.shape == (3, 7) and batch.turn_end_index.shape == (3, 3) and len(batch) == 3
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        assert batch.input_ids[row].tolist() == s.input_ids + [99] * (7 - n)
        assert batch.attention_mask[row].tolist() == [1] * n + [0] * (7 - n)
        assert batch.loss_mask[row].tolist() == s.loss_mask + [0] * (7 - n)
        assert torch.allclose(batch.sampler_logprobs[row], torch.tensor(s.sampler_logprobs + [0.0] * (7 - n)))
        t = len(s.turn_ends)
        assert batch.turn_end_index[row].tolist() == s.turn_ends + [-1] * (3 - t)
        assert batch.turn_rewards[row].tolist() == s.turn_rewards + [0.0] * (3 - t)
    assert batch.episode.tolist() == [0, 1, 2] and batch.group.tolist() == [0, 0, 1]
    assert batch.turn.tolist() == [-1, 2, -1]
    assert batch.loss_mask.dtype == torch.float32 and batch.input_ids.dtype == torch.long


def test_turn_end_mask_is_true_exactly_at_turn_ends():
    batch = collate(make_samples(), pad_id=0)
    expected = torch.zeros(3, 7, dtype=torch.bool)
    for row, s in enumerate(make_samples()):
        expected[row, s.turn_ends] = True
    assert torch.equal(batch.turn_end_mask, expected)


def test_turn_end_mask_marks_a_turn_that_ends_at_column_0():
    """Only -1 marks a padding turn: a one-token response at the very start still ends a turn."""
    batch = collate([Sample([5, 6, 7], [1, 0, 1], [-0.1, 0.0, -0.2], [0, 2], [1.0, 2.0], episode=0, group=0)], 0)
    assert batch.turn_end_mask.tolist() == [[True, False, True]]


def test_collate_numbers_turn_states_in_order_of_first_sight_and_minus_one_where_unknown():
    samples = make_samples()
    samples[0].turn_state_keys = ["x", "y"]
    samples[2].turn_state_keys = ["y", None, "x"]  # samples[1] knows no state
    assert collate(samples, pad_id=0).turn_states.tolist() == [[0, 1, -1], [-1, -1, -1], [1, -1, 0]]
    assert collate(make_samples(), pad_id=0).turn_states is None


def test_select_and_to_keep_rows_aligned():
    samples = make_samples()
    batch = collate(samples, pad_id=0)
    for index in ([2, 0], torch.tensor([2, 0])):
        part = batch.select(index)
        alone = [collate([samples[i]], pad_id=0) for i in (2, 0)]
        for row, single in enumerate(alone):
            width = single.input_ids.shape[1]
            for name in ("input_ids", "attention_mask", "loss_mask", "sampler_logprobs"):
                assert torch.equal(getattr(part, name)[row, :width], getattr(single, name)[0]), name
            assert part.turn_end_mask[row, :width].tolist() == single.turn_end_mask[0].tolist()
        assert part.episode.tolist() == [2, 0] and part.group.tolist() == [1, 0]
        assert torch.equal(part.turn_rewards[1, :2], torch.tensor([1.0, 2.0]))
    moved = batch.to(torch.device("cpu"))
    assert all(torch.equal(getattr(moved, k), v) for k, v in vars(batch).items() if isinstance(v, torch.Tensor))


def test_collating_nothing_is_an_error():
    with pytest.raises(ValueError, match="empty"):
        collate([], pad_id=0)


def test_collated_trajectory_samples_mark_sampled_tokens_only(played, tiny_tokenizer):
    trajectories, _ = played
    samples = trajectory_samples(trajectories, [0, 1, 2])
    batch = collate(samples, tiny_tokenizer.pad_token_id)
    assert batch.loss_mask.sum() == sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
    assert bool((batch.loss_mask <= batch.attention_mask).all())
    ends = batch.turn_end_mask
    assert ends.sum() == sum(len(t.turns) for t in trajectories)
    assert bool((batch.loss_mask[ends] == 1).all())
    rewards = torch.zeros_like(batch.loss_mask)
    rewards[ends] = torch.tensor([r for s in samples for r in s.turn_rewards])
    assert torch.equal(rewards.sum(1), torch.tensor([t.total_reward for t in trajectories], dtype=torch.float32))


# --------------------------------------------------------------------------- extra model inputs
def image_samples() -> list[Sample]:
    """Samples with 1, 0 and 2 images: pixel rows per image 4, a (t, h, w) grid per image."""
    samples = make_samples()
    images = [1, 0, 2]
    for index, (sample, n) in enumerate(zip(samples, images)):
        sample.model_inputs = {
            "pixel_values": torch.full((4 * n, 3), float(index)),
            "image_grid_thw": torch.tensor([[1, 2, 2]] * n, dtype=torch.long).reshape(n, 3),
        }
    return samples


def test_collate_concatenates_extra_model_inputs_in_row_order():
    batch = collate(image_samples(), pad_id=0)
    assert batch.model_inputs["pixel_values"].shape == (12, 3)
    assert batch.model_inputs["pixel_values"][:, 0].tolist() == [0.0] * 4 + [2.0] * 8
    assert batch.model_inputs["image_grid_thw"].shape == (3, 3)
    assert batch.model_input_rows["pixel_values"].tolist() == [4, 0, 8]
    assert batch.model_input_rows["image_grid_thw"].tolist() == [1, 0, 2]


def test_select_keeps_each_samples_model_inputs():
    batch = collate(image_samples(), pad_id=0)
    part = batch.select([2, 0])
    assert part.model_inputs["pixel_values"][:, 0].tolist() == [2.0] * 8 + [0.0] * 4
    assert part.model_input_rows["pixel_values"].tolist() == [8, 4]
    assert part.model_inputs["image_grid_thw"].shape == (3, 3)
    alone = batch.select([1])
    assert alone.model_inputs["pixel_values"].shape == (0, 3) and alone.model_input_rows["pixel_values"].tolist() == [0]
    moved = part.to(torch.device("cpu"))
    assert torch.equal(moved.model_inputs["pixel_values"], part.model_inputs["pixel_values"])


def test_selecting_no_samples_gives_no_rows_of_any_model_input():
    part = collate(image_samples(), pad_id=0).select([])
    assert len(part) == 0 and part.model_input_rows["pixel_values"].tolist() == []
    assert part.model_inputs["pixel_values"].shape == (0, 3) and part.model_inputs["image_grid_thw"].shape == (0, 3)


def test_a_batch_on_a_device_keeps_its_pixels_on_the_host_and_selects_across_both():
    """The pixel values (most of a visual batch's bytes) wait on the host for the micro-batch's forward pass."""
    placed = collate(image_samples(), pad_id=0).to(torch.device("meta"))
    assert placed.input_ids.device.type == "meta" and placed.model_inputs["pixel_values"].device.type == "cpu"
    part = placed.select([2, 0])
    assert part.input_ids.device.type == "meta"
    assert part.model_inputs["pixel_values"][:, 0].tolist() == [2.0] * 8 + [0.0] * 4


def test_a_sample_without_model_inputs_has_none_of_their_rows():
    """A text-only chat or turn in a VLM's batch carries no model inputs at all (the sample builders give it none):
    it has zero rows of each, of the others' shapes and dtypes, and does not turn the images' names off."""
    samples = image_samples()
    samples[0].model_inputs["image_keys"] = torch.tensor([7])
    samples[2].model_inputs["image_keys"] = torch.tensor([8, 9])
    samples[1].model_inputs = {}
    batch = collate(samples, pad_id=0)
    assert batch.model_input_rows["pixel_values"].tolist() == [4, 0, 8]
    assert batch.model_input_rows["image_grid_thw"].tolist() == [1, 0, 2]
    assert batch.model_inputs["image_keys"].tolist() == [7, 8, 9]
    assert batch.model_inputs["image_grid_thw"].dtype == torch.long
    assert collate([samples[1]], pad_id=0).model_inputs == {}


def test_collate_refuses_samples_with_different_model_inputs():
    samples = image_samples()
    del samples[1].model_inputs["image_grid_thw"]
    with pytest.raises(ValueError, match="image_grid_thw"):
        collate(samples, pad_id=0)


def test_a_sample_without_model_inputs_gets_empty_rows_of_the_others_shape_whatever_its_rank():
    samples = make_samples()
    samples[0].model_inputs = {"pixel_values": torch.ones(2, 3, 4)}
    samples[2].model_inputs = {"pixel_values": torch.zeros(1, 3, 4)}
    batch = collate(samples, pad_id=0)
    assert batch.model_inputs["pixel_values"].shape == (3, 3, 4)
    assert batch.model_input_rows["pixel_values"].tolist() == [2, 0, 1]


# --------------------------------------------------------------------------- images named by their digests
def test_samples_name_their_images_by_the_digests_of_the_images_they_hold(tiny_vlm_dir):
    """A whole episode's sample names the images of its answered turns, a turn sample those of its prompt, in
    order: the keys under which the rollout's image features are found again."""
    from tests.rollout.test_images import ScriptedVLM
    from tests.rollout.test_images import play as play_images

    trajectories = play_images(ScriptedVLM(load_processor(tiny_vlm_dir)), n_episodes=2, max_turns=3)
    digests = [[content_digest([image]) for image in t.images[: len(t.turns)]] for t in trajectories]
    assert all(len(named) == 3 for named in digests)
    for sample, named in zip(trajectory_samples(trajectories, [0, 1]), digests):
        assert sample.model_inputs[IMAGE_KEYS].tolist() == named
    for sample in turn_samples(trajectories, [0, 1]):
        assert sample.model_inputs[IMAGE_KEYS].tolist() == digests[sample.episode][: sample.turn + 1]


def test_a_text_episodes_samples_carry_no_model_inputs(played):
    trajectories, _ = played
    for samples in (trajectory_samples(trajectories, [0, 1, 2]), turn_samples(trajectories, [0, 1, 2])):
        assert all(sample.model_inputs == {} for sample in samples)


def two_turn_episode(tiny_vlm_dir, second_counts: list[int], second_digests: list[int]) -> Trajectory:
    """An episode of two answered turns whose first observation shows an image of digest -3."""
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "where now?"}]}
    tokens = EpisodeTokens(load_processor(tiny_vlm_dir).tokenizer, image_token="<|image_pad|>")
    tokens.start("system", user, [4], {}, [-3])
    tokens.add_response([5])
    second = user if second_counts else {"role": "user", "content": "and now?"}
    tokens.add_observation(second, second_counts, {}, second_digests)
    tokens.add_response([6])
    turns = [TurnRecord(index=k, observation="o", response="r", response_ids=[5 + k], response_logprobs=[-0.1],
                        finish_reason="stop", parsed=ParsedResponse((), {}, True)) for k in range(2)]
    return Trajectory(env_id="Maze2D", seed=0, group=0, sample=0, turns=turns, tokens=tokens)


def test_an_episode_names_its_images_only_where_every_image_has_a_digest(tiny_vlm_dir):
    """An image without a digest (counted, not hashed, as SFT counts images) leaves the batch to name the images
    by their place; an observation without images needs none."""
    (undigested,) = trajectory_samples([two_turn_episode(tiny_vlm_dir, [4], [])], [0])
    assert IMAGE_KEYS not in undigested.model_inputs
    (text_after,) = trajectory_samples([two_turn_episode(tiny_vlm_dir, [], [])], [0])
    assert text_after.model_inputs[IMAGE_KEYS].tolist() == [-3]
