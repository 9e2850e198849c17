"""Fixtures of the training tests: the one-process run that the FSDP2, Ray and asynchronous runs equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.reference_run import train_in_process


@pytest.fixture(scope="session")
def single(tiny_model_dir, tmp_path_factory) -> Path:
    """Two PPO steps on one process (:mod:`tests.training.reference_run`'s settings): the run the two-process,
    Ray and asynchronous runs of the same settings equal (read, never changed, by the tests)."""
    return train_in_process(tiny_model_dir, tmp_path_factory.mktemp("reference"), "single", "run.steps=2")
