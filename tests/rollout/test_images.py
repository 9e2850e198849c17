"""Image observations through a VLM's token context: token-exact against the processor's own render,
one placeholder per visual token, vision tokens never sampled, the latest images kept, no image cut."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, ModelConfig, SamplingConfig
from turnrl.engine.images import prompt_images
from turnrl.envs import make
from turnrl.models.loading import load_processor
from turnrl.chat.templates import QWEN3
from turnrl.models.vision import ImageEncoder, content_digest, encoded_bytes
from turnrl.policy.interface import Completion, Policy
from turnrl.policy.hf import HFPolicy
from turnrl.rollout.context import EpisodeTokens, concat_model_inputs
from turnrl.rollout.runner import EpisodeSlot, Rollout, message_images
from turnrl.training.batch import collate, trajectory_samples, turn_samples
from turnrl.training.sft import trajectory_messages

IMAGE_PAD = "<|image_pad|>"


class ScriptedVLM(Policy):
    """Answers with the canonical ids of a fixed text and records its requests; sees images."""

    def __init__(self, processor: Any, text: str = "<answer>Right</answer>") -> None:
        self.tokenizer = processor.tokenizer
        self.image_encoder = ImageEncoder(processor)
        self.text = text
        self.requests: list = []

    def generate(self, requests, sampling):
        self.requests.extend(requests)
        ids = self.tokenizer.encode(self.text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return [Completion(text=self.text, token_ids=ids, logprobs=[-0.5] * len(ids)) for _ in requests]


def play(policy, n_episodes: int = 2, max_turns: int = 3, env: str = "Maze2D", **agent: Any):
    config = AgentConfig(format="no_think", max_turns=max_turns, max_actions_per_episode=20, **agent)
    rollout = Rollout(policy, get_format("no_think"), config, env)
    slots = [EpisodeSlot(env=make(env, mode="image"), seed=s, group=s) for s in range(n_episodes)]
    return rollout.run(slots, SamplingConfig(max_new_tokens=12))


@pytest.fixture(scope="module")
def processor(tiny_vlm_dir):
    return load_processor(tiny_vlm_dir)


def processor_ids(processor, messages, add_generation_prompt: bool) -> list[int]:
    """The processor's own render of ``messages``, images expanded by the processor."""
    parts = [{**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]
    text = processor.apply_chat_template(parts, tokenize=False, add_generation_prompt=add_generation_prompt)
    return processor(text=[text], images=message_images(messages) or None, return_tensors="pt")["input_ids"][0].tolist()


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
def test_the_incremental_stream_equals_the_processors_render_of_the_multi_image_chat(processor, template):
    processor = copy.deepcopy(processor)
    if template == "qwen3":  # Qwen3-VL's style: ChatML with reasoning handling
        processor.tokenizer.chat_template = processor.chat_template = QWEN3
    policy = ScriptedVLM(processor, "<answer>Right</answer>" if template == "chatml" else "<answer>Down</answer>")
    trajectories = play(policy, max_turns=3)
    for trajectory in trajectories:
        assert len(trajectory.images) == len(trajectory.turns) >= 2  # a new image every turn
        messages = trajectory_messages(trajectory)
        # Every prompt the model was given is the processor's render of the chat so far.
        for sample in trajectory.tokens.turn_samples():
            upto = messages[: 2 + 2 * sample.turn]
            assert sample.prompt_ids == processor_ids(processor, upto, add_generation_prompt=True)
        stream = trajectory.tokens.stream()
        if template == "chatml":  # and so is the whole episode (Qwen3's re-render adds a think block to
            # the last answer that the model never saw: the stream keeps what it saw, see docs/context.md)
            assert stream.input_ids == processor_ids(processor, messages, add_generation_prompt=False)
        pads = stream.input_ids.count(policy.image_encoder.image_token_id)
        grids = stream.model_inputs["image_grid_thw"]
        assert pads == int(grids.prod(-1).sum()) // 4 and len(grids) == len(trajectory.images)


def placeholder_and_feature_counts(sample, pad_id: int) -> tuple[int, int]:
    """Placeholders in a training sample (or a turn's prompt) and the visual tokens of its images."""
    ids = sample.input_ids if hasattr(sample, "input_ids") else sample.prompt_ids
    grids = sample.model_inputs.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
    return ids.count(pad_id), int(grids.prod(-1).sum()) // 4


def test_every_sample_has_as_many_placeholders_as_image_features(processor):
    policy = ScriptedVLM(processor)
    trajectories = play(policy, n_episodes=3, max_turns=3)
    pad = policy.image_encoder.image_token_id
    for samples in (trajectory_samples(trajectories, [0, 1, 2]), turn_samples(trajectories, [0, 1, 2])):
        for sample in samples:
            placeholders, features = placeholder_and_feature_counts(sample, pad)
            assert placeholders == features > 0
    batch = collate(turn_samples(trajectories, [0, 1, 2]), pad_id=0)
    assert batch.model_input_rows["image_grid_thw"].sum() == len(batch.model_inputs["image_grid_thw"])
    for request in policy.requests:  # every prompt sent carried the features of its placeholders
        features = int(request.model_inputs["image_grid_thw"].prod(-1).sum()) // 4
        assert request.prompt_ids.count(pad) == features


def test_a_trajectory_sample_views_its_episodes_pixels_and_the_batch_copies_them_once(processor):
    """The whole-episode sample's inputs are the answered turns' inputs end to end, as the plain concatenation
    gives them, but as views of the episode's buffers; the batch's collation is their one copy."""
    trajectories = play(ScriptedVLM(processor), n_episodes=2, max_turns=3)
    for trajectory, sample in zip(trajectories, trajectory_samples(trajectories, [0, 1])):
        answered = [turn for turn in trajectory.tokens.turns if turn.response_ids is not None]
        plain = concat_model_inputs(answered)
        for key in ("pixel_values", "image_grid_thw"):
            assert torch.equal(sample.model_inputs[key], plain[key]) and sample.model_inputs[key]._is_view()
        stream = trajectory.tokens.stream().model_inputs["pixel_values"]
        assert stream._is_view() and torch.equal(stream, concat_model_inputs(trajectory.tokens.turns)["pixel_values"])
    samples = trajectory_samples(trajectories, [0, 1])
    batch = collate(samples, pad_id=0)
    assert torch.equal(batch.model_inputs["pixel_values"],
                       torch.cat([sample.model_inputs["pixel_values"] for sample in samples]))
    assert not batch.model_inputs["pixel_values"]._is_view()  # the batch's own: the episodes' buffers go with them


def test_the_latest_images_are_kept_and_older_observations_keep_their_text(processor):
    policy = ScriptedVLM(processor)
    (trajectory,) = play(policy, n_episodes=1, max_turns=4, max_images=2)
    pad = policy.image_encoder.image_token_id
    assert len(trajectory.images) == 4  # the record keeps every image the episode showed
    for sample in trajectory.tokens.turn_samples():
        placeholders, features = placeholder_and_feature_counts(sample, pad)
        assert placeholders == features == 16 * min(sample.turn + 1, 2)
    last = policy.requests[-1]
    assert len(message_images(last.messages)) == 2  # the HTTP view drops the same images
    assert "The image shows the current state." in processor.tokenizer.decode(last.prompt_ids)
    with pytest.raises(RuntimeError, match="stream"):
        trajectory.tokens.stream()


def test_every_request_carries_the_digests_of_the_images_in_its_prompt(processor):
    """A digest an image, hashed once from the image; a request's digests are those of the images its prompt
    holds, in order (the latest two here), and the engine takes them as the prompt's images."""
    policy = ScriptedVLM(processor)
    (trajectory,) = play(policy, n_episodes=1, max_turns=4, max_images=2)
    digests = [content_digest([image]) for image in trajectory.images]
    assert len(set(digests)) == len(digests) and all(d < 0 for d in digests)  # the maze's frames all differ
    pad = policy.image_encoder.image_token_id
    for turn, request in enumerate(policy.requests):
        assert request.image_digests == digests[max(0, turn - 1) : turn + 1]
        keys = prompt_images(request.prompt_ids, request.model_inputs, pad, 2, request.image_digests).keys
        assert sorted(set(k for k in keys if k < 0)) == sorted(request.image_digests)


def test_a_context_gives_digests_only_when_every_image_of_the_prompt_has_one(processor):
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "where now?"}]}
    tokens = EpisodeTokens(processor.tokenizer, image_token=IMAGE_PAD)
    with pytest.raises(ValueError, match="2 image digests for a message with 1 images"):
        tokens.start("system", user, [4], {}, [-1, -2])
    tokens.start("system", user, [4], {}, [-3])
    assert tokens.prompt_image_digests() == [-3]
    tokens.add_response([5])
    tokens.add_observation(user, [4], {})  # counted, not digested (as SFT counts images): the engine hashes
    assert tokens.prompt_image_digests() is None and tokens.prompt_image_digests(0) == [-3]


