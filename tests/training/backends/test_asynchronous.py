"""The asynchronous backend in the trainer on the tiny model: staleness 0 is the synchronous run, staleness 1
overlaps and corrects with truncated importance weights, failures surface in the trainer, the engine follows the
copy, a validation's episodes play inside its exclusive hold, no memory peak of a rollout it did not measure; and
``turnrl train distributed.async_rollout=true`` with no staleness is the one-process run."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tests.training.reference_run import assert_same_metrics, step_records, train_in_process
from tests.training.trainer_runs import COMMON as TRAINER_COMMON
from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, ConfigError, SamplingConfig, load_config
from turnrl.engine.llm_engine import weights_version
from turnrl.envs import make
from turnrl.envs.seeds import SeedSplits
from turnrl.policy.engine import EnginePolicy
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import Trajectory
from turnrl.training.backends.asynchronous import (
    AsyncRollout,
    RolloutThreadError,
    let_compiled_code_run_beside_traces,
)
from turnrl.training.backends.local import LocalRollout
from turnrl.training.train_config import TrainConfig
from turnrl.training.step_episodes import StepOutput
from turnrl.training.trainer import Trainer, rollout_memory_metrics

COMMON = [*TRAINER_COMMON, "run.steps=3"]  # the trainer tests' short FrozenLake run, one step longer
TIS = ["algorithm.old_logprobs=recompute", "algorithm.tis_cap=2.0"]
# Measurements of the machine, and what only the async trainer reports.
VOLATILE = ("timing/", "throughput/", "startup/", "memory/", "async/")


def config(model_dir: Path, out: Path, *overrides: str, name: str = "run") -> TrainConfig:
    return load_config(TrainConfig, None, [*COMMON, f"model.path={model_dir}", f"run.output_dir={out}",
                                           f"run.name={name}", *overrides])


def async_config(model_dir: Path, out: Path, staleness: int, *overrides: str, name: str = "async") -> TrainConfig:
    return config(model_dir, out, "distributed.async_rollout=true", f"distributed.max_staleness={staleness}",
                  *overrides, name=name)


def comparable(output: StepOutput) -> tuple[dict[str, float], list[dict]]:
    metrics = {k: v for k, v in output.metrics.items() if not k.startswith(VOLATILE)}
    return metrics, [t.to_json() for t in output.trajectories]


def assert_close(one: object, two: object, where: str = "") -> None:
    """``one`` and ``two`` (metrics, trajectories as JSON) alike: ids, tokens and texts exactly, floats to rounding."""
    if isinstance(one, dict) and isinstance(two, dict):
        assert one.keys() == two.keys(), where
        for key in one:
            assert_close(one[key], two[key], f"{where}.{key}")
    elif isinstance(one, (list, tuple)) and isinstance(two, (list, tuple)):
        assert len(one) == len(two), where
        for index, (a, b) in enumerate(zip(one, two)):
            assert_close(a, b, f"{where}[{index}]")
    elif isinstance(one, float) and isinstance(two, float):
        assert two == pytest.approx(one, rel=1e-4, abs=1e-6), where
    else:
        assert one == two, where


def assert_same_step(synchronous: StepOutput, asynchronous: StepOutput, step: int) -> None:
    """A step of the synchronous run and of the run on the rollout copy alike, the copy's rounding aside: its
    weights are equal, but not the memory they sit in, and a CPU's BLAS may take another route for the same
    product (on a 16-core Xeon host, one matrix product of the copy's went through MKL's batched routine, and its
    log-probs differed from the model's in the last bit)."""
    assert_close(comparable(synchronous), comparable(asynchronous), f"step {step}")


def backend(trainer: Trainer) -> AsyncRollout:
    """The trainer's asynchronous backend (what ``distributed.async_rollout`` composes)."""
    assert isinstance(trainer.rollout, AsyncRollout)
    return trainer.rollout


def run_steps(trainer: Trainer, steps: int) -> list[StepOutput]:
    try:
        return [trainer.step(step) for step in range(steps)]
    finally:
        trainer.close()


def test_staleness_zero_is_the_synchronous_run(tiny_model_dir, tmp_path):
    # GAE with a critic and sampler log-probs: every phase of the update is compared.
    synchronous = run_steps(Trainer(config(tiny_model_dir, tmp_path, name="sync")), 3)
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0))
    asynchronous = run_steps(trainer, 3)
    for step, (one, two) in enumerate(zip(synchronous, asynchronous)):
        assert_same_step(one, two, step)
        assert two.metrics["async/staleness"] == 0 and two.metrics["async/weights_version"] == step
    assert synchronous[2].metrics["batch/samples"] > 0  # it trained on every step
    assert backend(trainer).weights.held(0) == 2  # the batch of step 2 used the weights of update 1


