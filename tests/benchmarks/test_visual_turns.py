"""The visual-turns benchmark plays a step's turns through the rollout, and its remembered turns make what its
turns made every time make."""

from __future__ import annotations

import torch

from benchmarks.visual_turns import rollout_turns, turn_work
from turnrl.chat.template_deltas import ChatTemplateDeltas
from turnrl.models.loading import load_processor
from turnrl.models.vision import ImageEncoder, content_digest


def test_remembered_turns_make_what_turns_made_every_time_make(tiny_vlm_dir):
    processor = load_processor(tiny_vlm_dir)
    turns = rollout_turns(groups=2, group_size=4, noise=0.0, seed=7)
    frames = {content_digest([image]) for _, image, _ in turns}
    assert 2 <= len(frames) < len(turns)  # two levels; a group's four episodes play alike
    plain = ImageEncoder(processor, torch.bfloat16, cache_bytes=0)
    kept = ImageEncoder(processor, torch.bfloat16)
    *_, every_time = turn_work(plain, ChatTemplateDeltas(processor.tokenizer, memo_size=0), turns)
    *_, remembered = turn_work(kept, ChatTemplateDeltas(processor.tokenizer), turns)
    for (inputs, ids), (kept_inputs, kept_ids) in zip(every_time, remembered, strict=True):
        assert ids == kept_ids and inputs.keys() == kept_inputs.keys()
        assert all(torch.equal(inputs[key], kept_inputs[key]) for key in inputs)
    assert plain.images_processed == len(turns) and kept.images_processed == len(frames)
