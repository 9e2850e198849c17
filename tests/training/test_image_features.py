"""A frozen vision tower's features encoded once a step and reused by every pass: the same log-probs,
entropies, values and gradients as passes that encode their images themselves, padded and packed, for
Qwen2.5-VL and Qwen3-VL (deepstack features); each image encoded once however often it is shown; a trained
tower never served."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.engine.test_qwen3_vl import qwen3_vl_config
from turnrl.models.loading import load_model
from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.batch import Batch, Sample, collate
from turnrl.training.image_features import IMAGE_KEYS, ImageFeatures
from turnrl.training.model_passes import ValueModel, token_logprobs
from turnrl.training.packed_attention import ATTENTION
from turnrl.training.ppo import MicroBatching, UpdateInputs, batched_logprobs, batched_values, ppo_epochs
from turnrl.training.train_config import OptimConfig

GRID = (1, 4, 4)  # 16 patches, merged 2x2: 4 image tokens


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(request, tiny_vlm_dir, tiny_tokenizer, tmp_path_factory):
    """A VLM with the trainer's attention (packed rows attend sequence by sequence) and a frozen tower."""
    if request.param == "qwen2_5_vl":
        path = tiny_vlm_dir
    else:
        from transformers import Qwen3VLForConditionalGeneration

        torch.manual_seed(0)
        path = tmp_path_factory.mktemp("qwen3_vl")
        Qwen3VLForConditionalGeneration(qwen3_vl_config(tiny_tokenizer)).save_pretrained(path)
    model = load_model(path, device="cpu", attention=ATTENTION)
    model.model.visual.requires_grad_(False)
    return model


def patch_dim(model) -> int:
    vision = model.config.vision_config
    return 3 * vision.temporal_patch_size * vision.patch_size**2


def sample(model, gen: torch.Generator, layout: str, keys: list[int], episode: int) -> Sample:
    """Images at the sequence's start, end or middle (4 placeholders each, between vision start and end),
    responses trained; ``keys`` name the images (equal keys: the same image)."""
    config = model.config
    image, start, end = config.image_token_id, config.vision_start_token_id, config.vision_end_token_id
    ids, mask = ([], []) if layout == "start" else ([5, 6], [0, 0])
    for _ in keys:
        ids += [start] + [image] * 4 + [end] + torch.randint(10, 200, (3,), generator=gen).tolist()
        mask += [0] * 6 + [1] * 3
    if layout == "end":  # the last image closes the sequence, after the last trained token
        ids += [start] + [image] * 4 + [end]
        mask += [0] * 6
        keys = [*keys, keys[-1] - 1000]
    pixels = {key: torch.randn(16, patch_dim(model), generator=torch.Generator().manual_seed(abs(key)))
              for key in keys}
    return Sample(ids, mask, [-0.5 * m for m in mask], [len(ids) - 1], [1.0], episode=episode, group=0,
                  model_inputs={"pixel_values": torch.cat([pixels[key] for key in keys]),
                                "image_grid_thw": torch.tensor([GRID] * len(keys)),
                                IMAGE_KEYS: torch.tensor(keys)})


def image_batch(model) -> Batch:
    """Four rows, images at starts, ends and middles: eight images, six different (-1 shown three times)."""
    gen = torch.Generator().manual_seed(1)
    layouts = [("start", [-1, -2]), ("end", [-3]), ("middle", [-1, -4, -1]), ("middle", [-5])]
    return collate([sample(model, gen, layout, keys, e) for e, (layout, keys) in enumerate(layouts)], pad_id=2)


