"""The prompt-inputs benchmark builds the same prompts every way, the plain way's copies grow with the turns, and
its row tables place the same rows."""

from __future__ import annotations

import torch

from benchmarks.prompt_inputs import WholeRowScan, placing_rows, play
from turnrl.engine.rows import RowTable
from turnrl.models.loading import load_processor


def test_both_ways_make_the_same_prompts_and_the_plain_way_copies_every_kept_image(tiny_vlm_dir):
    tokenizer = load_processor(tiny_vlm_dir).tokenizer
    frame = {"pixel_values": [torch.randn(8, 6).to(torch.bfloat16) for _ in range(3)],
             "image_grid_thw": [torch.tensor([[1, 4, 2]]) for _ in range(3)]}
    _, plain_bytes, plain = play(3, 5, frame, 2, tokenizer, plain=True)
    _, view_bytes, views = play(3, 5, frame, 2, tokenizer, plain=False)
    _, sized_bytes, sized = play(3, 5, frame, 2, tokenizer, plain=False, expected_turns=5)
    assert len(plain) == len(views) == len(sized) == 5
    for a, b, c in zip(plain, views, sized, strict=True):
        assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[key], b[key]) for key in a)
        assert all(torch.equal(a[key], c[key]) for key in a)
    # turn t's prompt holds t + 1 frames of 8 x 6 bf16 values and t + 1 grids of 3 int64: 15 frames an episode
    assert plain_bytes == view_bytes == sized_bytes == 3 * 15 * (8 * 6 * 2 + 3 * 8)
    assert views[-1]["pixel_values"]._is_view() and not plain[-1]["pixel_values"]._is_view()


def test_both_row_tables_place_each_prompt_on_its_episodes_row_reusing_its_last_turn():
    _, whole = placing_rows(WholeRowScan(8), 8, 4, head=20, turn_tokens=12)
    _, first = placing_rows(RowTable(8), 8, 4, head=20, turn_tokens=12)
    assert whole == first and len(first) == 8 * 4
    # the first round takes free rows; every later prompt reuses the row of its episode's previous turn
    assert all(reused == 0 for _, reused in first[:8]) and all(reused > 20 for _, reused in first[8:])
