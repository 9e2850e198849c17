"""benchmarks/vision_attention.py --mlp: the compiled tower with its MLPs' own forward and the aligned one, on the
same weights, over image counts that change from pass to pass (CPU, the tiny VLM at an unaligned MLP width)."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from benchmarks import vision_attention


def mlp_args(width: int | None) -> argparse.Namespace:
    return argparse.Namespace(preset="vlm-tiny", vision_mlp_width=width, images=9, new_counts=2, size=112)


def test_the_mlp_rows_refuse_a_tower_whose_mlps_are_aligned_already():
    with pytest.raises(SystemExit, match="aligned already: nothing to compare"):
        vision_attention.mlp_rows(mlp_args(None), torch.device("cpu"))


@pytest.mark.slow  # compiles the tower's parts on the CPU: about 15 s
def test_the_mlp_rows_time_both_forwards_and_their_features_agree(capsys):
    rows = vision_attention.mlp_rows(mlp_args(120), torch.device("cpu"))
    assert [label.rsplit(", ", 1)[1] for label, _ in rows] == ["its MLPs' own forward", "its MLPs aligned"]
    assert all(seconds > 0 for _, seconds in rows)
    difference = float(re.search(r"largest difference of the features: (\S+)", capsys.readouterr().out).group(1))
    assert difference < 1e-4  # float32: the padded units add zeros
