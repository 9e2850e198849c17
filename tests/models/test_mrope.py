"""M-RoPE positions: placeholder runs, and the positions against the model's own."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.test_images import PAD, image_prompt
from turnrl.models.mrope import mrope_positions, placeholder_spans


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=60))
def test_placeholder_spans_are_the_runs_of_the_placeholder(tokens):
    spans = placeholder_spans(tokens, PAD)
    expected, start = [], None
    for index, token in enumerate(tokens + [-1]):
        if token == PAD and start is None:
            start = index
        elif token != PAD and start is not None:
            expected.append((start, index))
            start = None
    assert spans == expected


def test_mrope_positions_equal_the_models_own(tiny_vlm_policy):
    model = tiny_vlm_policy.model.model
    config = tiny_vlm_policy.model.config
    grids = [(1, 4, 6), (1, 8, 4), (1, 4, 6)]  # the third image's offsets are the first's, kept
    prompt, inputs = image_prompt(grids, [3, 5, 4, 2])
    prompt = [config.image_token_id if t == PAD else t for t in prompt]
    ids = torch.tensor([prompt])
    arguments = {"input_ids": ids, "image_grid_thw": inputs["image_grid_thw"],
                 "mm_token_type_ids": (ids == config.image_token_id).int(), "attention_mask": torch.ones_like(ids)}
    accepted = inspect.signature(model.get_rope_index).parameters
    expected, delta = model.get_rope_index(**{k: v for k, v in arguments.items() if k in accepted})
    positions, ours = mrope_positions(len(prompt), placeholder_spans(prompt, config.image_token_id),
                                      inputs["image_grid_thw"], 2)
    np.testing.assert_array_equal(positions, expected[:, 0].numpy())
    assert ours == int(delta) < 0
    positions[:] = -1  # a caller's positions are its own: the kept offsets stay as they were
    again, _ = mrope_positions(len(prompt), placeholder_spans(prompt, config.image_token_id),
                               inputs["image_grid_thw"], 2)
    np.testing.assert_array_equal(again, expected[:, 0].numpy())


def test_text_alone_counts_up_with_no_delta():
    positions, delta = mrope_positions(5, [], torch.zeros(0, 3, dtype=torch.long), 2)
    np.testing.assert_array_equal(positions, np.tile(np.arange(5), (3, 1)))
    assert delta == 0


@pytest.mark.parametrize("spans, grids, said", [
    ([(1, 3)], [[1, 2, 2]], "image 0 has 2 placeholder tokens, and its grid [1, 2, 2] makes 1"),  # spread before
    ([(1, 3)], [[1, 4, 4]], "image 0 has 2 placeholder tokens, and its grid [1, 4, 4] makes 4"),  # cut mid-image
    ([(1, 2), (4, 5)], [[1, 2, 2]], "2 runs of image placeholders and 1 image grids"),
    ([(1, 2)], [[1, 2, 3]], "image 0's grid [1, 2, 3] is not whole 2 x 2 groups"),  # 6 // 4 = 1 would pass the count
])
def test_placeholders_that_are_not_their_grids_images_are_refused_saying_so(spans, grids, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        mrope_positions(8, spans, torch.tensor(grids), 2)
