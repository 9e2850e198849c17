"""turnrl/training/device_idle.py: a trace's idle device time, charged to the host's Python frames at each moment,
by phase (the engine's ranges, the trainer's methods), and a run's traced steps."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from turnrl.training.device_idle import device_idle, frame_name, merged, read_trace


def event(category: str, name: str, start: float, duration: float, thread: int = 1) -> dict:
    return {"ph": "X", "cat": category, "name": name, "ts": start, "dur": duration, "tid": thread, "pid": 1}


def trace() -> list[dict]:
    """Kernels busy over 0-100 and 300-400, 500-600; idle over 100-300 (the host in the tower's attention, inside
    SDPA, within a prefill) and 400-500 (the host in an env step, outside the engine's ranges)."""
    tower = "/site-packages/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py(354): forward"
    attention = "/repo/turnrl/models/vision_attention.py(99): chunked_attention"
    return [
        event("kernel", "gemm", 0, 100, thread=7), event("kernel", "gemm", 300, 60, thread=7),
        event("kernel", "norm", 350, 50, thread=7), event("kernel", "gemm", 500, 100, thread=7),
        event("cuda_runtime", "cudaLaunchKernel", 0, 5), event("cuda_runtime", "cudaLaunchKernel", 290, 5),
        event("cuda_runtime", "cudaLaunchKernel", 99, 5, thread=2),
        event("user_annotation", "engine.prefill", 0, 400),
        event("python_function", tower, 50, 300), event("python_function", attention, 90, 220),
        event("python_function", "<built-in function scaled_dot_product_attention>", 95, 210),
        event("python_function", "/repo/turnrl/rollout/runner.py(376): _act", 380, 130),
        event("python_function", "/repo/turnrl/rollout/runner.py(376): _act", 100, 400, thread=2),  # another thread
    ]


def test_idle_stretches_are_charged_to_the_innermost_project_frame_and_builtin_call_by_phase():
    idle = device_idle(trace())
    assert (idle.span_us, idle.busy_us, idle.launches, idle.idle_us) == (600, 300, 4, pytest.approx(300))
    assert idle.kernels == {"gemm": 260, "norm": 50}
    assert idle.by_frame["prefill"] == {
        "turnrl/models/vision_attention.py:chunked_attention > function scaled_dot_product_attention":
            pytest.approx(200)}
    assert idle.by_frame["between"] == {"turnrl/rollout/runner.py:_act": pytest.approx(100)}
    assert not idle.by_frame["decode"]
    lines = idle.lines(top=5)
    assert lines[0] == "device idle: 0.00 s of a 0.00 s span (0.00 s of 4 kernels)"
    assert any("chunked_attention" in line for line in lines)
    assert lines[-3:] == ["the 2 costliest kernels:", "    0.000 s  gemm", "    0.000 s  norm"]


def test_outside_the_engines_ranges_the_trainers_method_names_the_phase():
    """Idle time in a step's update or scores is charged there, whatever the frames below (the innermost
    trainer method counts: a rollout inside nothing else is the rollout)."""
    events = [event("kernel", "gemm", 0, 10), event("kernel", "gemm", 110, 10), event("kernel", "gemm", 220, 10),
              event("python_function", "/r/turnrl/training/trainer.py(900): train_on", 5, 110),
              event("python_function", "/r/turnrl/training/ppo.py(10): ppo_epochs", 6, 108),
              event("python_function", "/r/turnrl/training/trainer.py(893): score", 115, 110)]
    idle = device_idle(events)
    assert idle.by_frame["update"] == {"turnrl/training/ppo.py:ppo_epochs": pytest.approx(100)}
    assert idle.by_frame["scores"] == {"turnrl/training/trainer.py:score": pytest.approx(100)}


def test_a_trace_without_kernels_has_no_idle_time_and_names_are_shortened(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": [event("cpu_op", "aten::mm", 0, 10)]}, file)
    idle = device_idle(read_trace(path))
    assert idle.launches == 0 and not idle.kernels and idle.idle_us == 0
    assert frame_name("/x/site-packages/transformers/vision_utils.py(81): get_vision_position_ids") == \
        "transformers/vision_utils.py:get_vision_position_ids"
    assert frame_name("/usr/lib/python3.11/threading.py(10): run") is None
    assert merged([(5, 9), (0, 3), (2, 4), (9, 10)]) == [(0, 4), (5, 10)]


def test_a_step_to_trace_is_counted_from_one():
    from turnrl.config import ConfigError, load_config
    from turnrl.training.train_config import TrainConfig

    with pytest.raises(ConfigError, match="run.profile_steps"):
        load_config(TrainConfig, "configs/quickstart.yaml", ["run.profile_steps=[2,0]"])
    assert load_config(TrainConfig, "configs/quickstart.yaml", ["run.profile_steps=[3]"]).run.profile_steps == [3]


def test_a_traced_block_writes_its_trace_and_reading_and_a_large_one_the_command_to_read_it(tmp_path, monkeypatch):
    from turnrl.training import device_idle as module

    def work() -> None:
        torch.ones(64, 64).matmul(torch.ones(64, 64))

    with module.profiled(tmp_path / "small", torch.device("cpu")):
        work()
    assert (tmp_path / "small.txt").read_text().startswith("device idle: 0.00 s")
    assert any(e.get("cat") == "python_function" for e in read_trace(tmp_path / "small.json.gz"))
    monkeypatch.setattr(module, "READ_IN_RUN_BYTES", 10)
    with pytest.raises(RuntimeError, match="the block failed"):
        with module.profiled(tmp_path / "large", torch.device("cpu")):
            work()
            raise RuntimeError("the block failed")  # its trace is written all the same
    assert "python -m turnrl.training.device_idle" in (tmp_path / "large.txt").read_text()
    assert (tmp_path / "large.json.gz").stat().st_size > 10
    # Compressed at gzip's fastest level (its header's flag 4; torch's own export writes the strongest, 2), and the
    # plain JSON it was written from is gone.
    assert (tmp_path / "small.json.gz").read_bytes()[8] == 4
    assert sorted(path.name for path in tmp_path.iterdir()) == ["large.json.gz", "large.txt", "small.json.gz",
                                                                "small.txt"]
