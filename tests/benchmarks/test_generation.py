"""The generation benchmark's command line: a row it cannot leave out is an error, not a row silently run."""

from __future__ import annotations

import sys

import pytest

from benchmarks import generation


def test_a_misspelt_row_to_skip_is_an_error_before_the_model_is_built(monkeypatch, capsys):
    built: list[str] = []

    def build(preset: str, *args: object) -> None:
        built.append(preset)
        raise AssertionError("the model was built: the misspelt --skip was accepted")

    monkeypatch.setattr(generation, "build", build)
    monkeypatch.setattr(sys, "argv", ["generation.py", "--quick", "--skip", "generate-batch"])
    with pytest.raises(SystemExit) as exit_info:
        generation.main()
    assert exit_info.value.code == 2
    assert "invalid choice: 'generate-batch'" in capsys.readouterr().err
    assert built == []
