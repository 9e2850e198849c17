"""The rotary benchmark's baseline is the rotary embedding the trainer runs, and its variants compute the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.rotary import rotary_for_attention

ROOT = Path(__file__).resolve().parents[2]


def test_the_baseline_is_the_rotary_formula_in_float32_then_cast_for_attention():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 12, 8, generator=generator).bfloat16()
    k = torch.randn(1, 2, 12, 8, generator=generator).bfloat16()
    cos, sin = torch.randn(1, 12, 8, generator=generator), torch.randn(1, 12, 8, generator=generator)

    def rotated(x: torch.Tensor) -> torch.Tensor:  # x cos + rotate_half(x) sin, in float32, per head
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1).float()
        return (x.float() * cos[:, None] + turned * sin[:, None]).bfloat16()

    got_q, got_k = rotary_for_attention(q, k, cos, sin)
    assert got_q.dtype == got_k.dtype == torch.bfloat16
    assert torch.equal(got_q, rotated(q)) and torch.equal(got_k, rotated(k))


@pytest.mark.slow  # compiles on the CPU: 10-20 s
def test_the_benchmark_prints_each_variant_and_the_compiled_one_computes_the_same():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rotary.py"), "--device", "cpu", "--tokens",
                           "64", "--repeats", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in done.stdout.splitlines()
            if line.startswith("| ") and "x |" in line}
    assert rows["eager, float32 cos"] == rows["compiled"] == rows["CompiledRotary"] == "0"  # the same, fused
    assert float(rows["eager, bf16 cos"]) > 0  # bf16 rounds otherwise