LORA = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "algorithm.advantage=grpo")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_under_bf16_the_copy_holds_what_the_engine_reads_and_staleness_zero_is_the_synchronous_run(
        tiny_model_dir, tmp_path, lora):
    """Mixed precision: the actor trains in float32, the engine samples in bf16. The rollout copy of a fully
    trained actor holds its weights in bf16 (buffers float32), and so do the staged ones; a LoRA copy keeps
    float32, since the engine merges base and adapters before its cast. Either way the copy samples what the
    engine computes from the float32 actor in the synchronous run, token for token."""
    bf16 = ("model.dtype=bfloat16", "model.backend=engine", *(LORA if lora else ()))
    synchronous = run_steps(Trainer(config(tiny_model_dir, tmp_path, *bf16, name="sync")), 3)
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0, *bf16))
    rollout = backend(trainer)
    held = torch.float32 if lora else torch.bfloat16
    assert {p.dtype for p in rollout.copy.parameters()} == {held}
    assert torch.float32 in {b.dtype for b in rollout.copy.buffers()}  # the rotary frequencies
    assert {p.dtype for p in trainer.actor.parameters()} == {torch.float32}
    staged = rollout.weights.copy._staged  # type: ignore[attr-defined]
    assert staged and {t.dtype for t in staged} == {held}
    asynchronous = run_steps(trainer, 3)
    for step, (one, two) in enumerate(zip(synchronous, asynchronous)):
        assert_same_step(one, two, step)
    assert synchronous[2].metrics["batch/samples"] > 0


def test_staleness_one_overlaps_and_corrects_with_importance_weights(tiny_model_dir, tmp_path):
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 1, *TIS, "run.steps=5"))
    before = [p.detach().clone() for p in backend(trainer).copy.parameters()]
    outputs = [trainer.step(step) for step in range(3)]
    staleness = [output.metrics["async/staleness"] for output in outputs]
    assert staleness[0] == 0 and all(0 <= s <= 1 for s in staleness)
    # Rollout 1 starts as soon as batch 0 is handed over, long before update 0 ends.
    assert staleness[1] == 1
    for output in outputs:
        assert {"actor/tis_weight_mean", "actor/tis_capped", "async/wait_rollout_s", "async/wait_weights_s",
                "async/queue_size"} <= set(output.metrics)
        assert 0 < output.metrics["actor/tis_weight_mean"] <= 2.0
    # A batch sampled with weights one update old disagrees with the trainer's log-probs; a fresh one does not.
    stale = outputs[1].metrics
    assert stale["actor/logprob_mismatch"] > 1e-4 and outputs[0].metrics["actor/logprob_mismatch"] < 1e-4
    assert backend(trainer).weights.held(0) >= 2  # the copy took published weights between batches
    assert any(not torch.equal(a, b) for a, b in zip(before, backend(trainer).copy.parameters()))
    thread = backend(trainer).thread
    assert thread is not None and thread.is_alive()  # ahead of the trainer, or waiting for weights
    trainer.close()
    assert not thread.is_alive()
    trainer.close()  # twice is fine


def test_staleness_one_with_sampler_log_probs_takes_the_ratio_against_the_sampling_weights(tiny_model_dir, tmp_path):
    """Without a recompute pass PPO's old log-probs are the sampler's: a batch sampled one update back starts its
    update already off the ratio's centre, where the recomputed ones start at it."""
    runs = {}
    for mode, settings in (("recompute", TIS), ("sampler", ["algorithm.old_logprobs=sampler"])):
        trainer = Trainer(async_config(tiny_model_dir, tmp_path, 1, *settings, name=mode))
        runs[mode] = [output.metrics for output in run_steps(trainer, 2)]
    assert [m["async/staleness"] for m in runs["sampler"]] == [0, 1]
    assert "actor/tis_weight_mean" not in runs["sampler"][1]
    # Step 0 is the same on-policy batch and update in both; step 1 trains the same batch, sampled with weights 0.
    assert runs["sampler"][0]["actor/approx_kl"] == pytest.approx(runs["recompute"][0]["actor/approx_kl"], abs=1e-6)
    # One mini-batch a step: the recomputed old log-probs are the update's own, the sampler's one update older.
    assert runs["recompute"][1]["actor/approx_kl"] < 1e-6 < 1e-3 < runs["sampler"][1]["actor/approx_kl"]


