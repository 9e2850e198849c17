"""RAGEN's trainer: a step whose filter kept nothing is not validated.

Encodes mll-lab-nu/RAGEN at commit 20daedc47558e000f7de912b060646bf2e8026bd, ``ragen/trainer/agent_trainer.py``
(``fit``: when the filtered batch is empty the step logs its metrics and ``continue``s before the
``test_freq`` validation), so such a step adds nothing to the low-success early stop's count.
"""

from __future__ import annotations

from tests.training.trainer_runs import config, step_records
from turnrl.training.commands import train


def test_a_step_whose_filter_kept_nothing_is_not_validated(tiny_model_dir, tmp_path):
    # The untrained model never writes an action: every group's rewards are equal, and the filter drops them all.
    summary = train(config(tiny_model_dir, tmp_path, "algorithm.filter.drop_zero_variance=true", "validation.every=1",
                           "collapse.stop_on_low_success=true", "collapse.low_success_validations=2", "run.steps=3",
                           "run.trajectories_every=0", "sampling.max_new_tokens=4"))
    steps = step_records(tmp_path / "run")
    assert [steps[s]["filter/skipped_step"] for s in sorted(steps)] == [1.0, 1.0, 1.0]
    assert not any("val/success" in record for step, record in steps.items() if step < 3)
    assert summary["steps"] == 3 and "early_stop" not in summary  # two empty steps count no failed validation
