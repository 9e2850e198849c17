"""The estimator benchmarks' runs side by side on one card: each capped to its share of the GPU's memory."""

from __future__ import annotations

import os

from benchmarks.estimators import sharing_the_card
from turnrl.config import load_config
from turnrl.training.train_config import TrainConfig


def test_runs_played_at_once_each_get_their_share_and_an_explicit_share_wins():
    assert sharing_the_card(1, ["run.steps=3"]) == ["run.steps=3"]
    shared = sharing_the_card(3, ["run.steps=3"])
    assert load_config(TrainConfig, "configs/quickstart.yaml", shared).run.gpu_share == 0.3333
    dealt = sharing_the_card(6, ["run.steps=3"], ["2", "3"])  # three runs a card
    assert load_config(TrainConfig, "configs/quickstart.yaml", dealt).run.gpu_share == 0.3333
    explicit = sharing_the_card(3, ["run.gpu_share=0.5", "run.threads=7"])
    assert load_config(TrainConfig, "configs/quickstart.yaml", explicit).run.gpu_share == 0.5
    assert load_config(TrainConfig, "configs/quickstart.yaml", explicit).run.threads == 7


def test_runs_played_at_once_share_the_hosts_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert load_config(TrainConfig, "configs/quickstart.yaml", sharing_the_card(6, [], ["2", "3"])).run.threads == 10
    assert load_config(TrainConfig, "configs/quickstart.yaml", sharing_the_card(128, [])).run.threads == 1
    assert sharing_the_card(1, []) == []  # one run keeps torch's default


def test_runs_dealt_to_gpus_never_crowd_a_card_past_its_share():
    import threading
    import time
    from collections import Counter

    from benchmarks.estimators import runs_per_card, spread_over_cards

    assert runs_per_card(6, ["2", "3"]) == 3
    assert runs_per_card(5, ["0", "1"]) == 3
    assert runs_per_card(4, []) == 4
    lock = threading.Lock()
    playing: Counter[str] = Counter()
    most: Counter[str] = Counter()

    def run(job: int, env: dict[str, str]) -> tuple[int, str]:
        card = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            playing[card] += 1
            most[card] = max(most[card], playing[card])
        time.sleep(0.002 * (job % 3))  # runs end out of order, so slots are handed on unevenly
        with lock:
            playing[card] -= 1
        return job, card

    results = spread_over_cards(list(range(20)), 4, ["2", "3"], run)
    assert [job for job, _ in results] == list(range(20))
    assert set(most) == {"2", "3"} and max(most.values()) <= 2
    unplaced = spread_over_cards([0, 1], 2, [], lambda job, env: env == dict(os.environ))
    assert unplaced == [True, True]  # no GPUs named: every run sees the environment as it is
