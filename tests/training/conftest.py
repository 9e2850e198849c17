"""Fixtures of the training tests: runs without their report's curves, and the one-process run that the FSDP2, Ray
and asynchronous runs equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.reference_run import train_in_process


@pytest.fixture(scope="module", autouse=True)
def no_report_curves():
    """The runs of these tests in this process write their report (``report.html``) without its PNG curves
    (``plots/``), as they write no TensorBoard files (``run.tensorboard=false``): no test here looks at them, and
    matplotlib drew them in about half of a short run's time (0.5 s of a core, in some 150 runs). The curves of real
    runs are still drawn by the quickstart recipes' runs (tests/test_recipes.py), by the runs here that start a process of
    their own, and by tests/viz/, which reads them."""
    from turnrl.viz import report

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "draw_training_curves", lambda records, out_dir, sft_records=None: [])
        yield


@pytest.fixture(scope="session")
def single(tiny_model_dir, once_per_run) -> Path:
    """Two PPO steps on one process (:mod:`tests.training.reference_run`'s settings): the run the two-process,
    Ray and asynchronous runs of the same settings equal (read, never changed, by the tests; run once for all the
    pytest-xdist workers)."""
    return once_per_run("reference", lambda out: train_in_process(tiny_model_dir, out, "single", "run.steps=2")) / \
        "single"
