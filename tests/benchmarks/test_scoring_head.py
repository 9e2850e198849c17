"""The scoring-head benchmark runs both passes and the compiled head computes what the eager one does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.scoring_head import score

ROOT = Path(__file__).resolve().parents[2]


def test_a_pass_returns_the_log_probs_entropies_and_the_states_gradient_only_with_gradients():
    generator = torch.Generator().manual_seed(0)
    states, weight = torch.randn(6, 8, generator=generator), torch.randn(20, 8, generator=generator)
    targets = torch.randint(0, 20, (6,), generator=generator)
    logprobs, entropy, grad = score(states, weight, targets, torch.ones(2, 6), compiled=False, chunk=4)
    assert logprobs.shape == entropy.shape == (6,) and grad is not None and grad.shape == states.shape
    assert (logprobs <= 0).all() and (entropy >= 0).all()
    assert score(states, weight, targets, None, compiled=False, chunk=4)[2] is None


@pytest.mark.slow  # compiles on the CPU: 20-40 s
def test_the_benchmark_prints_both_passes_and_the_compiled_head_agrees():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scoring_head.py"), "--device", "cpu",
                           "--tokens", "64", "--hidden", "32", "--vocab", "1000", "--chunk", "24", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in done.stdout.splitlines()
            if line.startswith("| ") and "x |" in line}
    assert set(rows) == {"forward and backward", "forward"}
    assert all(float(difference) < 1e-2 for difference in rows.values())  # bf16 gradients: one rounding apart