def test_a_failure_in_the_rollout_thread_surfaces_in_step(tiny_model_dir, tmp_path):
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0))

    def unreachable_env():  # an env that cannot be built, as when an env server is down
        raise ConnectionError("env server unreachable")

    trainer.train_groups.make_env = unreachable_env
    try:
        for _ in range(2):  # and again on the next call
            with pytest.raises(RolloutThreadError, match="rollout of step 0 failed.*env server unreachable") as raised:
                trainer.step(0)
            assert isinstance(raised.value.__cause__, ConnectionError)
            assert raised.value.__cause__.__traceback__ is not None  # the rollout thread's frames
    finally:
        trainer.close()


def test_steps_run_in_order_and_not_past_run_steps(tiny_model_dir, tmp_path):
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0, "run.steps=1"))
    try:
        trainer.step(0)
        with pytest.raises(RolloutThreadError, match="run.steps=1"):
            trainer.step(1)
    finally:
        trainer.close()


def test_stale_weights_need_truncated_importance_weights(tmp_path):
    settings = ["distributed.async_rollout=true", "distributed.max_staleness=2"]
    with pytest.raises(ConfigError, match=r"set algorithm.tis_cap=2.0 \(or algorithm.old_logprobs=sampler"):
        config(tmp_path, tmp_path, *settings, "algorithm.old_logprobs=recompute")
    config(tmp_path, tmp_path, *settings, *TIS)
    config(tmp_path, tmp_path, *settings, "algorithm.old_logprobs=sampler")
    config(tmp_path, tmp_path, "distributed.async_rollout=true", "distributed.max_staleness=0")


def test_the_engine_samples_with_the_published_weights(tiny_model_dir, tmp_path):
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0, "model.backend=engine"))
    engine = backend(trainer).runner.policy.engine  # type: ignore[attr-defined]
    assert engine.model is backend(trainer).copy
    validation = trainer.val_rollout
    assert isinstance(validation, LocalRollout)
    assert validation.runner.policy.engine.model is trainer.actor  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in backend(trainer).copy.parameters()]
    outputs = run_steps(trainer, 3)
    # Each batch after an update was sampled with that update's weights: the engine saw the copy change
    # (and dropped its cache), so its log-probs are the trainer's.
    assert all(output.metrics["actor/logprob_mismatch"] < 1e-4 for output in outputs)
    assert backend(trainer).weights.held(0) == 2 and engine._version == weights_version(backend(trainer).copy)
    assert any(not torch.equal(a, b) for a, b in zip(before, backend(trainer).copy.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_trainers_gpu_the_rollout_plays_on_a_stream_of_its_own_with_the_published_weights(
        tiny_model_dir, tmp_path):
    """The copy beside the trainer on one GPU: its batches run on their own stream (beside the update's kernels),
    and each still samples with the weights published before it (the staging copy ordered by an event)."""
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0, *TIS, "model.backend=engine", "model.device=cuda"))
    rollout = backend(trainer)
    streams = []
    played = rollout.runner.run

    def run(*args, **kwargs):
        streams.append(torch.cuda.current_stream())
        return played(*args, **kwargs)

    rollout.runner.run = run  # type: ignore[method-assign]
    outputs = run_steps(trainer, 3)
    assert streams and all(stream != torch.cuda.default_stream() for stream in streams)
    # The log-probs the engine sampled with are the trainer's for the weights of that batch: a copy that read the
    # staging buffers before the trainer's stream filled them would sample with other weights.
    assert all(output.metrics["actor/tis_weight_mean"] == pytest.approx(1.0, abs=0.02) for output in outputs)
    assert rollout.weights is not None and rollout.weights.held(0) == 2


