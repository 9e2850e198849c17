"""The estimator benchmarks' runs side by side on one card: each capped to its share of the GPU's memory."""

from __future__ import annotations

from benchmarks.estimators import sharing_the_card
from turnrl.config import load_config
from turnrl.training.config import TrainConfig


def test_runs_played_at_once_each_get_their_share_and_an_explicit_share_wins():
    assert sharing_the_card(1, ["run.steps=3"]) == ["run.steps=3"]
    shared = sharing_the_card(3, ["run.steps=3"])
    assert load_config(TrainConfig, "configs/quickstart.yaml", shared).run.gpu_share == 0.3333
    explicit = sharing_the_card(3, ["run.gpu_share=0.5"])
    assert load_config(TrainConfig, "configs/quickstart.yaml", explicit).run.gpu_share == 0.5