def logprobs_and_grads(model, batch: Batch, packed: bool, features: ImageFeatures | None):
    model.zero_grad()
    logprobs, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                                       with_entropy=True, model_inputs=batch.model_inputs, packed=packed,
                                       image_features=features)
    (logprobs.sum() + 0.1 * entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("packed", [False, True])
def test_stored_features_give_the_same_logprobs_entropy_and_gradients(vlm, packed):
    batch = image_batch(vlm)
    plain = logprobs_and_grads(vlm, batch, packed, None)
    features = ImageFeatures()
    first = logprobs_and_grads(vlm, batch, packed, features)  # encodes
    assert features.encoded == 6 and features.served == 2  # image -1 three times, the five others once
    assert features.holds(batch.model_inputs[IMAGE_KEYS])
    second = logprobs_and_grads(vlm, batch, packed, features)  # served: no pixel reaches the model
    assert features.encoded == 6 and features.served == 2 + 8
    for got in (first, second):
        torch.testing.assert_close(got[0], plain[0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1], plain[1], atol=1e-6, rtol=1e-5)
        assert got[2].keys() == plain[2].keys() and plain[2]
        for name in plain[2]:
            torch.testing.assert_close(got[2][name], plain[2][name], atol=1e-6, rtol=1e-5)
    assert not any("visual" in name for name in plain[2])  # the tower is frozen in both


def test_the_tower_is_swapped_only_within_a_pass(vlm):
    batch = image_batch(vlm)
    features = ImageFeatures()
    tower = vlm.model.visual
    with features.serving(vlm.model, batch.model_inputs[IMAGE_KEYS]):
        assert "forward" in tower.__dict__
    assert "forward" not in tower.__dict__  # the class's own forward again


def test_a_pass_that_lacks_pixels_of_unstored_images_says_so(vlm):
    batch = image_batch(vlm)
    inputs = {**batch.model_inputs, "pixel_values": batch.model_inputs["pixel_values"][:0]}
    with pytest.raises(ValueError, match="not stored"):
        token_logprobs(vlm, batch.input_ids, batch.attention_mask, batch.loss_mask, model_inputs=inputs,
                       image_features=ImageFeatures())


def test_a_trained_tower_is_never_served(vlm):
    model = copy.deepcopy(vlm)
    model.model.visual.requires_grad_(True)
    batch = image_batch(model)
    with pytest.raises(ValueError, match="train_vision"):
        token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                       model_inputs=batch.model_inputs, image_features=ImageFeatures())


