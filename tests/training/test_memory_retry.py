"""An RL step out of GPU memory: run again once with half the micro-batches when nothing of it was applied, else
stopped with what to set; and the allocator's settings a GPU run gets before CUDA starts."""

from __future__ import annotations

import os
import re

import pytest
import torch
import yaml
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tests.training.trainer_runs import VOLATILE, actor_weights, config, records, step_records
from turnrl.config import ConfigError
from turnrl.training import ppo
from turnrl.training.commands import train
from turnrl.training.trainer import Trainer

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. If reserved but unallocated memory is large try setting"
PACKED = ["algorithm.advantage=grpo", "algorithm.micro_batch_tokens=512"]


def _steady(record: dict) -> dict:
    """A step's record without the machine's measurements."""
    return {key: value for key, value in record.items() if not key.startswith(VOLATILE) and key != "time"}


def test_an_update_out_of_memory_before_its_first_optimizer_step_runs_again_as_a_run_set_to_half_from_the_start(
        tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The first micro-batch's backward has run (its gradients accumulated) and the random stream moved, as a
    dropout layer would move it, when the error comes: the step runs again with half the tokens on the same
    episodes, from the same random state, and the run then trains as one set to half from the start."""
    half = train(config(tiny_model_dir, tmp_path, *PACKED, "algorithm.micro_batch_tokens=256", name="half"))
    backward, failed = ppo._actor_backward, []

    def out_of_memory_after_the_first_backward(*args, **kwargs):
        values = backward(*args, **kwargs)
        if not failed:
            failed.append(True)
            torch.rand(16)
            raise torch.OutOfMemoryError(OOM)
        return values

    update, states, modes = Trainer.update, [], []

    def update_from(self, step, rollout, keep):
        states.append((step, torch.get_rng_state()))
        modes.append(self.actor.training)
        return update(self, step, rollout, keep)

    monkeypatch.setattr(ppo, "_actor_backward", out_of_memory_after_the_first_backward)
    monkeypatch.setattr(Trainer, "update", update_from)
    retried = train(config(tiny_model_dir, tmp_path, *PACKED, name="retried"))
    out = capsys.readouterr().out
    assert ("RL step 1 ran out of GPU memory before its first optimizer step: running it again on the same episodes "
            "with algorithm.micro_batch_tokens=256, kept for the rest of the run. torch: CUDA out of memory. Tried to "
            "allocate 2.00 GiB.") in " ".join(out.split())
    assert [step for step, _ in states] == [0, 0, 1] and torch.equal(states[0][1], states[1][1])
    assert modes == [False, False, False]  # the retry scores in eval mode, as the first try did
    run, same = step_records(tmp_path / "retried"), step_records(tmp_path / "half")
    assert run[1]["memory/oom_retries"] == 1.0 and "memory/oom_retries" not in run[2]
    assert {step: _steady(record) for step, record in run.items()} == \
        {step: _steady(record) for step, record in same.items()}
    assert [_steady(r) for r in records(tmp_path / "retried")] == [_steady(r) for r in records(tmp_path / "half")]
    weights, expected = actor_weights(tmp_path / "retried"), actor_weights(tmp_path / "half")
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    # Kept: a resume continues with the halved setting, and the summary says when it was halved.
    saved = yaml.safe_load((tmp_path / "retried" / "config.yaml").read_text())
    assert saved["algorithm"]["micro_batch_tokens"] == 256
    assert retried["memory_retries"] == [{"step": 1, "setting": "algorithm.micro_batch_tokens=256"}]
    assert retried["val_success_after_rl"] == half["val_success_after_rl"]


@pytest.mark.parametrize("where", ["rollout", "second optimizer step"])
def test_an_rl_step_out_of_memory_in_its_rollout_or_after_an_optimizer_step_stops_as_before(
        where, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """After an optimizer step the weights are partly updated; in the rollout there are no episodes to reuse:
    the run stops with what to set, and nothing is changed for a resume."""
    steps = []

    def second_step_out_of_memory(optimizer, args, kwargs):
        steps.append(optimizer)
        if len(steps) == 2:
            raise torch.OutOfMemoryError(OOM)

    if where == "rollout":
        monkeypatch.setattr(Trainer, "roll_out", lambda self, step: (_ for _ in ()).throw(torch.OutOfMemoryError(OOM)))
        hook = None
    else:
        hook = register_optimizer_step_pre_hook(second_step_out_of_memory)
    try:
        with pytest.raises(ConfigError) as error:
            train(config(tiny_model_dir, tmp_path, *PACKED, "algorithm.mini_batch_size=2"))
    finally:
        if hook is not None:
            hook.remove()
    assert str(error.value).startswith("RL step 1 ran out of GPU memory: set algorithm.micro_batch_tokens=256; or ")
    assert "running it again" not in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["algorithm"]["micro_batch_tokens"] == 512
    assert step_records(tmp_path / "run") == {}
    assert where == "rollout" or len(steps) == 2  # one optimizer step had run


def test_a_step_that_runs_out_of_memory_again_when_run_again_stops_with_what_to_set(tiny_model_dir, tmp_path,
                                                                                  monkeypatch, capsys):
    score = Trainer.score

    def out_of_memory_in_the_second_step(self, batch, generator):
        if self.first_step + len(step_records(self.run_dir)) >= 1:
            raise torch.OutOfMemoryError(OOM)
        return score(self, batch, generator)

    monkeypatch.setattr(Trainer, "score", out_of_memory_in_the_second_step)
    with pytest.raises(ConfigError) as error:
        train(config(tiny_model_dir, tmp_path, *PACKED, "run.steps=3", "run.save_every=1"))
    run = tmp_path / "run"
    # At 256 tokens no two of the step's sequences share a pass any more: a smaller budget is not what to set.
    said = re.sub(r"holding [\d,]+ tokens", "holding N tokens", str(error.value))
    assert said == (
        "RL step 2 ran out of GPU memory, also when run again with algorithm.micro_batch_tokens=256: set "
        "model.gradient_checkpointing=true; or model.engine.free_during_update=true (smaller passes cannot help: at "
        "algorithm.micro_batch_tokens=256 no two of the step's sequences share a pass, its two shortest holding N "
        "tokens together); then continue from step_000001 with "
        f"`turnrl train resume={run}` and the change. `turnrl memory` estimates each GPU's peak by part. torch: CUDA "
        "out of memory. Tried to allocate 2.00 GiB.")
    assert "running it again on the same episodes with algorithm.micro_batch_tokens=256" in \
        " ".join(capsys.readouterr().out.split())
    assert list(step_records(run)) == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]


def test_a_step_out_of_memory_in_scoring_passes_of_their_own_budget_runs_again_with_that_budget_halved(
        tiny_model_dir, tmp_path, monkeypatch):
    """``algorithm.score_micro_batch_tokens`` packs the scoring passes apart from the update's: a retry that halved
    only the update's passes would run out of memory in the same scoring passes again."""
    score = Trainer.score

    def out_of_memory_in_passes_over_256_tokens(self, batch, generator):
        if self.config.algorithm.score_micro_batch_tokens > 256:
            raise torch.OutOfMemoryError(OOM)
        return score(self, batch, generator)

    monkeypatch.setattr(Trainer, "score", out_of_memory_in_passes_over_256_tokens)
    summary = train(config(tiny_model_dir, tmp_path, *PACKED, "algorithm.score_micro_batch_tokens=512"))
    assert summary["memory_retries"] == [
        {"step": 1, "setting": "algorithm.micro_batch_tokens=256 algorithm.score_micro_batch_tokens=256"}]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["algorithm"]
    assert (saved["micro_batch_tokens"], saved["score_micro_batch_tokens"]) == (256, 256)
    assert list(step_records(tmp_path / "run")) == [1, 2]


def test_a_gpu_run_sets_the_allocator_before_it_starts_and_a_cpu_run_leaves_it(tiny_model_dir, tmp_path, monkeypatch):
    """``model.device=auto`` may be a GPU: the variable is set (with no GPU here it changes nothing); ``cpu`` never
    touches it. The user's variable is left as it is."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    short = ["run.steps=1", "algorithm.advantage=grpo"]
    train(config(tiny_model_dir, tmp_path, *short, name="cpu"))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    train(config(tiny_model_dir, tmp_path, *short, "model.device=auto", name="auto"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    train(config(tiny_model_dir, tmp_path, *short, "model.device=auto", name="users"))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


def test_a_step_whose_sequences_share_no_pass_is_not_run_again_and_says_smaller_passes_cannot_help(
        tiny_model_dir, tmp_path, monkeypatch):
    """No two of the step's sequences fit the update's 16-token budget together, so each pass holds one already: a
    retry at 8 tokens would run out of memory in the same one-sequence passes. The step is not run again, and the
    error says why instead of naming a smaller budget."""
    def out_of_memory(self, batch, generator):
        raise torch.OutOfMemoryError(OOM)

    monkeypatch.setattr(Trainer, "score", out_of_memory)
    with pytest.raises(ConfigError) as error:
        train(config(tiny_model_dir, tmp_path, "algorithm.micro_batch_tokens=16", "run.steps=1"))
    said = str(error.value)
    assert said.startswith("RL step 1 ran out of GPU memory: set model.gradient_checkpointing=true; "), said
    assert "micro_batch_tokens=8" not in said and "also when run again" not in said
    assert "(smaller passes cannot help: at algorithm.micro_batch_tokens=16 no two of the step's sequences share a " \
           "pass, its two shortest holding " in said
