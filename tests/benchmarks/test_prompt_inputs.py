"""The prompt-inputs benchmark builds the same prompts both ways, and the plain way's copies grow with the turns."""

from __future__ import annotations

import torch

from benchmarks.prompt_inputs import play
from turnrl.models.loading import load_processor


def test_both_ways_make_the_same_prompts_and_the_plain_way_copies_every_kept_image(tiny_vlm_dir):
    tokenizer = load_processor(tiny_vlm_dir).tokenizer
    frame = {"pixel_values": [torch.randn(8, 6).to(torch.bfloat16) for _ in range(3)],
             "image_grid_thw": [torch.tensor([[1, 4, 2]]) for _ in range(3)]}
    _, plain_bytes, plain = play(3, 5, frame, 2, tokenizer, plain=True)
    _, view_bytes, views = play(3, 5, frame, 2, tokenizer, plain=False)
    assert len(plain) == len(views) == 5
    for a, b in zip(plain, views, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    # turn t's prompt holds t + 1 frames of 8 x 6 bf16 values and t + 1 grids of 3 int64: 15 frames an episode
    assert plain_bytes == view_bytes == 3 * 15 * (8 * 6 * 2 + 3 * 8)
    assert views[-1]["pixel_values"]._is_view() and not plain[-1]["pixel_values"]._is_view()
