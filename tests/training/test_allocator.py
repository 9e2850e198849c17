"""Torch's CUDA allocator for a run: the settings a run gets, how they are read, the margin they leave, and the cap
on a shared card."""

from __future__ import annotations

import pytest
import torch

from turnrl.config import load_config
from turnrl.training.allocator import (
    GIB,
    allocator_margin,
    allocator_settings,
    cap_gpu_memory,
    expandable_segments,
    run_margin,
    set_allocator_settings,
)
from turnrl.training.train_config import TrainConfig

H200 = 139.8 * GIB


def test_the_users_allocator_variable_wins_and_a_gpu_run_sets_expandable_segments_otherwise():
    config = load_config(TrainConfig, None, [])
    assert config.run.cuda_alloc_conf == "expandable_segments:True"
    environ: dict[str, str] = {}
    line = set_allocator_settings(config, environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert line == ("CUDA allocator: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (run.cuda_alloc_conf; set the "
                    "variable to choose otherwise)")
    for users in ({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
                  {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "x"}):
        environ = dict(users)
        variable = next(iter(users))
        assert set_allocator_settings(config, environ) == (f"CUDA allocator: {variable}={users[variable]} from the "
                                                           "environment (it wins over run.cuda_alloc_conf)")
        assert environ == users and allocator_settings(config, environ) == (users[variable], variable)
    cpu = load_config(TrainConfig, None, ["model.device=cpu"])
    environ = {}
    assert set_allocator_settings(cpu, environ) is None and environ == {}
    none = load_config(TrainConfig, None, ["run.cuda_alloc_conf=''"])
    assert set_allocator_settings(none, environ) is None and environ == {}
    # The margin follows what the run gets: the user's variable over the config.
    assert run_margin(config, H200, {}) == allocator_margin(H200, expandable=True)
    assert run_margin(config, H200, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) == \
        allocator_margin(H200, expandable=False)
    assert run_margin(none, H200, {}) == allocator_margin(H200, expandable=False)


@pytest.mark.parametrize("settings, expandable", [
    ("expandable_segments:True", True), ("max_split_size_mb:128, expandable_segments:True", True),
    ("expandable_segments:False", False), ("", False), ("backend:cudaMallocAsync", False),
    ("garbage_collection_threshold:0.6,expandable_segments:True,max_split_size_mb:256", True)])
def test_expandable_segments_are_read_as_torch_reads_its_settings(settings, expandable):
    assert expandable_segments(settings) is expandable


def test_the_cap_of_a_shared_card_names_the_card_by_index_as_torch_needs(monkeypatch):
    capped = []

    def set_fraction(share: float, device: int | torch.device) -> None:  # torch's own check of its argument
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        capped.append((share, device))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    cap_gpu_memory(0.25, torch.device("cuda"))  # a run's device as ``model.device=cuda`` resolves it
    cap_gpu_memory(0.5, torch.device("cuda:1"))
    assert capped == [(0.25, 2), (0.5, 1)]
