"""benchmarks/trace_export.py: both exports of the same work, timed, and the fast one's file readable."""

from __future__ import annotations

import re
import sys

from benchmarks import trace_export


def test_both_exports_are_timed_and_compared(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["trace_export.py", "--passes", "5", "--rounds", "1"])
    trace_export.main()
    out = capsys.readouterr().out
    assert re.search(r"torch's \.gz export: [\d.]+ s, [\d.]+ MiB", out), out
    assert re.search(r"export_compressed: +[\d.]+ s, [\d.]+ MiB", out), out
    assert re.search(r"ratio: [\d.]+x faster, the file [\d.]+x the size", out), out
