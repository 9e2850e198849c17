"""The update profile under torchrun: two gloo processes profile the FSDP trainer's sharded update."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import update_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two torchrun processes, 14 s on two cores
def test_two_processes_profile_the_sharded_update_and_rank_0_prints(tiny_model_dir):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               str(ROOT / "benchmarks" / "update_profile.py"), "--steps", "1", "--top", "40",
               f"model.path={tiny_model_dir}", "model.device=cpu", "model.dtype=float32", "env.id=FrozenLake",
               "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=4", "groups.group_size=2",
               "run.threads=1", "sft.enabled=false", "run.tensorboard=false"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("step 0:") == 1  # rank 0 alone prints
    assert "process 0 of 2" in done.stdout and "FSDP::all_gather" in done.stdout  # the sharded update's gathers


def kernel(name: str, start_us: float, duration_us: float, stream: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start_us, "dur": duration_us, "args": {"stream": stream}}


def test_the_kernel_timeline_counts_each_busy_moment_once_and_finds_the_waits(tmp_path):
    """Compute kernels on two streams overlap (counted once), a gather runs beside them and alone, and the
    compute stream waits 3 ms and 0.5 ms (only the first is a gap of 1 ms or more); host events are ignored."""
    trace = {"traceEvents": [
        kernel("nvjet_gemm", 0, 1000, 7), kernel("vectorized_elementwise", 500, 1000, 8),  # 0-1.5 ms
        kernel("ncclDevKernel_AllGather_RING_LL", 1000, 3000, 20),                          # 1-4 ms
        kernel("flash_fwd", 4500, 500, 7),                                                  # after a 3 ms gap
        kernel("nvjet_gemm", 5500, 1500, 7),                                                # after 0.5 ms
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},
    ]}
    times = update_profile.kernel_timeline(trace)
    expected = {"span": 7e-3, "compute": 3.5e-3, "collectives": 3e-3, "both": 0.5e-3, "gaps": 3e-3,
                "gap_count": 1, "gap_longest": 3e-3}
    assert times.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(times[key] - value) < 1e-9, key
    assert "compute 0.00 s (50%)" in update_profile.timeline_line(times)
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump(trace, file)
    assert update_profile.read_trace(path) == trace
    assert update_profile.kernel_timeline({"traceEvents": [trace["traceEvents"][-1]]}) == {}  # no kernels: nothing
