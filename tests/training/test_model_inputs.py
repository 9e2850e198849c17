"""Extra model inputs reach every forward pass of training: a VLM's own forward (images merged, its
M-RoPE positions) runs for logprobs, values, the reference, the PPO update and SFT.

The VLM is a small Qwen2.5-VL built from a config here (random weights, no processor needed: the pixel
values are random patches of the right shape).
"""

from __future__ import annotations

import copy

import pytest
import torch

from turnrl.training.algorithm_config import AlgorithmConfig
from turnrl.training.batch import Sample, collate
from turnrl.training.model_passes import ValueModel, token_logprobs
from turnrl.training.ppo import MicroBatching, UpdateInputs, batched_logprobs, batched_values, ppo_epochs
from turnrl.training.sft import sft_train
from turnrl.training.train_config import OptimConfig, SFTConfig

IMAGE, START, END = 290, 292, 293
PATCH_DIM = 3 * 2 * 14 * 14  # channels * temporal patch * patch * patch
GRID = (1, 4, 4)  # 16 patches, merged 2x2: 4 image tokens


@pytest.fixture(scope="module")
def vlm():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        image_token_id=IMAGE, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    return Qwen2_5_VLForConditionalGeneration(config).float()


def image_sample(gen: torch.Generator, images: int, episode: int) -> Sample:
    """Text, then ``images`` images (4 placeholder tokens each), each followed by a trained response."""
    ids, mask = [5, 6], [0, 0]
    for _ in range(images):
        ids += [START] + [IMAGE] * 4 + [END] + torch.randint(10, 280, (3,), generator=gen).tolist()
        mask += [0] * 6 + [1] * 3
    n_patches = images * GRID[0] * GRID[1] * GRID[2]
    return Sample(ids, mask, [-0.5 * m for m in mask], [len(ids) - 1], [1.0], episode=episode, group=0,
                  model_inputs={"pixel_values": torch.randn(n_patches, PATCH_DIM, generator=gen),
                                "image_grid_thw": torch.tensor([GRID] * images)})


@pytest.fixture
def batch():
    gen = torch.Generator().manual_seed(1)
    return collate([image_sample(gen, n, e) for e, n in enumerate((1, 2, 1))], pad_id=2)


def full_forward_logprobs(model, batch, positions: bool = True) -> torch.Tensor:
    """log p of each scored token from the model's own full forward (all logits), given the token types a
    processor returns (so that the image tokens get 3D positions), or without them (1D positions)."""
    types = {"mm_token_type_ids": (batch.input_ids == IMAGE).int()} if positions else {}
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, **batch.model_inputs,
                   **types).logits
    logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logprobs, (1, 0)) * batch.loss_mask


def test_token_logprobs_run_the_vlms_own_forward_with_the_images(vlm, batch):
    with torch.no_grad():
        got, _ = token_logprobs(vlm, batch.input_ids, batch.attention_mask, batch.loss_mask,
                                model_inputs=batch.model_inputs)
        expected = full_forward_logprobs(vlm, batch)
        other_images = {**batch.model_inputs, "pixel_values": batch.model_inputs["pixel_values"] + 1.0}
        changed, _ = token_logprobs(vlm, batch.input_ids, batch.attention_mask, batch.loss_mask,
                                    model_inputs=other_images)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, changed, atol=1e-4)  # the pixels reach the trained tokens' logprobs
    with torch.no_grad():  # and the image tokens have their own positions (M-RoPE), not a row of 1D ones
        flat = full_forward_logprobs(vlm, batch, positions=False)
    assert not torch.allclose(got, flat, atol=1e-4)


def test_micro_batches_carry_their_own_images(vlm, batch):
    critic = ValueModel(copy.deepcopy(vlm.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = full_forward_logprobs(vlm, batch)
        values = critic(batch.input_ids, batch.attention_mask, batch.model_inputs) * batch.loss_mask
    for micro in (1, 2):
        assert torch.allclose(batched_logprobs(vlm, batch, MicroBatching(micro), 1.0), whole, atol=1e-5)
        assert torch.allclose(batched_values(critic, batch, MicroBatching(micro)), values, atol=1e-5)
    assert values.abs().sum() > 0


def test_a_ppo_update_trains_the_vision_tower_too(vlm, batch):
    actor = copy.deepcopy(vlm)
    critic = ValueModel(copy.deepcopy(vlm.base_model))
    old = batched_logprobs(actor, batch, MicroBatching(2), 1.0)
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(batch.input_ids.shape, generator=gen) * batch.loss_mask
    inputs = UpdateInputs(batch, old, advantages, advantages, batched_values(critic, batch, MicroBatching(2)), old.clone())
    vision_before = {n: p.clone() for n, p in actor.named_parameters() if "visual" in n}
    metrics = ppo_epochs(actor, critic, inputs, AlgorithmConfig(mini_batch_size=3, micro_batch_size=2, kl_coef=0.1),
                         OptimConfig(), torch.optim.SGD(actor.parameters(), lr=0.1),
                         torch.optim.SGD(critic.parameters(), lr=0.1), 1.0, torch.Generator().manual_seed(0))
    assert metrics["actor/grad_norm"] > 0 and metrics["critic/grad_norm"] > 0
    changed = [n for n, p in actor.named_parameters() if "visual" in n and not torch.equal(p, vision_before[n])]
    assert changed  # the image features were part of the graph


def test_sft_on_samples_with_images(vlm):
    model = copy.deepcopy(vlm)
    gen = torch.Generator().manual_seed(4)
    samples = [image_sample(gen, 1 + i % 2, i) for i in range(4)]
    before = [p.clone() for p in model.parameters()]
    metrics = sft_train(model, 2, samples, SFTConfig(epochs=1, batch_size=2, micro_batch_size=1, warmup_steps=1))
    assert metrics["sft/steps"] == 2.0 and metrics["sft/final_epoch_loss"] > 0
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
