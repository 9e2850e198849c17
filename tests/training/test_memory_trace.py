"""The allocator trace's replay (its peak above the start, what was live then, by the line that made it), the
recorder as a no-op on a CPU, and on a GPU a recorded step's report."""

from __future__ import annotations

import pytest
import torch

from turnrl.config import ConfigError, load_config
from turnrl.training.train_config import TrainConfig
from turnrl.training.memory_trace import explained, live_at_peak, made_at, peak_report, phase_spans, recorded


def event(action: str, addr: int, size: int, where: str = "turnrl/engine/engine.py", phase: str = "step") -> dict:
    return {"action": action, "addr": addr, "size": size,
            "frames": [{"filename": "/usr/lib/python3/torch/functional.py", "line": 1, "name": "f"},
                       {"filename": f"/site/{where}", "line": 7, "name": "g"},
                       {"filename": "/site/turnrl/training/trainer.py", "line": 9, "name": phase}]}


def test_the_peak_and_its_live_allocations_come_from_replaying_the_trace():
    events = [
        event("alloc", 1, 100), event("alloc", 2, 50, "transformers/models/x.py"),
        event("segment_alloc", 9, 4096),  # the allocator's own reservations are not allocations
        event("free_requested", 1, 100), event("free_completed", 1, 100),
        event("alloc", 3, 120),  # 170: the peak, with 2 and 3 live
        event("free_completed", 77, 500),  # a block allocated before the trace began, freed: below the start
        event("alloc", 4, 400),  # 170 - 500 + 400 = 70: below the peak
    ]
    peak, live = live_at_peak(events)
    assert peak == 170
    assert [e["addr"] for e in live] == [3, 2]  # largest first
    assert made_at(live[1]) == "transformers/models/x.py:7 g"
    assert made_at({"frames": [{"filename": "/torch/a.py", "line": 1, "name": "h"}]}).startswith("(outside")
    lines = peak_report(events)
    assert lines[0].startswith("step: peak 0.00 GiB")
    assert lines[1].endswith("turnrl/engine/engine.py:7 g") and lines[2].endswith("transformers/models/x.py:7 g")


def test_each_phase_has_its_own_peak_counted_from_the_start_of_the_trace():
    events = [
        event("alloc", 1, 300, phase="roll_out"), event("alloc", 2, 200, phase="roll_out"),  # 500: the rollout's
        event("free_completed", 2, 200, phase="roll_out"),
        event("alloc", 3, 100, phase="update"), event("alloc", 4, 50, phase="update"),  # 450: the update's
        event("free_completed", 4, 50, phase="update"),
    ]
    assert live_at_peak(events)[0] == 500
    spans = phase_spans(events, ["roll_out", "update", "validate"])
    assert spans == {"roll_out": (0, 2), "update": (3, 5)}
    span = spans["update"]
    peak, live = live_at_peak(events, span)
    assert peak == 450 and [e["addr"] for e in live] == [1, 3, 4]  # the rollout's block 1 still live
    headings = [line.split(":")[0] for line in peak_report(events, top=1) if not line.startswith(" ")]
    assert headings == ["step", "roll_out", "update"]


def test_nothing_is_recorded_on_a_cpu_and_the_setting_is_checked(tmp_path):
    with recorded(tmp_path / "rank0_step1.pickle", torch.device("cpu")):
        torch.zeros(1000)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ConfigError, match="run.memory_snapshot_steps"):
        load_config(TrainConfig, "configs/quickstart.yaml", ["run.memory_snapshot_steps=-1"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_recorded_step_names_what_was_live_at_its_peak(tmp_path):
    device = torch.device("cuda")
    path = tmp_path / "rank0_step1.pickle"
    with recorded(path, device):
        kept = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # 64 MiB, live at the peak
        passing = torch.empty(32 * 2**20, dtype=torch.uint8, device=device)
        del passing
    assert path.is_file()
    report = path.with_suffix(".txt").read_text().splitlines()
    assert "tests/training/test_memory_trace.py" in report[1] or "outside" in report[1]
    assert float(report[0].split()[2]) >= 0.09  # 96 MiB at once
    del kept


def test_torchs_recorder_bug_is_said_with_what_to_change_and_other_errors_pass_as_they_are(tmp_path):
    path = tmp_path / "memory" / "rank0_step1.pickle"
    bug = SystemError("<built-in method apply of FunctionMeta object at 0xb0d38060> returned NULL without setting an "
                      "exception")
    said = explained(bug, path)
    assert isinstance(said, RuntimeError) and "pytorch/pytorch#179536" in str(said)
    assert str(path.with_suffix(".txt")) in str(said) and "model.compile=false" in str(said)
    other = SystemError("something else")
    assert explained(other, path) is other
    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert explained(oom, path) is oom