def test_an_images_digest_stands_for_its_content():
    image = np.random.default_rng(0).integers(0, 255, (30, 40, 3), dtype=np.uint8)
    changed = image.copy()
    changed[7, 9, 1] ^= 1
    digests = [content_digest([a]) for a in (image, image.copy(), changed, image.reshape(40, 30, 3))]
    assert digests[0] == digests[1] and len(set(digests[1:])) == 3 and max(digests) < 0


def test_a_context_budget_never_cuts_through_an_image(processor):
    policy = ScriptedVLM(processor)
    # prompts grow by about 67 tokens a turn from 300 (16 of them an image): a budget of 460 takes 3 turns
    trajectories = play(policy, n_episodes=2, max_turns=6, max_context_tokens=460)
    pad = policy.image_encoder.image_token_id
    assert all(t.truncation_reason == "context_budget" and len(t.turns) == 3 for t in trajectories)
    assert len(policy.requests) == 6
    for request in policy.requests:
        features = int(request.model_inputs["image_grid_thw"].prod(-1).sum()) // 4
        assert request.prompt_ids.count(pad) == features and len(request.prompt_ids) + 12 <= 460
    # the observation that did not fit is in no training sample, and neither is its image
    answered = [t for t in trajectories if t.trainable]
    assert answered
    ids = list(range(len(answered)))
    for samples in (trajectory_samples(answered, ids), turn_samples(answered, ids)):
        for sample in samples:
            placeholders, features = placeholder_and_feature_counts(sample, pad)
            assert placeholders == features > 0


