"""A VLM's packed rows against its padded rows: the same log-probs, entropies, values and gradients.

Packing gives each row's image tokens M-RoPE positions of their own (:func:`~turnrl.training.packing.pack`),
taking each row's images from the grids of the whole pass in row order. The grids here differ in shape (the
same number of tokens laid out 2x2, 1x4 or 4x1, and one of 2x4), so a row given another row's grid, or
positions that run on from the row before, scores differently; a text-only row sits between image rows, and the
packed micro-batches take the rows longest first, so their pixels are selected out of order.
"""

from __future__ import annotations

import copy

import pytest
import torch

from turnrl.models.loading import load_model
from turnrl.training.batch import Batch, Sample, collate
from turnrl.training.model_passes import ValueModel, token_logprobs
from turnrl.training.packed_attention import ATTENTION
from turnrl.training.ppo import MicroBatching, batched_logprobs, batched_values

ROWS = (((1, 8, 2),), ((1, 4, 4), (1, 2, 8)), (), ((1, 4, 8), (1, 4, 4), (1, 2, 8)))
"""Each row's image grids (t, h, w) in patches, merged 2x2 into tokens (4 tokens each, 8 for 4x8); row 2 has
none. Row 3 is the longest: the packed passes take it first, so a pass holds its pixels before row 0's."""


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir):
    """The tiny Qwen2.5-VL on the trainer's attention, its tower trained too (gradients reach the pixels'
    features through the packed pass as through the padded one)."""
    torch.manual_seed(0)
    return load_model(tiny_vlm_dir, device="cpu", attention=ATTENTION)


def image_row(model, grids: tuple[tuple[int, int, int], ...], gen: torch.Generator, episode: int) -> Sample:
    """A prompt, then per image its placeholders and three trained tokens."""
    config, vision = model.config, model.config.vision_config
    patch = 3 * vision.temporal_patch_size * vision.patch_size**2
    merge = vision.spatial_merge_size**2
    ids, mask = torch.randint(10, 200, (3,), generator=gen).tolist(), [0, 0, 0]
    for t, h, w in grids:
        ids += [config.vision_start_token_id] + [config.image_token_id] * (t * h * w // merge)
        ids += [config.vision_end_token_id] + torch.randint(10, 200, (3,), generator=gen).tolist()
        mask += [0] * (t * h * w // merge + 2) + [1, 1, 1]
    inputs = {}
    if grids:
        patches = sum(t * h * w for t, h, w in grids)
        inputs = {"pixel_values": torch.randn(patches, patch, generator=gen), "image_grid_thw": torch.tensor(grids)}
    return Sample(ids, mask, [0.0] * len(ids), [len(ids) - 1], [1.0], episode=episode, group=0, model_inputs=inputs)


def vlm_batch(model) -> Batch:
    gen = torch.Generator().manual_seed(3)
    return collate([image_row(model, grids, gen, k) for k, grids in enumerate(ROWS)], pad_id=2)


def assert_same_grad(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal up to float32 rounding: within 1e-5 of the tensor's largest entry (the patch embedding's gradient
    reaches the hundreds, where rounding alone is above any fixed tolerance)."""
    tolerance = 1e-5 * float(expected.abs().max()) + 1e-6
    assert float((got - expected).abs().max()) <= tolerance, name


def scores_and_grads(model, batch: Batch, packed: bool):
    model.zero_grad()
    logprobs, entropy = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                                       temperature=0.7, with_entropy=True, model_inputs=batch.model_inputs,
                                       packed=packed)
    (logprobs.sum() + 0.3 * entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


def test_packed_vlm_rows_score_and_train_as_padded(vlm):
    batch = vlm_batch(vlm)
    lengths = batch.attention_mask.sum(1)
    assert len(set(lengths.tolist())) == len(ROWS)  # padding in every row but the longest
    padded, packed = (scores_and_grads(vlm, batch, packed) for packed in (False, True))
    assert bool((padded[0] != 0).any())
    torch.testing.assert_close(packed[0], padded[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1], padded[1], atol=1e-5, rtol=1e-5)
    assert packed[2].keys() == padded[2].keys()
    assert any("visual" in name for name in padded[2])  # the tower's gradients are compared too
    for name, grad in padded[2].items():
        assert_same_grad(packed[2][name], grad, name)


def test_packed_vlm_values_and_critic_gradients_equal_padded(vlm):
    critic = ValueModel(copy.deepcopy(vlm.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    batch = vlm_batch(vlm)
    results = []
    for packed in (False, True):
        critic.zero_grad()
        values = critic(batch.input_ids, batch.attention_mask, batch.model_inputs, packed=packed)
        (values * batch.loss_mask).square().sum().backward()
        results.append((values.detach(), {name: p.grad.clone() for name, p in critic.named_parameters()
                                          if p.grad is not None}))
    (values, grads), (packed_values, packed_grads) = results
    torch.testing.assert_close(packed_values, values, atol=1e-5, rtol=1e-5)
    assert packed_grads.keys() == grads.keys() and any("visual" in name for name in grads)
    for name, grad in grads.items():
        assert_same_grad(packed_grads[name], grad, name)


def test_packed_micro_batches_of_a_vlm_score_as_one_padded_pass(vlm):
    """Passes of at most 50 tokens, rows taken longest first, each into the pass it leaves the least room in
    (row 3 with rows 0 and the text-only row 2 in its room, then row 1): each row's pixels go with it, and the
    scores land in its own row."""
    critic = ValueModel(copy.deepcopy(vlm.base_model))
    torch.nn.init.normal_(critic.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(5))
    batch = vlm_batch(vlm)
    packed = MicroBatching(1, tokens=50)
    parts = packed.split(torch.arange(len(batch)), batch.attention_mask.sum(1))
    assert [part.tolist() for part in parts] == [[3, 0, 2], [1]]
    with torch.no_grad():
        torch.testing.assert_close(batched_logprobs(vlm, batch, packed, 0.7),
                                   batched_logprobs(vlm, batch, MicroBatching(len(batch)), 0.7),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(batched_values(critic, batch, packed),
                                   batched_values(critic, batch, MicroBatching(len(batch))), atol=1e-5, rtol=1e-5)
