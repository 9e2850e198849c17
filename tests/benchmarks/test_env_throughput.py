"""The environment-throughput benchmark's command line: the documented row runs, or says what to do first."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import env_throughput


def test_an_interpreter_not_built_yet_is_named_before_anything_is_measured(tmp_path: Path, monkeypatch, capsys):
    measured: list[float] = []

    def measure(seconds: float) -> list[env_throughput.Row]:
        measured.append(seconds)
        return []

    monkeypatch.setattr(env_throughput, "measure_turnrl", measure)
    missing = tmp_path / ".venv-gym-sokoban" / "bin" / "python"
    with pytest.raises(SystemExit) as exit_info:
        env_throughput.main(["--quick", "--gym-sokoban-python", str(missing)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"{missing}: no such interpreter" in error and "pip install gym-sokoban" in error
    assert measured == []
