"""The VLM update benchmark's CPU smoke run: three variants, and episodes that end apart."""

from __future__ import annotations

import sys

import torch

from benchmarks import vlm_update_speed


def test_the_cpu_smoke_run_prints_the_three_variants(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["vlm_update_speed.py", "--preset", "vlm-tiny", "--device", "cpu", "--batch", "3",
                                      "--images", "2", "--image-size", "56", "--text", "4", "--response", "5",
                                      "--rows", "2", "--tokens", "256", "--repeats", "1"])
    vlm_update_speed.main()
    table = capsys.readouterr().out.split("| variant |")[1]
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == [
        "| padded", "| packed", "| packed, features once"]


def test_episodes_end_between_the_least_and_the_most_turns():
    model = vlm_update_speed.build("vlm-tiny", torch.device("cpu"), 1024, checkpointing=False)
    batch = vlm_update_speed.episodes(model, 12, 5, 56, 3, 4, 1024, min_turns=2)
    images = batch.model_input_rows["image_grid_thw"]
    assert images.min() >= 2 and images.max() <= 5 and len(set(images.tolist())) > 1
    assert int(batch.loss_mask.sum()) == 4 * int(images.sum())  # a scored response a turn