def test_vision_tokens_are_never_sampled(tiny_vlm_dir):
    policy = HFPolicy.from_config(ModelConfig(device="cpu", dtype="float32"), str(tiny_vlm_dir))
    vision = policy.image_encoder.special_token_ids
    bias = torch.zeros(policy.model.get_output_embeddings().weight.shape[0])
    bias[vision] = 100.0  # the vision tokens are by far the likeliest next tokens at every step
    policy.model.get_output_embeddings().register_forward_hook(lambda module, inputs, output: output + bias)
    trajectories = play(policy, n_episodes=2, max_turns=2)
    sampled = [i for t in trajectories for turn in t.turns for i in turn.response_ids]
    assert sampled and not set(sampled) & set(vision)


def test_a_text_model_still_refuses_image_observations(tiny_policy):
    with pytest.raises(ValueError, match="text-only model"):
        play(tiny_policy, n_episodes=1, max_turns=1)


def test_a_vlm_rollout_runs_end_to_end(tiny_vlm_policy):
    trajectories = play(tiny_vlm_policy, n_episodes=2, max_turns=2)
    assert all(t.status != "error" for t in trajectories), [t.error for t in trajectories]
    for trajectory in trajectories:
        stream = trajectory.tokens.stream()
        assert len(stream.turn_end_positions) == len(trajectory.turns)
        assert np.isfinite(sum(sum(turn.response_logprobs) for turn in trajectory.turns))


def test_greedy_generation_equals_the_model_given_the_processors_own_inputs(tiny_vlm_dir, processor):
    from transformers import AutoModelForImageTextToText

    policy = HFPolicy.from_config(ModelConfig(device="cpu", dtype="float32"), str(tiny_vlm_dir))
    (trajectory,) = play(ScriptedVLM(processor), n_episodes=1, max_turns=2)
    messages = trajectory_messages(trajectory)[:4]  # system, user 0, assistant 0, user 1: turn 1's prompt
    parts = [{**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in m["content"]]}
             if isinstance(m["content"], list) else m for m in messages]
    text = processor.apply_chat_template(parts, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=message_images(messages), return_tensors="pt")  # mm_token_type_ids too
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir).eval()
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [torch.log_softmax(step[0], -1)[token].item() for step, token in zip(out.logits, expected)]
    request = policy_request(policy, trajectory.tokens.turn_samples()[1])
    (completion,) = policy.generate([request], SamplingConfig(temperature=0, max_new_tokens=8))
    assert request.prompt_ids == inputs["input_ids"][0].tolist()
    n = len(completion.token_ids)
    assert n and completion.token_ids == expected[:n]
    assert completion.logprobs == pytest.approx(logprobs[:n], abs=1e-4)  # the same positions, not just tokens


