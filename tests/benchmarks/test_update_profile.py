"""The update profile under torchrun: two gloo processes profile the FSDP trainer's sharded update."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
