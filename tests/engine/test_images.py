"""A VLM prompt's images for the engine: match keys drawn from pixels or given with the prompt, clear errors for
images that do not fit their placeholders; logprobs with vision tokens suppressed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnrl.engine.images import prompt_images
from turnrl.engine.sampling import logprobs_before_suppression
from turnrl.engine.weights import rope_axes

PAD = 7  # the image placeholder id in these tests


def image_prompt(grids: list[tuple[int, int, int]], text: list[int]) -> tuple[list[int], dict]:
    """Text runs of the given lengths around one placeholder run per grid (merge size 2), with random pixels."""
    prompt: list[int] = []
    for index, grid in enumerate(grids):
        prompt += [1] * text[index] + [PAD] * (grid[0] * grid[1] * grid[2] // 4)
    prompt += [2] * text[len(grids)]
    patches = sum(t * h * w for t, h, w in grids)
    inputs = {"pixel_values": torch.randn(patches, 12), "image_grid_thw": torch.tensor(grids)}
    return prompt, inputs


def test_match_keys_stand_for_the_pixels_not_the_placeholders():
    prompt, inputs = image_prompt([(1, 4, 4)], [3, 2])
    same = prompt_images(prompt, inputs, PAD, 2)
    again = prompt_images(prompt, {k: v.clone() for k, v in inputs.items()}, PAD, 2)
    other = prompt_images(prompt, {**inputs, "pixel_values": inputs["pixel_values"] + 1}, PAD, 2)
    assert same.keys == again.keys
    assert same.keys[:3] == other.keys[:3] == prompt[:3] and same.keys[3] != other.keys[3]
    assert all(key < 0 for key in same.keys[3:7]) and same.keys[7:] == prompt[7:]


def test_match_keys_take_the_digests_given_with_the_prompt():
    prompt, inputs = image_prompt([(1, 4, 4), (1, 2, 4)], [3, 2, 1])
    given = prompt_images(prompt, inputs, PAD, 2, digests=[-11, -12])
    assert given.keys == prompt[:3] + [-11] * 4 + prompt[7:9] + [-12] * 2 + prompt[11:]
    hashed = prompt_images(prompt, inputs, PAD, 2)
    assert hashed.keys != given.keys and [hashed.keys[i] < 0 for i in range(len(prompt))] == [k < 0 for k in given.keys]
    np.testing.assert_array_equal(given.positions, hashed.positions)


@pytest.mark.parametrize(("digests", "why"), [([-1], "2 images and 1 image digests"), ([-1, 5], "negative integers"),
                                              ([-1, -2, -3], "2 images and 3")])
def test_digests_that_do_not_fit_the_images_are_refused(digests, why):
    prompt, inputs = image_prompt([(1, 4, 4), (1, 2, 4)], [3, 2, 1])
    with pytest.raises(ValueError, match=why):
        prompt_images(prompt, inputs, PAD, 2, digests=digests)


@pytest.mark.parametrize(("change", "message"), [
    (lambda p, i: (p + [PAD, 3], i), "2 runs of image placeholders and 1 image grids"),
    (lambda p, i: (p[:4] + p[5:], i), "image 0 has 3 placeholder tokens"),
    (lambda p, i: (p, {**i, "pixel_values": i["pixel_values"][:-1]}), "pixel_values has 15 patches"),
    (lambda p, i: (p, {"image_grid_thw": i["image_grid_thw"]}), "no pixel_values"),
])
def test_images_that_do_not_fit_their_placeholders_are_refused_with_what_differs(change, message):
    prompt, inputs = change(*image_prompt([(1, 4, 4)], [3, 2]))
    with pytest.raises(ValueError, match=message):
        prompt_images(prompt, inputs, PAD, 2)


@pytest.mark.parametrize("grid", [(1, 2, 3), (1, 3, 6), (1, 5, 4)])
def test_a_grid_that_is_not_whole_groups_of_patches_is_refused(grid):
    """(1, 2, 3) makes 6 // 4 = 1 placeholder and would pass the count; the batch's tower call would then fail
    for every request beside it."""
    prompt, inputs = image_prompt([grid], [3, 2])
    with pytest.raises(ValueError, match=rf"image 0's grid \[{grid[0]}, {grid[1]}, {grid[2]}\] is not whole 2 x 2"):
        prompt_images(prompt, inputs, PAD, 2)


def test_rope_axes_follow_the_sections_in_both_halves():
    axes = rope_axes([2, 3, 3], 16).tolist()
    assert axes == [0, 0, 1, 1, 1, 2, 2, 2] * 2


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_before_suppression_equal_the_untruncated_softmax(temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=generator) * 3
    suppressed = torch.tensor([3, 17, 40])
    tokens = torch.tensor([0, 5, 9, 22, 49])
    scale = temperature or 1.0
    masked = logits.clone()
    masked[:, suppressed] = float("-inf")
    with_suppression = torch.log_softmax(masked / scale, -1).gather(1, tokens[:, None]).squeeze(1)
    result = logprobs_before_suppression(with_suppression, logits.gather(1, tokens[:, None]).squeeze(1),
                                         logits[:, suppressed], torch.full((5,), temperature))
    expected = torch.log_softmax(logits / scale, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(result, expected)