def test_micro_batches_reference_and_critic_share_one_store(vlm):
    """The logprob and value passes of micro-batches, the reference's and the critic's (frozen copies of the
    tower) served from one store: the same as passes that encode, each image encoded once."""
    batch = image_batch(vlm)
    reference = copy.deepcopy(vlm)
    critic = ValueModel(copy.deepcopy(vlm.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    shared = batch.with_image_features()
    assert shared.image_features is not None
    with torch.no_grad():
        for micro in (MicroBatching(1), MicroBatching(2, tokens=40)):
            expected = (batched_logprobs(vlm, batch, micro, 1.0), batched_logprobs(reference, batch, micro, 1.0),
                        batched_values(critic, batch, micro))
            got = (batched_logprobs(vlm, shared, micro, 1.0), batched_logprobs(reference, shared, micro, 1.0),
                   batched_values(critic, shared, micro))
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert shared.image_features.encoded == 6


def test_ppo_epochs_with_stored_features_train_as_without(vlm):
    batch = image_batch(vlm)
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(batch.input_ids.shape, generator=gen) * batch.loss_mask
    trained = []
    for shared in (batch, batch.with_image_features()):
        actor, critic = copy.deepcopy(vlm), ValueModel(copy.deepcopy(vlm.base_model))
        critic.backbone.visual.requires_grad_(False)
        old = batched_logprobs(actor, shared, MicroBatching(2), 1.0).detach()
        values = batched_values(critic, shared, MicroBatching(2))
        inputs = UpdateInputs(shared, old, advantages, advantages, values, old.clone())
        config = AlgorithmConfig(mini_batch_size=2, micro_batch_size=1, ppo_epochs=2, kl_coef=0.1)
        actor_optimizer = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.1)
        critic_optimizer = torch.optim.SGD([p for p in critic.parameters() if p.requires_grad], lr=0.1)
        metrics = ppo_epochs(actor, critic, inputs, config, OptimConfig(), actor_optimizer, critic_optimizer, 1.0,
                             torch.Generator().manual_seed(0))
        trained.append((metrics, dict(actor.named_parameters()), shared.image_features))
    (plain, plain_weights, _), (served, served_weights, features) = trained
    assert features is not None and features.encoded == 6 and features.served > 6
    assert served["actor/grad_norm"] == pytest.approx(plain["actor/grad_norm"], rel=1e-5)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(served_weights[name], weight, atol=1e-6, rtol=1e-5)


def test_samples_without_keys_are_named_by_their_place(vlm):
    batch = image_batch(vlm)
    unnamed = collate([Sample(**{**vars(s), "model_inputs": {k: v for k, v in s.model_inputs.items()
                                                             if k != IMAGE_KEYS}})
                       for s in [sample(vlm, torch.Generator().manual_seed(0), "middle", [-1, -1], 0)]], pad_id=2)
    shared = unnamed.with_image_features()
    assert shared.model_inputs[IMAGE_KEYS].tolist() == [0, 1]  # no digests: two images, encoded apart
    assert shared.select([0]).image_features is shared.image_features
    assert batch.with_image_features().model_inputs[IMAGE_KEYS].tolist() == batch.model_inputs[IMAGE_KEYS].tolist()


def test_a_batch_keeps_image_keys_only_where_every_sample_has_them(vlm):
    gen = torch.Generator().manual_seed(0)
    named = sample(vlm, gen, "middle", [-1], 0)
    unnamed = sample(vlm, gen, "middle", [-2], 1)
    del unnamed.model_inputs[IMAGE_KEYS]
    assert IMAGE_KEYS not in collate([named, unnamed], pad_id=2).model_inputs
    assert collate([named], pad_id=2).model_inputs[IMAGE_KEYS].tolist() == [-1]


@pytest.mark.parametrize("packed", [False, True])
def test_a_pass_over_rows_without_images_runs_as_the_text_model(vlm, packed):
    """A VLM batch's text-only rows (a micro-batch of them holds no image): scored as the decoder alone scores
    them, with or without a store (transformers' towers take no empty batch of images)."""
    gen = torch.Generator().manual_seed(0)
    text = Sample([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1], [0.0] * 6, [5], [1.0], episode=1, group=0,
                  model_inputs={"pixel_values": torch.zeros(0, patch_dim(vlm)),
                                "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
                                IMAGE_KEYS: torch.zeros(0, dtype=torch.long)})
    part = collate([sample(vlm, gen, "middle", [-1], 0), text], pad_id=2).select([1])
    with torch.no_grad():
        expected, _ = token_logprobs(vlm, part.input_ids, part.attention_mask, part.loss_mask)
        for features in (None, ImageFeatures()):
            got, _ = token_logprobs(vlm, part.input_ids, part.attention_mask, part.loss_mask, packed=packed,
                                    model_inputs=part.model_inputs, image_features=features)
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_a_text_only_row_beside_image_rows_scores_as_alone(vlm, packed):
    """A text-only sample as the sample builders make it (no model inputs at all) in a micro-batch with image rows:
    each row scores what it scores alone, with or without a store."""
    gen = torch.Generator().manual_seed(0)
    text = Sample([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1], [0.0] * 6, [5], [1.0], episode=1, group=0)
    image = sample(vlm, gen, "middle", [-1], 0)
    both = collate([image, text], pad_id=2)
    with torch.no_grad():
        for features in (None, ImageFeatures()):
            got, _ = token_logprobs(vlm, both.input_ids, both.attention_mask, both.loss_mask, packed=packed,
                                    model_inputs=both.model_inputs, image_features=features)
            for row, alone in enumerate((collate([image], pad_id=2), collate([text], pad_id=2))):
                expected, _ = token_logprobs(vlm, alone.input_ids, alone.attention_mask, alone.loss_mask,
                                             model_inputs=alone.model_inputs)
                torch.testing.assert_close(got[row, :alone.input_ids.shape[1]], expected[0], atol=1e-5, rtol=1e-4)


def test_the_trainer_stores_features_only_for_a_frozen_tower(vlm):
    from turnrl.config import load_config
    from turnrl.training.scoring import encodes_images_once
    from turnrl.training.train_config import TrainConfig

    batch = image_batch(vlm)
    text = collate([Sample([5, 6, 7], [0, 1, 1], [0.0] * 3, [2], [1.0], episode=0, group=0)], pad_id=2)

    def config(*overrides: str) -> TrainConfig:
        return load_config(TrainConfig, None, list(overrides))

    assert encodes_images_once(config(), batch)
    assert not encodes_images_once(config("model.train_vision=true"), batch)
    assert not encodes_images_once(config("model.encode_images_once=false"), batch)
    assert not encodes_images_once(config(), text)