def policy_request(policy, sample):
    from turnrl.policy.interface import GenerationRequest

    return GenerationRequest(prompt_ids=sample.prompt_ids, messages=[], model_inputs=sample.model_inputs)


class Sliver:
    """An env whose frames are 5 x 2000 pixels: an aspect ratio Qwen-VL's processor refuses."""

    def reset(self, *, seed=None, options=None):
        return {"text": "look", "image": np.zeros((5, 2000, 3), dtype=np.uint8)}, {}

    def step(self, action):
        raise AssertionError("never stepped")

    def instructions(self):
        return "Look."

    def action_names(self):
        return ["Right"]

    def state_facts(self):
        from turnrl.envs import StateFacts

        return StateFacts(player=None)

    def solve(self):
        return None


def test_an_image_the_processor_refuses_ends_its_episode_not_the_run(processor):
    policy = ScriptedVLM(processor)
    config = AgentConfig(format="no_think", max_turns=2)
    rollout = Rollout(policy, get_format("no_think"), config, "mixed")
    slots = [EpisodeSlot(env=Sliver(), seed=0), EpisodeSlot(env=make("Maze2D", mode="image"), seed=0, group=1)]
    bad, good = rollout.run(slots, SamplingConfig(max_new_tokens=12))
    assert bad.status == "error" and "cannot be encoded" in bad.error
    assert good.status != "error" and len(good.turns) == 2


def test_pixels_are_kept_in_the_dtype_asked_for(processor):
    """The engine's policy keeps pixels in its dtype (the tower casts to it: tests/engine/test_families.py)."""
    images = [np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((60, 90), (33, 33))]
    full, half = ImageEncoder(processor).encode(images), ImageEncoder(processor, torch.bfloat16).encode(images)
    for made, kept in zip(full, half):
        assert made.model_inputs["pixel_values"].dtype == torch.float32
        assert kept.model_inputs["pixel_values"].dtype == torch.bfloat16
        assert torch.equal(kept.model_inputs["pixel_values"], made.model_inputs["pixel_values"].to(torch.bfloat16))
        assert torch.equal(kept.model_inputs["image_grid_thw"], made.model_inputs["image_grid_thw"])
        assert kept.placeholder_tokens == made.placeholder_tokens and kept.digest == made.digest


def test_thin_images_are_read_channels_last(processor):
    encoder = ImageEncoder(processor)
    (image,) = encoder.encode([np.zeros((3, 60, 3), dtype=np.uint8)])
    assert image.placeholder_tokens >= 1 and image.model_inputs["image_grid_thw"].shape == (1, 3)


def sokoban_frames() -> list[np.ndarray]:
    """Frames of visual Sokoban: a level's start, then each move in turn, twice (a move into a wall shows the
    frame before it again)."""
    env = make("Sokoban", size=6, num_boxes=1, mode="image")
    frames = [env.reset(seed=3)[0]["image"]]
    for action in env.action_names() * 2:
        frames.append(env.step(action)[0]["image"])
    return frames


def assert_same_encoding(got, expected) -> None:
    assert got.digest == expected.digest and got.placeholder_tokens == expected.placeholder_tokens
    assert got.model_inputs.keys() == expected.model_inputs.keys()
    for key, tensor in expected.model_inputs.items():
        assert torch.equal(got.model_inputs[key], tensor) and got.model_inputs[key].dtype == tensor.dtype


