"""The VLM update benchmark's CPU smoke run: three variants (and fewer layers recomputed), and episodes that end
apart."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import vlm_update_speed


def test_the_cpu_smoke_run_prints_the_three_variants(monkeypatch, capsys):
    """``--quick`` is the CPU smoke run; a flag given beside it still counts (here a smaller batch)."""
    monkeypatch.setattr(sys, "argv", ["vlm_update_speed.py", "--quick", "--batch", "3", "--image-size", "56"])
    vlm_update_speed.main()
    out = capsys.readouterr().out
    assert "vlm-tiny: 3 episodes of up to 3 turns (56px images" in out
    table = out.split("| variant |")[1]
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [row[0] for row in rows] == ["| padded", "| packed", "| packed, features once"]
    assert all(row[4] == "n/a" for row in rows)  # no bf16 peak on a CPU: no MFU, rather than nan


def test_fewer_recomputed_layers_are_variants_of_their_own_and_need_checkpointing(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["vlm_update_speed.py", "--quick", "--batch", "2", "--image-size", "56",
                                      "--checkpointed-layers", "1"])
    vlm_update_speed.main()
    rows = [row.split(" | ") for row in capsys.readouterr().out.split("| variant |")[1].splitlines()[2:]]
    assert [row[0] for row in rows][-1] == "| packed, features once, 1 of 2 layers recomputed"
    assert float(rows[-1][-1].removesuffix("x |")) > 0  # its training pass against every layer recomputed
    for wrong, said in ((["--no-checkpointing", "--checkpointed-layers", "1"], "drop --no-checkpointing"),
                        (["--checkpointed-layers", "3"], "vlm-tiny has 2 decoder layers")):
        monkeypatch.setattr(sys, "argv", ["vlm_update_speed.py", "--quick", *wrong])
        with pytest.raises(SystemExit):
            vlm_update_speed.main()
        assert said in capsys.readouterr().err


def test_episodes_end_between_the_least_and_the_most_turns():
    model = vlm_update_speed.build("vlm-tiny", torch.device("cpu"), 1024, checkpointing=False)
    batch = vlm_update_speed.episodes(model, 12, 5, 56, 3, 4, 1024, min_turns=2)
    images = batch.model_input_rows["image_grid_thw"]
    assert images.min() >= 2 and images.max() <= 5 and len(set(images.tolist())) > 1
    assert int(batch.loss_mask.sum()) == 4 * int(images.sum())  # a scored response a turn
