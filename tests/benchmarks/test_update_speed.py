"""The update benchmark's CPU smoke run: next fit against best fit, the passes each cut."""

from __future__ import annotations

import re
import sys

import torch

from benchmarks import update_speed
from turnrl.training.ppo import MicroBatching


def test_next_fit_closes_a_pass_when_the_next_row_overflows_it():
    """Rows of 8, 6, 5 and 4 tokens, budget 12: next fit runs [8], [6, 5], [4] where best fit runs two passes."""
    lengths = torch.tensor([6, 8, 4, 5])
    cut = update_speed.NextFit(1, 12).split(torch.arange(4), lengths)
    assert [part.tolist() for part in cut] == [[1], [0, 3], [2]]
    assert [part.tolist() for part in MicroBatching(1, 12).split(torch.arange(4), lengths)] == [[1, 2], [0, 3]]


def test_the_cpu_smoke_run_prints_each_packed_variants_passes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["update_speed.py", "--preset", "tiny", "--device", "cpu", "--batch", "12",
                                      "--min-len", "40", "--max-len", "300", "--tokens", "512", "--repeats", "1",
                                      "--next-fit", "--no-padded"])
    update_speed.main()
    out = capsys.readouterr().out
    passes = {name: (int(count), int(full)) for name, count, full in
              re.findall(r"^(packed[^:]*), sdpa: .*, (\d+) passes (\d+)% full$", out, re.MULTILINE)}
    assert passes.keys() == {"packed, next fit", "packed"}
    assert passes["packed"][0] <= passes["packed, next fit"][0]
    table = out.split("| variant |")[1].split("\n\n")[0]
    rows = [line.split(" | ")[0] for line in table.splitlines()[2:]]
    assert rows == ["| packed, next fit, sdpa", "| packed, sdpa"]