def test_ahead_the_trainers_own_engine_holds_nothing_between_validations(tiny_model_dir, tmp_path):
    """One update ahead, the trainer's policy serves validations alone: from the start and after each one, its
    engine holds none of its cache's pages nor the weights it computed (on one GPU they sat beside the update's
    peak: the VisGym vlm-3b update peaked 5 GiB above the estimate with them), and the next validation computes
    them again: the same validation twice gives the same numbers."""
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 1, *TIS, "model.backend=engine", "model.dtype=bfloat16"))
    policy = trainer.policies[0]
    assert isinstance(policy, EnginePolicy)
    engine = policy.engine

    def held() -> tuple[int, int]:
        return engine.cache.pages, sum(ref.value.untyped_storage().size() for ref in engine.weights.tensors)

    try:
        assert held() == (0, 0)  # freed once the trainer is built
        first = trainer.validate()
        assert held() == (0, 0)
        again = trainer.validate()
        assert held() == (0, 0)
    finally:
        trainer.close()
    assert comparable(first) == comparable(again)
    assert first.metrics["val/episodes"] == 2


def test_validation_and_resume_continue_the_synchronous_run(tiny_model_dir, tmp_path):
    # One run: validation between steps, a checkpoint after step 1; a second one resumes from it.
    trainer = Trainer(async_config(tiny_model_dir, tmp_path, 0))
    try:
        trainer.step(0)
        trainer.step(1)
        assert trainer.validate().metrics["val/episodes"] == 2
        trainer.save(2)  # the run after its 2 steps
        straight = trainer.step(2)
    finally:
        trainer.close()
    resumed = Trainer(async_config(tiny_model_dir, tmp_path, 0, f"resume={tmp_path / 'async'}"))
    assert resumed.first_step == 2 and backend(resumed).weights.version == 2
    try:
        again = resumed.step(2)
    finally:
        resumed.close()
    assert comparable(again) == comparable(straight)


def test_a_compiled_function_called_while_an_fx_trace_is_under_way_runs_uncompiled(monkeypatch):
    """torch 2.11 keeps the flag of an FX trace under way process-wide: while the trainer's thread compiled, the
    engine's compiled calls in the rollout thread raised, and the engine dropped its compiled kernels for good.
    Started, the rollout thread lets such a call run its function as it is (here the flag is faked)."""
    monkeypatch.setattr(torch._dynamo.config, "error_on_nested_fx_trace", True)
    monkeypatch.setattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", lambda: True)  # read as it wraps
    doubled = torch.compile(lambda x: 2 * x + 1, backend="eager")
    with pytest.raises(RuntimeError, match="symbolically trace"):
        doubled(torch.ones(3))
    let_compiled_code_run_beside_traces()
    assert torch.equal(doubled(torch.ones(3)), torch.full((3,), 3.0))


def test_a_rollout_that_runs_ahead_reports_no_peak_memory_of_its_own():
    """The trainer's device, measured while the trainer waits for the rollout thread, says nothing of the
    rollout's memory: no rollout peak, and no step peak taken over it."""
    update = {"memory/scores_peak_gib": 2.0, "memory/update_peak_gib": 3.0}
    assert rollout_memory_metrics(1.5, update, runs_ahead=True) == {}
    assert rollout_memory_metrics(1.5, update, runs_ahead=False) == {"memory/rollout_peak_gib": 1.5,
                                                                     "memory/peak_allocated_gib": 3.0}
    assert rollout_memory_metrics(None, update, runs_ahead=False) == {}  # a CPU


def test_episodes_played_during_a_validation_do_not_wait_for_the_validation(tiny_policy):
    """``run`` inside :meth:`AsyncRollout.exclusive` (a validation on the backend's own runner) plays, in the
    thread that holds it."""
    agent = AgentConfig(format="no_think", max_turns=1)
    runner = Rollout(tiny_policy, get_format(agent.format), agent, env_id="FrozenLake")
    rollout = AsyncRollout(runner, tiny_policy.model, torch.device("cpu"), torch.float32, max_staleness=0,
                           end_step=1)
    slots = EnvGroups(lambda: make("FrozenLake"), 1, 1, SeedSplits()).train_slots(0)
    played: list[Trajectory] = []

    def validate() -> None:
        with rollout.exclusive():
            played.extend(rollout.run(slots, SamplingConfig(temperature=0.0, max_new_tokens=4)))

    thread = threading.Thread(target=validate, daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "run() inside exclusive() waits for the lock its own thread holds"
    assert len(played) == 1
    rollout.close()


def test_asynchronous_run_with_no_staleness_is_the_synchronous_run(tiny_model_dir, tmp_path, single):
    lagging = train_in_process(tiny_model_dir, tmp_path, "async", "run.steps=2", "distributed.async_rollout=true",
                         "distributed.max_staleness=0")
    one, two = step_records(single), step_records(lagging)
    for step in one:
        assert_same_metrics(one[step], two[step])
        assert two[step]["async/staleness"] == 0