def test_an_image_met_again_is_taken_from_the_cache_as_it_was_first_encoded(processor):
    frames = sokoban_frames()
    calls = [[frames[0]], [frames[0]], *([frame] for frame in frames[1:]), [frames[2], frames[0], frames[2]], []]
    plain, cached = ImageEncoder(processor, torch.bfloat16, cache_bytes=0), ImageEncoder(processor, torch.bfloat16)
    for images in calls:
        got, expected = cached.encode(images), plain.encode(images)
        assert len(got) == len(expected) == len(images)
        for a, b in zip(got, expected):
            assert_same_encoding(a, b)
        joined, joined_plain = cached.message_inputs(images), plain.message_inputs(images)
        assert joined.token_counts == joined_plain.token_counts and joined.digests == joined_plain.digests
        for key, tensor in joined_plain.model_inputs.items():
            assert torch.equal(joined.model_inputs[key], tensor)
    unique = len({content_digest([frame]) for frame in frames})
    given = 2 * sum(len(images) for images in calls)  # encode and message_inputs each saw every call
    within_calls = 2 * sum(len(images) - len({content_digest([image]) for image in images}) for images in calls)
    assert 1 < unique < len(frames) and within_calls > 0  # the walls gave some frames twice
    assert cached.images_processed == unique and cached.images_reused == given - unique
    assert plain.images_processed == given - within_calls and plain.images_reused == within_calls


def test_the_cache_keeps_at_most_its_bytes_dropping_the_least_recently_used(processor):
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) for _ in range(3))
    size = encoded_bytes(ImageEncoder(processor).encode([a])[0])
    encoder = ImageEncoder(processor, cache_bytes=int(2.5 * size))  # room for two
    processed = []
    for image in (a, b, a, c, b, c, a):
        before = encoder.images_processed
        encoder.encode([image])
        processed.append(encoder.images_processed - before)
    # a, b; a met again (now the newest); c drops b; b again drops a; c met again; a again.
    assert processed == [1, 1, 0, 1, 1, 0, 1]


def test_encoders_shared_by_threads_give_each_image_its_own_encoding(processor):
    frames = sokoban_frames()
    expected = ImageEncoder(processor, cache_bytes=0).encode(frames)
    encoder = ImageEncoder(processor)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda order: encoder.encode(frames if order % 2 else frames[::-1]),
                                range(8)))
    for order, got in enumerate(results):
        for a, b in zip(got, expected if order % 2 else expected[::-1]):
            assert_same_encoding(a, b)
    assert encoder.images_processed + encoder.images_reused == 8 * len(frames)


@pytest.mark.parametrize("patch_size, pixels", [(None, {}), (None, {"min_pixels": 56 * 56, "max_pixels": 84 * 84}),
                                                (16, {"min_pixels": 32 * 32, "max_pixels": 128 * 128})])
def test_placeholders_counted_from_sizes_equal_the_encoded_ones(tiny_vlm_dir, patch_size, pixels):
    """SFT counts its images' placeholders from their sizes; the rollout encodes them: the same counts for
    thin, odd, tiny and oversized images, with the checkpoint's limits, overridden ones and Qwen3-VL's patches."""
    from transformers import Qwen2VLImageProcessor

    encoder = ImageEncoder(load_processor(tiny_vlm_dir, **pixels))
    if patch_size is not None:
        encoder.image_processor = Qwen2VLImageProcessor(patch_size=patch_size, **pixels)
    sizes = [(3, 60), (150, 150), (37, 211), (500, 400), (10, 10), (28, 29), (1000, 30)]
    images = [np.zeros((h, w, 3), dtype=np.uint8) for h, w in sizes]
    assert encoder.placeholder_counts(images) == [image.placeholder_tokens for image in encoder.encode(images)]
    assert len(set(encoder.placeholder_counts(images))) > 2  # the sizes do change the counts


def test_a_message_of_one_image_shares_the_encoders_tensors_and_several_are_joined(processor):
    frames = sokoban_frames()
    encoder = ImageEncoder(processor, torch.bfloat16)
    (kept,) = encoder.encode([frames[0]])
    one = encoder.message_inputs([frames[0]]).model_inputs
    assert all(one[key].data_ptr() == kept.model_inputs[key].data_ptr() for key in one)  # no copy made
    two = encoder.message_inputs([frames[0], frames[1]]).model_inputs
    assert two["pixel_values"].data_ptr() != kept.model_inputs["pixel_values"].data_ptr()
    assert torch.equal(two["pixel_values"][: len(one["pixel_values"])], one["pixel_values"])
