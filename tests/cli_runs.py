"""Running the ``turnrl`` command in tests: in process (its exit code and output, or its one-line error) and as a
real subprocess."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnrl.cli import main

TURNRL = Path(sys.executable).parent / "turnrl"
QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def run_main(argv, monkeypatch, capsys, stdin: str = ""):
    """Run ``turnrl argv`` in process with ``stdin``; returns (exit code, stdout)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(argv)
    return code, capsys.readouterr().out


def error_exit(argv) -> str:
    """The message of a command that must stop with a clean error (no traceback)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert message.startswith("error: "), message
    return message


def run_turnrl(*args: str, stdin: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="80", OMP_NUM_THREADS="1")
    return subprocess.run(
        [str(TURNRL), *args], input=stdin, capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )

