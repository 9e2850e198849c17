"""The RL trainer end to end on the tiny model: every estimator path, LoRA, filters, SFT warm start, outputs, resume."""

from __future__ import annotations

import io
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._inductor.config as inductor_config
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from turnrl.algorithms import seeded_group_scores
from turnrl.cli import main
from turnrl.config import ConfigError, load_config
from turnrl.engine.cache import PAGE_TOKENS, KVCache
from turnrl.envs import make as make_env
from turnrl.envservice.placement import LocalEnvFactory
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.ray_workers import RolloutWorkerError
from turnrl.training import packed_attention
from turnrl.training import trainer as trainer_module
from turnrl.training.commands import GracefulStop, train
from turnrl.training.device_idle import read_trace
from turnrl.training.head import ScoringHead
from turnrl.training.logger import MetricsLogger, RunConsole, RunProgress
from turnrl.training.packed_attention import CUDNN_ATTENTION
from turnrl.training.schedules import kl_adaptive_scale
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer

# A short system prompt: the tiny model is trained from scratch and cannot read instructions.
COMMON = [
    "model.device=cpu", "model.dtype=float32", "run.tensorboard=false", "run.trajectories_every=1",
    "env.id=FrozenLake", "agent.format=no_think", "agent.env_instructions=false", "agent.format_instructions=false",
    "agent.system_prompt=FrozenLake. Reach G. Answer <answer>Left|Down|Right|Up</answer>.",
    "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2", "groups.group_size=2",
    "validation.episodes=2", "run.steps=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
    "optim.actor_lr=1e-3", "optim.critic_lr=1e-3",
]
VOLATILE = ("timing/", "throughput/", "startup/", "memory/")  # measurements of the machine, not of the run


def config(model_dir, out: Path, *overrides: str, name: str = "run") -> TrainConfig:
    model = [f"model.path={model_dir}"] if model_dir is not None else []
    return load_config(TrainConfig, None, [*COMMON, *model, f"run.output_dir={out}", f"run.name={name}", *overrides])


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir: Path) -> dict[int, dict]:
    """The RL step records by step (validation-only records left out)."""
    return {r["step"]: r for r in records(run_dir) if "rollout/success" in r}


def trajectories(run_dir: Path, step: int) -> list[dict]:
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def actor_weights(run_dir: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / "step_000002" / "actor" / name)


def base_weights(model_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(model_dir) / "model.safetensors")


def assert_token_exact(steps: dict[int, dict]) -> None:
    """The recomputed log-probs of the trained tokens match the sampler's: the batch holds the sampled tokens."""
    assert all(r["actor/logprob_mismatch"] < 1e-4 for r in steps.values())


# --------------------------------------------------------------------------- SFT, then PPO with a critic
@pytest.fixture(scope="module")
def warm_run(tiny_model_dir, once_per_run) -> Path:
    """SFT on expert demos, then 2 PPO/GAE steps, with TensorBoard; its SFT model warms other tests up (only read,
    made once for all the pytest-xdist workers)."""
    return once_per_run("trainer_warm", lambda out: train(config(
        tiny_model_dir, out, "sft.enabled=true", "sft.episodes=160", "sft.epochs=4", "sft.batch_size=16", "sft.lr=1e-2",
        "sft.micro_batch_size=16", "sft.warmup_steps=2", "run.tensorboard=true", "agent.max_turns=3",
        "groups.n_groups=4", "validation.episodes=8", "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=8"))) \
        / "run"


@pytest.fixture(scope="module")
def warm_model_dir(warm_run) -> Path:
    return warm_run / "sft" / "model"


def test_sft_then_rl_writes_summary_with_validation_before_and_after(warm_run):
    summary = json.loads((warm_run / "summary.json").read_text())
    assert 0 <= summary["val_success_before_rl"] <= 1 and 0 <= summary["val_success_after_rl"] <= 1
    assert summary["val_after_rl"]["val/success"] == summary["val_success_after_rl"]
    assert summary["steps"] == 2 and summary["sft/steps"] == 4 * 10 and summary["sft/final_epoch_loss"] < 2.0
    assert {"sft_s", "validation_s", "rollout_s", "update_s"} <= set(summary["timings_s"])
    before = records(warm_run)[0]
    assert before["step"] == 0 and before["val/success"] == summary["val_success_before_rl"]
    assert before["val/format_ok"] > 0  # the SFT model writes well-formed answers now and then
    names = {p.name for p in (warm_run / "trajectories").iterdir()}
    assert {"val_before_rl.jsonl", "val_after_rl.jsonl", "step_000001.jsonl", "step_000002.jsonl"} <= names
    assert (warm_run / "sft" / "demos_sample.jsonl").exists()


def test_sft_model_is_saved_in_hf_format_and_differs_from_the_base(warm_model_dir, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(warm_model_dir)
    assert AutoTokenizer.from_pretrained(warm_model_dir).chat_template
    base = base_weights(tiny_model_dir)
    assert any(not torch.equal(p, base[k]) for k, p in model.state_dict().items() if k in base)


def test_metrics_are_namespaced_per_step(warm_run):
    steps = step_records(warm_run)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        namespaces = {key.split("/")[0] for key in record if "/" in key}
        assert {"rollout", "actor", "critic", "losses", "timing", "filter", "batch", "throughput"} <= namespaces
        assert record["filter/skipped_step"] == 0 and record["filter/kept_ratio"] == 1.0
        assert record["batch/samples"] == 8 and record["rollout/episodes"] == 8
        # every phase of the step timed, the phases within the step's own wall time
        phases = ["rollout_s", "batch_s", "old_logprobs_s", "values_s", "advantages_s", "update_s", "set_weights_s"]
        assert all(record[f"timing/{phase}"] >= 0 for phase in phases)
        assert sum(record[f"timing/{phase}"] for phase in phases) <= record["timing/step_s"]
    final = [r for r in records(warm_run) if "val/success" in r and r["step"] == 2]
    assert len(final) == 1 and not any(k.startswith("rollout/") for k in final[0])
    assert all("/" in key for r in records(warm_run) for key in r if key not in ("step", "time"))
    assert_token_exact(steps)


def test_ppo_with_critic_trains_actor_and_critic(warm_run, warm_model_dir):
    steps = step_records(warm_run)
    assert all(r["losses/value"] > 0 and r["critic/grad_norm"] > 0 and r["actor/grad_norm"] > 0 for r in steps.values())
    assert all(abs(r["actor/advantage_mean"]) < 1e-5 for r in steps.values())  # whitened
    checkpoint = warm_run / "checkpoints" / "step_000002"
    critic_head = torch.load(checkpoint / "critic" / "value_head.pt")
    assert critic_head["weight"].abs().sum() > 0  # the value head starts at zero
    sft = load_file(warm_model_dir / "model.safetensors")
    actor = load_file(checkpoint / "actor" / "model.safetensors")
    assert any(not torch.equal(actor[k], sft[k]) for k in sft)


def test_tensorboard_event_files_hold_the_scalars(warm_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((warm_run / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(str(warm_run / "tensorboard"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {"rollout/success", "actor/grad_norm", "critic/grad_norm", "losses/policy", "val/success",
            "filter/kept_ratio", "timing/step_s"} <= tags
    assert [e.step for e in accumulator.Scalars("rollout/success")] == [1, 2]
    assert list((warm_run / "sft" / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoint_holds_an_hf_actor_with_tokenizer_and_the_trainer_state(warm_run):
    root = warm_run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000002"
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]
    model = AutoModelForCausalLM.from_pretrained(root / "step_000002" / "actor")
    tokenizer = AutoTokenizer.from_pretrained(root / "step_000002" / "actor")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert model(torch.tensor([ids])).logits.shape[-1] == model.config.vocab_size
    state = torch.load(root / "step_000002" / "trainer_state.pt", weights_only=False)
    assert state["steps_done"] == 2 and state["actor_optimizer"]["state"] and state["critic_optimizer"]["state"]
    saved = load_config(TrainConfig, warm_run / "config.yaml")
    assert saved.sft.enabled and saved.algorithm.advantage == "gae"


# --------------------------------------------------------------------------- estimators
def test_grpo_trains_without_a_critic(warm_model_dir, tmp_path):
    summary = train(config(warm_model_dir, tmp_path, "algorithm.advantage=grpo", "groups.n_groups=4",
                           "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=4", "agent.max_turns=3",
                           "run.memory_snapshot_steps=1",  # a GPU's allocator history: on a CPU, none
                           "run.profile_steps=[2]"))
    run_dir = tmp_path / "run"
    steps = step_records(run_dir)
    assert not (run_dir / "memory").exists()
    # Step 2 alone traced: the host's frames (a CPU has no kernels to find idle time between).
    assert sorted(path.name for path in (run_dir / "profile").iterdir()) == ["rank0_step2.json.gz", "rank0_step2.txt"]
    frames = {event["name"] for event in read_trace(run_dir / "profile" / "rank0_step2.json.gz")
              if event.get("cat") == "python_function" and "turnrl/training/trainer.py" in event["name"]}
    assert {"train_on", "score", "roll_out"} <= {name.rpartition("): ")[2] for name in frames}
    assert (run_dir / "profile" / "rank0_step2.txt").read_text().startswith("device idle: 0.00 s")
    assert not any(k.startswith("critic/") or k == "losses/value" for r in steps.values() for k in r)
    assert not (run_dir / "checkpoints" / "step_000002" / "critic").exists()
    assert any(r["actor/advantage_abs_mean"] > 0 for r in steps.values())  # the warm model's groups disagree
    assert "val_success_after_rl" in summary and "val_success_before_rl" in summary
    assert_token_exact(steps)


@pytest.mark.parametrize("advantage", ["bilevel_gae", "turn_gae"])
def test_turn_credit_estimators_with_a_critic(tiny_model_dir, tmp_path, advantage):
    train(config(tiny_model_dir, tmp_path, f"algorithm.advantage={advantage}", "algorithm.gamma_turn=0.9"))
    steps = step_records(tmp_path / "run")
    assert all(r["losses/value"] > 0 and r["actor/advantage_abs_mean"] > 0 for r in steps.values())
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "critic" / "value_head.pt").exists()
    assert_token_exact(steps)


def test_turn_samples_with_a_context_window(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "algorithm.sample_mode=turn", "agent.max_context_window=1",
                 "agent.max_turns=3", "algorithm.advantage=bilevel_gae", "algorithm.mini_batch_size=16",
                 "algorithm.micro_batch_size=4"))
    run_dir = tmp_path / "run"
    steps = step_records(run_dir)
    for step, record in steps.items():
        played = trajectories(run_dir, step)
        assert record["batch/samples"] == sum(len(t["turns"]) for t in played)  # one sample per turn
        assert max(len(t["turns"]) for t in played) == 3
    assert_token_exact(steps)


def test_critic_warmup_leaves_the_actor_untouched(tiny_model_dir, builtin_dir, tmp_path):
    # The built-in model by preset (the session's build is reused), envs stepped by worker threads.
    train(config(None, tmp_path, "model.builtin_preset=tiny", f"model.builtin_dir={builtin_dir}",
                 "groups.env_workers=2", "algorithm.critic_warmup_steps=2"))
    run_dir = tmp_path / "run"
    base, actor = base_weights(tiny_model_dir), actor_weights(run_dir)
    assert all(torch.equal(actor[k], base[k]) for k in base)
    steps = step_records(run_dir)
    assert all("losses/policy" not in r and r["losses/value"] > 0 for r in steps.values())


def test_adams_betas_reach_the_actors_and_the_critics_optimizers(tiny_model_dir, tmp_path):
    trainer = Trainer(config(tiny_model_dir, tmp_path, "optim.adam_beta1=0.8", "optim.adam_beta2=0.95"))
    try:
        assert trainer.critic_optimizer is not None
        for optimizer in (trainer.actor_optimizer, trainer.critic_optimizer):
            assert optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    finally:
        trainer.close()


def test_closing_a_trainer_ends_the_threads_that_step_its_envs(tiny_model_dir, tmp_path):
    trainer = Trainer(config(tiny_model_dir, tmp_path, "groups.env_workers=2"))
    trainer.close()
    assert trainer.executor is not None
    with pytest.raises(RuntimeError, match="shutdown"):
        trainer.executor.submit(print)
    trainer.close()  # twice is fine


@pytest.mark.parametrize("compiled", [True, False])
def test_model_compile_scores_through_the_compiled_head_for_the_actor_and_the_reference(
        tiny_model_dir, tmp_path, monkeypatch, compiled):
    # The layers' compile is tested in tests/models/test_loading.py; here it would swap transformers' rotary
    # functions for the rest of the worker's tests.
    monkeypatch.setattr(trainer_module, "compile_layer_parts", lambda model: 0)
    trainer = Trainer(config(tiny_model_dir, tmp_path, "algorithm.kl_coef=0.1", f"model.compile={compiled}"))
    try:
        assert trainer.reference is not None
        for model in (trainer.actor, trainer.reference):
            head = model.get_output_embeddings()
            assert isinstance(head, ScoringHead) and head.compiled is compiled
    finally:
        trainer.close()


def test_model_packed_attention_reaches_the_actor_the_critic_and_the_reference(
        tiny_model_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="model.packed_attention=cudnn needs a CUDA GPU"):
        Trainer(config(tiny_model_dir, tmp_path, "model.packed_attention=cudnn"))
    # As on a Hopper GPU: the run's choice resolved to cuDNN (its kernel on a CPU is SDPA's flash fallback).
    monkeypatch.setattr(packed_attention, "packed_kernel", lambda choice, device: "cudnn")
    trainer = Trainer(config(tiny_model_dir, tmp_path / "cudnn", "algorithm.kl_coef=0.1"))
    try:
        assert trainer.critic is not None and trainer.reference is not None
        for model in (trainer.actor, trainer.critic.backbone, trainer.reference):
            assert model.config.get_text_config()._attn_implementation == CUDNN_ATTENTION
    finally:
        trainer.close()


def test_a_bf16_runs_reference_computes_what_its_resume_loads(tiny_model_dir, tmp_path):
    """The reference is the actor's copy in the compute dtype, saved with the run and loaded on a resume: the
    copy keeps the rotary frequencies in float32 as the loaded one does, so both score each token alike,
    thousands of positions in."""
    trainer = Trainer(config(tiny_model_dir, tmp_path, "algorithm.kl_coef=0.1", "model.dtype=bfloat16"))
    try:
        reference = trainer.reference
        assert reference is not None
        loaded = AutoModelForCausalLM.from_pretrained(trainer.run_dir / "reference", dtype=torch.bfloat16).eval()
        ids, positions = torch.tensor([[1, 5, 9, 13, 2, 7]]), torch.arange(3000, 3006)[None]
        with torch.no_grad():
            torch.testing.assert_close(reference(input_ids=ids, position_ids=positions).logits,
                                       loaded(input_ids=ids, position_ids=positions).logits, rtol=0, atol=0)
    finally:
        trainer.close()


# --------------------------------------------------------------------------- LoRA
def test_lora_trains_adapters_against_the_adapters_off_reference(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "lora.enabled=true", "lora.r=4", "lora.alpha=8",
                 "algorithm.advantage=grpo", "algorithm.kl_coef=0.1", "optim.actor_lr=1e-2",
                 "model.gradient_checkpointing=true"))
    run_dir = tmp_path / "run"
    steps = step_records(run_dir)
    assert steps[1]["actor/kl_ref"] == 0.0  # adapters start as the identity: the policy is the reference
    assert steps[2]["actor/kl_ref"] > 0.0  # after one update the adapters moved the policy away
    assert not (run_dir / "reference").exists()  # no copy of the model: the reference is the adapters switched off
    actor_dir = run_dir / "checkpoints" / "step_000002" / "actor"
    assert (actor_dir / "adapter_config.json").exists() and not (actor_dir / "model.safetensors").exists()
    adapters = load_file(actor_dir / "adapter_model.safetensors")
    assert adapters and all("lora_" in k for k in adapters)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapters.items())
    loaded = AutoModelForCausalLM.from_pretrained(actor_dir)  # base + adapters through transformers' peft support
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert not torch.allclose(loaded(ids).logits, base(ids).logits, atol=1e-4)
    assert_token_exact(steps)


@pytest.mark.parametrize("sample_mode", ["trajectory", "turn"])
def test_gigpo_trains_and_reports_its_anchored_turns(tiny_model_dir, tmp_path, sample_mode):
    train(config(tiny_model_dir, tmp_path, "algorithm.advantage=gigpo", f"algorithm.sample_mode={sample_mode}",
                 "agent.max_turns=3"))
    steps = step_records(tmp_path / "run")
    # Every episode of a group starts from the same state: at least the first turns are anchored.
    assert all(0 < r["actor/gigpo_anchored_turns"] <= 1 for r in steps.values())
    trajectory = trajectories(tmp_path / "run", 2)[0]
    assert all(turn["state_key"] for turn in trajectory["turns"])
    assert_token_exact(steps)


def test_gspo_with_truncated_importance_weights_trains_and_reports_the_weights(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "algorithm.advantage=grpo", "algorithm.ratio_level=sequence",
                 "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4", "algorithm.old_logprobs=recompute",
                 "algorithm.tis_cap=2.0", "algorithm.ppo_epochs=2"))
    steps = step_records(tmp_path / "run")
    for record in steps.values():
        # float32 CPU sampling and training agree closely: weights near 1, none at the cap
        assert abs(record["actor/tis_weight_mean"] - 1) < 1e-3 and record["actor/tis_capped"] == 0.0
        assert 0 <= record["actor/clip_frac"] <= 1


def test_truncated_importance_weights_need_recomputed_old_logprobs(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="old_logprobs=recompute"):
        config(tiny_model_dir, tmp_path, "algorithm.tis_cap=2.0").validate()


@pytest.mark.parametrize("model", ["untrained", "warm"])
def test_dynamic_sampling_rolls_out_more_groups_until_enough_have_varied_rewards(
        tiny_model_dir, warm_model_dir, tmp_path, model):
    # The untrained model fails every episode: no group varies, every round is played, the step is skipped.
    # The SFT-warmed one succeeds sometimes: groups vary and are trained on.
    # The untrained run samples through the engine: its counters are each round's, summed over the step's rounds.
    backend = "model.backend=engine" if model == "untrained" else "model.backend=hf"
    train(config(tiny_model_dir if model == "untrained" else warm_model_dir, tmp_path, "algorithm.advantage=grpo",
                 "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_rounds=2", "groups.n_groups=2",
                 "groups.group_size=4", backend))
    steps = step_records(tmp_path / "run")
    kept = [record["rollout/dynamic_kept_groups"] for record in steps.values()]
    assert (max(kept) > 0) == (model == "warm")
    for step, record in steps.items():
        rounds = record["rollout/dynamic_extra_rounds"]
        assert 0 <= rounds <= 2 and record["rollout/dynamic_kept_groups"] <= 2
        played = trajectories(tmp_path / "run", step)
        assert len(played) == 8 * (1 + rounds)  # every round's episodes are written
        assert {t["group"] for t in played} == set(range(2 * (1 + int(rounds))))
        if record["rollout/dynamic_kept_groups"] > 0:
            assert record["batch/samples"] == 4 * record["rollout/dynamic_kept_groups"]
        # The share alike counts every group played, as it does without dynamic sampling.
        rewards: dict[int, set[float]] = {}
        for t in played:
            rewards.setdefault(t["group"], set()).add(t["total_reward"])
        alike = sum(len(r) == 1 for r in rewards.values()) / len(rewards)
        assert record["rollout/zero_variance_groups"] == pytest.approx(alike)
        if model == "untrained":
            generated = sum(turn["num_response_tokens"] for t in played for turn in t["turns"])
            assert record["generation/generated_tokens"] == generated
            assert record["timing/decode_device_s"] > 0


def test_dynamic_sampling_and_the_starpo_filter_are_exclusive(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="filter.method=none"):
        config(tiny_model_dir, tmp_path, "algorithm.dynamic_sampling=true", "algorithm.filter.method=top_k")


# --------------------------------------------------------------------------- the engine backend
def test_the_engine_trains_token_exact_with_lora_and_episodes_that_do_not_wait(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "model.backend=engine", "agent.wait_for_turns=false",
                 "groups.env_workers=2", "lora.enabled=true", "lora.r=4", "lora.alpha=8", "algorithm.advantage=grpo",
                 "algorithm.kl_coef=0.1", "optim.actor_lr=1e-2"))
    steps = step_records(tmp_path / "run")
    assert steps[1]["actor/kl_ref"] == 0.0
    assert steps[2]["actor/kl_ref"] > 0.0  # generation followed the adapters the first update moved
    assert_token_exact(steps)  # the engine's sampling logprobs are the trainer's


def test_resume_with_the_engine_continues_exactly(tiny_model_dir, tmp_path):
    extra = ["model.backend=engine", "algorithm.micro_batch_size=2", "algorithm.mini_batch_size=4"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", f"resume={tmp_path / 'split'}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(tmp_path / "split")
    assert comparable(one[3]) == comparable(two[3])


def test_the_engine_trains_a_vlm_on_images_token_exact(tiny_vlm_dir, tmp_path):
    """The engine samples a VLM's turns from images (and keeps its cache across them); the trainer's forward with
    the same images recomputes the sampler's logprobs, and the second step generates from the updated weights.
    The step's passes take the features the engine computed for the rollout's images, so none encodes an image,
    and the step trains as one whose first pass encodes them (``model.rollout_image_features=false``)."""
    extra = ("model.backend=engine", "env.settings.mode=image", "algorithm.advantage=grpo", "algorithm.kl_coef=0.1",
             "optim.actor_lr=1e-2")
    train(config(tiny_vlm_dir, tmp_path, *extra))
    train(config(tiny_vlm_dir, tmp_path, *extra, "model.rollout_image_features=false", name="encoding"))
    steps, encoding = step_records(tmp_path / "run"), step_records(tmp_path / "encoding")
    assert any((tmp_path / "run" / "trajectories" / "images").iterdir())  # the episodes were played from images
    assert steps[2]["actor/kl_ref"] > 0.0
    assert_token_exact(steps)
    assert_token_exact(encoding)
    for step in steps:
        assert steps[step]["vision/images_encoded"] == 0 < steps[step]["vision/images_from_rollout"]
        assert encoding[step]["vision/images_encoded"] > 0 == encoding[step]["vision/images_from_rollout"]
        # The rollout's generation split into device work (wall time on a CPU), with the work a roofline counts;
        # its shares of the hardware's limit need a known GPU's peaks.
        record = steps[step]
        assert 0 < record["timing/prefill_device_s"] + record["timing/decode_device_s"] <= record["timing/generate_s"]
        assert record["generation/images_encoded"] > 0 and record["generation/decode_bytes"] > 0
        assert record["generation/prefill_flops"] > record["generation/vision_flops"] > 0
        assert "throughput/prefill_roofline" not in record and "throughput/decode_roofline" not in record
    # The first step played the same episodes in both runs: its losses agree to rounding.
    trained = [key for key in steps[1] if key.startswith(("actor/", "batch/", "losses/")) and key != "actor/lr"]
    assert {"losses/policy", "actor/grad_norm", "actor/kl_ref"} <= set(trained)
    assert {key: steps[1][key] for key in trained} == pytest.approx({key: encoding[1][key] for key in trained},
                                                                    rel=1e-4, abs=1e-6)


def test_a_key_value_cache_too_small_for_the_steps_turns_is_said_once_with_what_to_raise(tiny_model_dir, tmp_path,
                                                                                          capsys):
    """Four pages of 128 positions (one of them the engine's scratch) for four episodes of two turns: turns wait for
    pages and idle conversations give theirs up. The run says so once, at the first step, naming the setting; the
    same run with the default cache says nothing (the validation's idle rows that the first step's episodes take
    over are no shortage)."""
    shape = AutoConfig.from_pretrained(tiny_model_dir)
    key_width = shape.num_hidden_layers * shape.num_key_value_heads * (shape.hidden_size // shape.num_attention_heads)
    gb = 4 * KVCache.bytes_per_token(key_width, torch.float32) * PAGE_TOKENS / 2**30
    train(config(tiny_model_dir, tmp_path, "model.backend=engine", f"model.engine.kv_cache_gb={gb!r}",
                 "model.engine.max_seq_len=256", name="tight"))  # the cache holds a whole row at least
    said = " ".join(capsys.readouterr().out.split())
    assert said.count("key/value cache") == 1 and "step 1: the engine's key/value cache (model.engine.kv_cache_gb=" \
        in said and "was full" in said and "a larger model.engine.kv_cache_gb" in said
    steps = step_records(tmp_path / "tight")
    assert all(steps[step]["generation/page_waits"] + steps[step]["generation/page_evictions"] > 0 for step in steps)
    assert_token_exact(steps)
    train(config(tiny_model_dir, tmp_path, "model.backend=engine", "run.steps=1", name="roomy"))
    assert "key/value cache" not in capsys.readouterr().out
    roomy = step_records(tmp_path / "roomy")[1]
    assert roomy["generation/page_waits"] == roomy["generation/page_evictions"] == 0 < roomy["generation/evictions"]


# --------------------------------------------------------------------------- StarPO-S filter
def test_top_k_filter_keeps_the_most_varied_groups_and_drops_zero_variance(warm_model_dir, tmp_path):
    train(config(warm_model_dir, tmp_path, "algorithm.advantage=grpo", "groups.n_groups=4", "agent.max_turns=3",
                 "algorithm.filter.method=top_k", "algorithm.filter.value=0.5",
                 "algorithm.filter.drop_zero_variance=true", "algorithm.mini_batch_size=8",
                 "algorithm.micro_batch_size=4", "run.steps=3"))
    run_dir = tmp_path / "run"
    steps = step_records(run_dir)
    dropped_some = kept_some = False
    for step, record in steps.items():
        rewards: dict[int, list[float]] = {}
        for t in trajectories(run_dir, step):
            rewards.setdefault(t["group"], []).append(t["total_reward"])
        varied = sum(max(r) - min(r) > 1e-8 for r in rewards.values())
        expected = min(2, varied)  # top 50% of 4 groups, among those whose rewards differ
        assert record["filter/kept_ratio"] == expected / 4
        if expected == 0:
            assert record["filter/skipped_step"] == 1 and "batch/samples" not in record
        else:
            assert record["filter/skipped_step"] == 0 and record["batch/samples"] == 2 * expected
        dropped_some |= varied < 4
        kept_some |= expected > 0
    assert dropped_some and kept_some, "the warm model should give both varied and uniform groups"


TOP_THIRD = ("algorithm.advantage=grpo", "groups.n_groups=3", "algorithm.filter.method=top_k",
             "algorithm.filter.value=0.34", "algorithm.mini_batch_size=8", "algorithm.micro_batch_size=4")
"""The top third of three groups: one group kept a step."""


def response_tokens_by_group(episodes: list[dict]) -> dict[int, list[int]]:
    """Each group's episodes' response tokens, by group id."""
    tokens: dict[int, list[int]] = {}
    for t in episodes:
        tokens.setdefault(t["group"], []).append(sum(turn["num_response_tokens"] for turn in t["turns"]))
    return tokens


def test_top_k_filter_by_mean_response_length_keeps_the_longest_group(warm_model_dir, tmp_path):
    train(config(warm_model_dir, tmp_path, *TOP_THIRD, "agent.max_turns=3", "algorithm.filter.metric=length_mean"))
    run_dir = tmp_path / "run"
    for step, record in step_records(run_dir).items():
        tokens = response_tokens_by_group(trajectories(run_dir, step))
        longest = max(sorted(tokens), key=lambda g: sum(tokens[g]) / len(tokens[g]))  # ties: the smaller id
        assert record["filter/kept_ratio"] == pytest.approx(1 / 3)
        assert record["batch/samples"] == 2 and record["batch/trained_tokens"] == sum(tokens[longest])


def test_top_k_filter_by_random_scores_keeps_the_group_its_env_seed_ranks_first(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, *TOP_THIRD, "run.steps=2", "algorithm.filter.metric=random"))
    run_dir = tmp_path / "run"
    for step, record in step_records(run_dir).items():
        episodes = trajectories(run_dir, step)
        groups = torch.tensor([t["group"] for t in episodes])
        scores = seeded_group_scores(torch.tensor([t["seed"] for t in episodes]), groups)
        chosen = int(torch.unique(groups)[int(scores.argmax())])
        assert record["filter/kept_ratio"] == pytest.approx(1 / 3)
        assert record["batch/trained_tokens"] == sum(response_tokens_by_group(episodes)[chosen])


def test_top_k_filter_with_a_group_count(tiny_model_dir, tmp_path):
    cfg = config(tiny_model_dir, tmp_path, "algorithm.filter.method=top_k", "algorithm.filter.value=2",
                 "groups.n_groups=3", "run.steps=1")
    train(cfg)
    assert step_records(tmp_path / "run")[1]["filter/kept_ratio"] == pytest.approx(2 / 3)


def test_validation_every_n_steps_joins_the_step_record(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "validation.every=1", "run.steps=3", "algorithm.advantage=grpo"))
    steps = step_records(tmp_path / "run")
    assert all("val/success" in steps[s] for s in (1, 2)) and "val/success" not in steps[3]  # 3: the final one
    assert [r["step"] for r in records(tmp_path / "run") if "val/success" in r] == [0, 1, 2, 3]


def played(output) -> list[tuple]:
    return [(t.seed, t.group, t.sample, [turn.response_ids for turn in t.turns], t.total_reward)
            for t in output.trajectories]


def test_validation_builds_one_batch_of_envs_and_plays_as_one_env_per_episode_would(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    """A validation of 10 episodes in batches of 4 built 10 envs (hundreds of simulators, or env-server sessions,
    for RAGEN-size validation sets) and kept them for the run; it builds 4, and its batches take turns on them."""
    made = []
    make = LocalEnvFactory.__call__

    def counted(self):
        made.append(make(self))
        return made[-1]

    monkeypatch.setattr(LocalEnvFactory, "__call__", counted)
    trainer = Trainer(config(tiny_model_dir, tmp_path, "algorithm.advantage=grpo", "validation.episodes=5",
                             "validation.samples_per_seed=2", "validation.batch_size=4", "agent.max_turns=3"))
    try:
        made.clear()
        first = trainer.validate()
        assert len(made) == 4
        assert [(t.group, t.sample) for t in first.trajectories] == [(g, k) for g in range(5) for k in range(2)]
        again = trainer.validate()
        assert len(made) == 4 and played(again) == played(first)
        own = EnvGroups(lambda: make_env("FrozenLake"), 1, 1, trainer.val_groups.seeds)  # an env an episode, as before
        monkeypatch.setattr(trainer.val_groups, "val_slots", lambda n, k, envs: own.val_slots(n, k))
        assert played(trainer.validate()) == played(first) and len(own._envs) == 10
    finally:
        trainer.close()


def test_resume_from_a_directory_without_checkpoint_names_the_key(tiny_model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="resume="):
        train(config(tiny_model_dir, tmp_path, f"resume={tmp_path / 'empty'}"))


def test_a_bad_reward_spec_stops_the_run_before_sft(tiny_model_dir, tmp_path):
    bad = config(tiny_model_dir, tmp_path, "sft.enabled=true",
                 "rewards.extra=[{name: judge, fn: 'tests.nowhere:judge'}]")
    with pytest.raises(ConfigError, match="cannot import module 'tests.nowhere'"):
        train(bad)
    assert not (tmp_path / "run" / "sft").exists()


# --------------------------------------------------------------------------- metrics files
def test_metrics_logger_writes_json_lines_with_null_for_non_finite_values(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"a/x": 1.5, "a/nan": float("nan"), "a/inf": float("inf"), "a/int": 3})
    logger.close()
    (record,) = records(tmp_path)
    assert record["step"] == 1 and record["a/x"] == 1.5 and record["a/int"] == 3.0
    assert record["a/nan"] is None and record["a/inf"] is None
    assert not (tmp_path / "tensorboard").exists()


def test_metrics_logger_appends_on_resume_and_starts_afresh_otherwise(tmp_path):
    for resume_step, steps in ((None, [1, 2]), (2, [3])):
        logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=resume_step)
        for step in steps:
            logger.log(step, {"a/x": float(step)})
        logger.close()
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]
    MetricsLogger(tmp_path, tensorboard=False).close()
    assert records(tmp_path) == []


def test_metrics_logger_on_resume_drops_what_was_logged_after_the_checkpoint(tmp_path):
    """A run that stopped after logging steps 3-4 past its checkpoint at 2 logs them once when resumed."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(5):
        logger.log(step, {"a/x": float(step)})
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as torn:  # killed mid-write
        torn.write('{"step": 5, "a/')
    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=2)
    for step in (3, 4):
        logger.log(step, {"a/x": 10.0 + step})
    logger.close()
    assert [(r["step"], r["a/x"]) for r in records(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("a/x")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0),
                                                                      (4, 14.0)]


# --------------------------------------------------------------------------- progress
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_prints_plain_lines_every_interval_where_output_is_not_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    clock = Clock()
    with RunProgress(console, "rl", 10, completed=2, every_s=30.0, clock=clock) as progress:
        for _ in range(8):
            clock.now += 10.0
            progress.update(1, "success 0.50")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("rl 2/10 (20%), 0:00:00 elapsed")
    # one line at the start, then one every 30 s (steps at 30 s, 60 s) and one at the end (80 s)
    assert [line.split(",")[0] for line in lines] == ["rl 2/10 (20%)", "rl 5/10 (50%)", "rl 8/10 (80%)",
                                                     "rl 10/10 (100%)"]
    assert "~0:00:50 left" in lines[1] and lines[-1].endswith("success 0.50")


def test_a_run_console_whose_reader_is_gone_goes_on_on_stderr(capsys):
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as stream:
        console = RunConsole(file=stream)
        console.print("meets the broken pipe")  # rich's own console exits here
        console.print("on stderr")
    assert capsys.readouterr().err.endswith("on stderr\n")


def test_progress_in_a_terminal_draws_a_bar_and_nested_progress_stays_quiet():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with RunProgress(console, "rl", 3) as outer:
        with RunProgress(console, "validation", 4) as inner:  # rich allows one live display at a time
            inner.update(4)
        outer.update(3, "done")
    text = out.getvalue()
    assert "rl" in text and "3/3" in text and "validation 4/4" not in text


# --------------------------------------------------------------------------- a time limit
def test_a_time_limit_ends_the_run_as_a_finished_one_and_a_resume_goes_on(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=4", "run.time_limit_minutes=1e-6"))
    assert summary["steps"] == 1 and summary["stopped_by"] == "time_limit"
    assert summary["time_limit"] == {"minutes": 1e-6, "step": 1}
    assert "time limit of 1e-06 minutes reached after step 1" in " ".join(capsys.readouterr().out.split())
    assert (run / "checkpoints" / "latest").read_text() == "step_000001"
    logged = records(run)
    assert max(r["step"] for r in logged) == 1 and "val/success" in logged[-1]  # validated after its last step
    assert json.loads((run / "summary.json").read_text())["time_limit"]["step"] == 1
    assert "after step 1: 1e-06 minutes" in (run / "report.html").read_text()
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=4", f"resume={run}"))  # no limit this time
    assert summary["steps"] == 4 and "stopped_by" not in summary and "time_limit" not in summary
    assert sorted(step_records(run)) == [1, 2, 3, 4]


def test_a_run_stopped_right_after_a_validation_ends_with_it_and_logs_the_step_once(tiny_model_dir, tmp_path):
    """The step's validation saw the final weights: validating again would cost its time and log a second
    record of the step (which a mean over the last validations would count twice)."""
    run = tmp_path / "run"
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=4", "run.time_limit_minutes=1e-6",
                           "validation.every=1"))
    assert summary["steps"] == 1
    at_step_1 = [r for r in records(run) if r["step"] == 1]
    assert len(at_step_1) == 1 and "rollout/success" in at_step_1[0]
    assert summary["val_success_after_rl"] == at_step_1[0]["val/success"]
    assert summary["val_after_rl"]["val/episodes"] == at_step_1[0]["val/episodes"]
    assert (run / "trajectories" / "val_after_rl.jsonl").read_text().strip()


def test_a_run_of_no_steps_validates_once(tiny_model_dir, tmp_path):
    """``run.steps=0`` (an SFT start and its validation): before and after RL are one validation."""
    run = tmp_path / "run"
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=0"))
    assert [r["step"] for r in records(run) if "val/success" in r] == [0]
    assert summary["val_success_after_rl"] == summary["val_success_before_rl"]
    before, after = ((run / "trajectories" / f"val_{when}_rl.jsonl").read_text() for when in ("before", "after"))
    assert before and before == after


# --------------------------------------------------------------------------- Ctrl-C
def test_graceful_stop_asks_first_and_interrupts_on_the_second_ctrl_c():
    with GracefulStop() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_delivered_twice_at_once_is_one_request_and_a_later_one_interrupts(monkeypatch):
    """A scheduler signals every process and torchrun forwards it too: SIGTERMs milliseconds apart ask once; one
    after the window interrupts, and a Ctrl-C after a SIGTERM interrupts at once."""
    monkeypatch.setattr(GracefulStop, "SAME_SIGTERM_S", 0.5)
    with GracefulStop() as stop:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.signal is signal.SIGTERM
        time.sleep(0.6)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    with GracefulStop() as stop:
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_a_sigterm_makes_the_process_compile_in_itself_and_ctrl_c_leaves_the_compile_workers():
    """A job-wide SIGTERM kills inductor's compile workers, and a compile handed to them then waits forever: from the
    first SIGTERM on the process compiles in itself. Ctrl-C, which the workers ignore, leaves them their work."""
    with inductor_config.patch(compile_threads=8):
        with GracefulStop():
            signal.raise_signal(signal.SIGINT)
        assert inductor_config.compile_threads == 8
        with GracefulStop(phase="end"):
            signal.raise_signal(signal.SIGTERM)
        assert inductor_config.compile_threads == 1


def test_ctrl_c_saves_a_checkpoint_and_the_resumed_run_logs_every_step_once(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    extra = ["algorithm.advantage=grpo", "run.steps=3", "run.save_every=0", "run.keep_checkpoints=1"]
    step = Trainer.step

    def step_then_ctrl_c(self, index):
        output = step(self, index)
        if index == 0:
            signal.raise_signal(signal.SIGINT)  # arrives during the first step
        return output

    monkeypatch.setattr(Trainer, "step", step_then_ctrl_c)
    summary = train(config(tiny_model_dir, tmp_path, *extra))
    monkeypatch.setattr(Trainer, "step", step)
    run = tmp_path / "run"
    assert summary["interrupted_at_step"] == 1
    assert (run / "checkpoints" / "latest").read_text() == "step_000001"
    out = capsys.readouterr().out
    # One numbering: the step in the message is the checkpoint's and the last one in metrics.jsonl.
    assert f"interrupted after step 1 of 3; checkpoint {run / 'checkpoints' / 'step_000001'}" in out
    assert [r["step"] for r in records(run)] == [0, 1]
    assert sorted((run / "trajectories").glob("step_*[0-9].jsonl")) == [run / "trajectories" / "step_000001.jsonl"]
    assert f"turnrl train resume={run}" in out
    assert not (run / "summary.json").exists()
    # The stopped run had logged step 1; a record past the checkpoint (as a crash leaves) is dropped too.
    with (run / "metrics.jsonl").open("a") as file:
        file.write(json.dumps({"step": 2, "rollout/success": 0.0}) + "\n")
    summary = train(config(tiny_model_dir, tmp_path, *extra, f"resume={run}"))
    steps = [r["step"] for r in records(run) if "rollout/success" in r]
    assert steps == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000003"]  # keep last 1
    total = json.loads((run / "summary.json").read_text())["total_s"]
    # Resuming a finished run changes nothing.
    again = train(config(tiny_model_dir, tmp_path, *extra, f"resume={run}"))
    assert json.loads((run / "summary.json").read_text())["total_s"] == total == again["total_s"]
    assert [r["step"] for r in records(run) if "rollout/success" in r] == [1, 2, 3]


def test_an_rl_step_out_of_gpu_memory_stops_the_run_with_what_to_set_and_where_to_resume(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """Nothing is saved after it (the update may have stopped halfway); the message names the last checkpoint."""
    extra = ["algorithm.advantage=grpo", "run.steps=3", "run.save_every=1", "algorithm.micro_batch_tokens=512",
             "run.gpu_share=0.5"]
    step = Trainer.step

    def out_of_memory_at_the_second_step(self, index):
        if index == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. If reserved but "
                                         "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF")
        return step(self, index)

    monkeypatch.setattr(Trainer, "step", out_of_memory_at_the_second_step)
    with pytest.raises(ConfigError) as error:
        train(config(tiny_model_dir, tmp_path, *extra))
    run = tmp_path / "run"
    assert str(error.value) == (
        "RL step 2 ran out of GPU memory: set algorithm.micro_batch_tokens=256; or model.gradient_checkpointing=true; "
        "or model.engine.free_during_update=true; or run.gpu_share above 0.5; then continue from step_000001 with "
        f"`turnrl train resume={run}` and the change. `turnrl memory` estimates each GPU's peak by part. "
        "torch: CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert [r["step"] for r in records(run) if "rollout/success" in r] == [1]
    monkeypatch.setattr(Trainer, "step", lambda self, index: (_ for _ in ()).throw(torch.OutOfMemoryError("")))
    with pytest.raises(ConfigError, match="no checkpoint was saved before it .* torch: OutOfMemoryError$"):
        train(config(tiny_model_dir, tmp_path, *extra, "run.name=second"))


def test_ctrl_c_saves_the_checkpoint_after_the_reader_of_the_output_is_gone(tiny_model_dir, tmp_path):
    """``turnrl train ... | tee log``, then Ctrl-C, which ends ``tee`` too: the run still stops with its checkpoint,
    and what it says after that goes to stderr."""
    command = [sys.executable, "-m", "turnrl.cli", "train", *COMMON, f"model.path={tiny_model_dir}",
               f"run.output_dir={tmp_path}", "run.name=run", "algorithm.advantage=grpo", "run.steps=50",
               "run.threads=1", "validation.episodes=1"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        for line in process.stdout:  # the run prints "rl 0/50 ..." as its first step starts
            if line.startswith("rl "):
                break
        process.stdout.close()  # the reader is gone: printing to stdout is now a broken pipe
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=300)
    finally:
        process.kill()
    run = tmp_path / "run"
    assert process.returncode == 130, err
    assert "Traceback" not in err and "continue with: turnrl train resume=" in err
    latest = (run / "checkpoints" / "latest").read_text()
    assert f"checkpoint {run / 'checkpoints' / latest}" in err
    assert (run / "checkpoints" / latest / "trainer_state.pt").is_file()


# --------------------------------------------------------------------------- resume
def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "time" and not k.startswith(VOLATILE)}


def test_resume_continues_exactly_as_an_uninterrupted_run(tiny_model_dir, tmp_path):
    extra = ["algorithm.kl_coef=0.01", "algorithm.micro_batch_size=1", "algorithm.mini_batch_size=2"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    split = tmp_path / "split"
    summary = train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", f"resume={split}", name="split"))
    straight = tmp_path / "straight"
    final = "checkpoints/step_000004"
    a = load_file(straight / final / "actor" / "model.safetensors")
    b = load_file(split / final / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a_critic = load_file(straight / final / "critic" / "model.safetensors")
    b_critic = load_file(split / final / "critic" / "model.safetensors")
    assert all(torch.equal(a_critic[k], b_critic[k]) for k in a_critic)
    assert torch.equal(torch.load(straight / final / "critic" / "value_head.pt")["weight"],
                       torch.load(split / final / "critic" / "value_head.pt")["weight"])
    one, two = step_records(straight), step_records(split)
    assert sorted(two) == [1, 2, 3, 4]
    for step in (3, 4):
        assert comparable(one[step]) == comparable(two[step]), step
    assert any(not torch.equal(a[k], base_weights(tiny_model_dir)[k]) for k in a)  # it trained
    assert "val_success_before_rl" in summary and summary["steps"] == 4


def test_a_run_stopped_by_a_lost_rollout_worker_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """The failed step drew from the random generators before the worker was lost (a Ray rollout draws its workers'
    seeds from torch's), and the checkpoint of the step before holds the generators as they were left: the resumed
    step still plays and trains what the uninterrupted run did, since each step seeds itself from its number."""
    extra = ["algorithm.advantage=grpo", "algorithm.micro_batch_size=1", "algorithm.mini_batch_size=2"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="straight"))
    roll_out = Trainer.roll_out

    def worker_lost_in_step_3(self, index):
        if index == 2:
            torch.randint(0, 2**31, (1,)), random.random(), np.random.random()
            raise RolloutWorkerError("rollout worker 0 died", worker=0)
        return roll_out(self, index)

    monkeypatch.setattr(Trainer, "roll_out", worker_lost_in_step_3)
    summary = train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="split"))
    assert summary["interrupted_at_step"] == 2 and summary["stopped_by"] == "error"
    monkeypatch.setattr(Trainer, "roll_out", roll_out)
    split = tmp_path / "split"
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", f"resume={split}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(split)
    assert sorted(two) == [1, 2, 3, 4]
    for step in (3, 4):
        assert comparable(one[step]) == comparable(two[step]), step
    final = "checkpoints/step_000004/actor/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(split / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_rollout_worker_lost_in_the_first_step_is_one_line_saying_how_to_start_again(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    def worker_lost(self, index):
        raise RolloutWorkerError("rollout worker 0 died", worker=0)

    monkeypatch.setattr(Trainer, "roll_out", worker_lost)
    with pytest.raises(ConfigError, match="stopped in the run's first step, before any update .rollout worker 0 "
                                          "died.; nothing was saved: run the command again, with run.overwrite=true"):
        train(config(tiny_model_dir, tmp_path, "algorithm.advantage=grpo", "run.steps=2"))


def test_the_kl_adaptive_rate_follows_each_update_and_a_resume_keeps_it(tiny_model_dir, tmp_path):
    """``optim.kl_adaptive_target``: each update's scale is the rule applied to the update before's KL, the rate
    is the scale times the schedule, and a run resumed at step 2 goes on as the uninterrupted one."""
    extra = ["optim.kl_adaptive_target=0.0005", "optim.kl_adaptive_min=0.3", "optim.kl_adaptive_max=2",
             "optim.actor_lr=1e-3", "algorithm.micro_batch_size=1", "algorithm.mini_batch_size=2"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=4", f"resume={tmp_path / 'split'}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(tmp_path / "split")
    scale = 1.0
    for step in (1, 2, 3, 4):
        scale = kl_adaptive_scale(scale, one[step]["actor/approx_kl"], 0.0005, 0.3, 2.0)
        assert one[step]["actor/lr_scale"] == pytest.approx(scale)
        assert one[step]["actor/lr"] == pytest.approx(1e-3 * scale)  # the rate the next update takes
        assert comparable(one[step]) == comparable(two[step]), step
    assert len({round(one[step]["actor/lr_scale"], 9) for step in one}) > 1  # the scale moved
    final = "checkpoints/step_000004/actor/model.safetensors"
    a, b = load_file(tmp_path / "straight" / final), load_file(tmp_path / "split" / final)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_sft_with_lora_continues_exactly(tiny_model_dir, tmp_path):
    extra = ["lora.enabled=true", "lora.r=4", "sft.enabled=true", "sft.episodes=8", "sft.epochs=1",
             "sft.batch_size=8", "sft.micro_batch_size=8", "sft.warmup_steps=0", "algorithm.advantage=grpo"]
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", name="straight"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=2", name="split"))
    train(config(tiny_model_dir, tmp_path, *extra, "run.steps=3", f"resume={tmp_path / 'split'}", name="split"))
    one, two = step_records(tmp_path / "straight"), step_records(tmp_path / "split")
    assert comparable(one[3]) == comparable(two[3])


def test_a_resume_trains_with_the_optimizer_settings_it_is_given(tiny_model_dir, tmp_path, capsys):
    """Loading the optimizers' states brings back the settings they were saved with; the resume's own win."""
    train(config(tiny_model_dir, tmp_path, "optim.actor_lr=1e-3", "optim.critic_lr=1e-3", "run.steps=2"))
    run = tmp_path / "run"
    train(config(tiny_model_dir, tmp_path, "run.steps=3", f"resume={run}", "optim.actor_lr=1e-5",
                 "optim.critic_lr=2e-5", "optim.weight_decay=0.5", "optim.adam_eps=1e-6"))
    assert "optim.actor_lr: 0.001 -> 1e-05" in capsys.readouterr().out
    records = step_records(run)
    assert records[2]["actor/lr"] == 1e-3 and records[3]["actor/lr"] == 1e-5
    state = torch.load(run / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=False)
    actor, critic = state["actor_optimizer"]["param_groups"][0], state["critic_optimizer"]["param_groups"][0]
    assert (actor["lr"], actor["initial_lr"], actor["weight_decay"], actor["eps"]) == (1e-5, 1e-5, 0.5, 1e-6)
    assert (critic["lr"], critic["weight_decay"], critic["eps"]) == (2e-5, 0.5, 1e-6)
    assert state["actor_scheduler"]["base_lrs"] == [1e-5]


def test_a_resume_that_changes_the_lora_settings_is_refused(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "lora.enabled=true", "lora.r=4", "algorithm.advantage=grpo",
                 "run.steps=1"))
    message = resume_error(tmp_path / "run", "run.steps=2", "lora.r=8", "lora.target_modules=q_proj")
    assert "lora.r: 4 -> 8; lora.target_modules: 'all-linear' -> 'q_proj'" in message
    assert "model.path=" in message and "step_000001" in message


def resume_error(run: Path, *overrides: str) -> str:
    """The one-line error of ``turnrl train resume=RUN ...``, which must stop cleanly."""
    with pytest.raises(SystemExit) as info:
        main(["train", f"resume={run}", *overrides])
    message = str(info.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_a_resume_check_of_the_optimizers_own_is_said_as_it_is(tiny_model_dir, tmp_path, monkeypatch):
    """A ConfigError is a ValueError: read as a trainer state's fault, its own words were lost to "is not this run's
    trainer state"."""
    from turnrl.training.parallel.single import SingleProcess

    train(config(tiny_model_dir, tmp_path, "run.steps=1"))

    def refuse(*args, **kwargs):
        raise ConfigError("the optimizers' own check failed: do this")

    monkeypatch.setattr(SingleProcess, "restore_optimizers", refuse)
    assert resume_error(tmp_path / "run", "run.steps=2") == "error: the optimizers' own check failed: do this"


def test_a_resume_over_damaged_checkpoints_goes_on_from_a_complete_one_or_changes_nothing(tiny_model_dir, tmp_path,
                                                                                          capsys):
    extra = ["algorithm.advantage=grpo", "run.save_every=1"]
    train(config(tiny_model_dir, tmp_path, *extra))
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    recorded = (run / "config.yaml").read_text()
    first_weights = (checkpoints / "step_000001" / "actor" / "model.safetensors").read_bytes()
    # Nothing complete to resume from: one line says what is broken, and the run is left as it was.
    (checkpoints / "step_000002" / "trainer_state.pt").unlink()
    os.truncate(checkpoints / "step_000001" / "actor" / "model.safetensors", 1000)
    message = resume_error(run, "run.steps=4")
    assert ("holds no complete checkpoint (step_000002, the checkpoint checkpoints/latest names, is incomplete "
            "(no trainer_state.pt); step_000001 is incomplete (actor/model.safetensors is damaged: ") in message
    assert f"turnrl train --config {run / 'config.yaml'} run.overwrite=true" in message
    assert (run / "config.yaml").read_text() == recorded
    # With step 1 whole again, the resume goes on from it and says so.
    (checkpoints / "step_000001" / "actor" / "model.safetensors").write_bytes(first_weights)
    capsys.readouterr()
    assert main(["train", f"resume={run}", "run.steps=3"]) == 0
    assert ("step_000002, the checkpoint checkpoints/latest names, is incomplete (no trainer_state.pt); resuming "
            "from step_000001, the newest complete checkpoint") in capsys.readouterr().out
    assert [r["step"] for r in records(run)] == [0, 1, 2, 3, 3]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000001", "step_000002", "step_000003"]
    assert load_config(TrainConfig, run / "config.yaml").run.steps == 3
    # Fewer steps than the run has done would label a later state as an earlier step: refused, nothing changed.
    recorded = (run / "config.yaml").read_text()
    assert "goes on after step 3, past run.steps=2: give run.steps=3 or more" in resume_error(run, "run.steps=2")
    assert (run / "config.yaml").read_text() == recorded
    # A failure found only when the checkpoint loads (saved by two processes) leaves config.yaml as it was too.
    state = torch.load(checkpoints / "step_000003" / "trainer_state.pt", weights_only=False)
    torch.save({**state, "world_size": 2}, checkpoints / "step_000003" / "trainer_state.pt")
    recorded = (run / "config.yaml").read_text()
    assert "was saved by 2 process(es)" in resume_error(run, "run.steps=5")
    assert (run / "config.yaml").read_text() == recorded
    # So does a trainer state whose archive is whole but whose contents are not.
    with zipfile.ZipFile(checkpoints / "step_000003" / "trainer_state.pt") as archive:
        entries = {info.filename: archive.read(info) for info in archive.infolist()}
    with zipfile.ZipFile(checkpoints / "step_000003" / "trainer_state.pt", "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, b"not a pickle" if name.endswith("data.pkl") else data)
    message = resume_error(run, "run.steps=5")
    assert f"{checkpoints / 'step_000003' / 'trainer_state.pt'} cannot be read (" in message
    assert "move step_000003 away to resume from an earlier checkpoint" in message
    assert (run / "config.yaml").read_text() == recorded


@settings(max_examples=100, deadline=None)
@given(text=st.text(), step=st.integers(-3, 10))
def test_resuming_over_any_metrics_file_never_raises(tmp_path_factory, text, step):
    folder = tmp_path_factory.mktemp("any")
    (folder / "metrics.jsonl").write_text(text)
    MetricsLogger(folder, tensorboard=False, resume_step=step).close()
    for record in records(folder):
        assert not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step)


def test_a_run_that_keeps_no_weights_and_a_checkpoint_that_would_not_fit_end_with_their_summary(
        tiny_model_dir, tmp_path, monkeypatch):
    """``run.save_at_end=false`` ends without a checkpoint; a checkpoint the disk cannot hold is not written
    (no partial folder), and the run still ends with its summary, which says why."""
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=1", "run.save_at_end=false", name="nosave"))
    assert summary["steps"] == 1 and not (tmp_path / "nosave" / "checkpoints").exists()
    assert (tmp_path / "nosave" / "summary.json").is_file()

    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    summary = train(config(tiny_model_dir, tmp_path, "run.steps=2", "run.save_every=1", name="full"))
    assert summary["steps"] == 2
    assert summary["checkpoint_not_written"]["step"] == 2  # the periodic save at step 1 was refused too
    assert "GB free" in summary["checkpoint_not_written"]["why"]
    assert not (tmp_path / "full" / "checkpoints").exists()
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["checkpoint_not_written"]["step"] == 2


def test_a_run_logs_every_metric_the_collapse_plateau_and_format_figures_draw(warm_run):
    from turnrl.viz.plots import COLLAPSE_METRICS, FORMAT_METRICS, PLATEAU_METRICS

    logged = {key for record in records(warm_run) for key in record}
    drawn = {metric.name for metric in (*COLLAPSE_METRICS, *PLATEAU_METRICS, *FORMAT_METRICS)}
    # This run has no KL term (no reference model): its figure leaves that panel out.
    assert drawn - logged == {"actor/kl_ref"}


def test_levels_follow_the_seed_only_when_asked(tiny_model_dir, tmp_path):
    """Two runs of seed 1: on the paired levels by default, on the seed's own with seeds.levels_follow_seed."""
    from turnrl.config import LEVELS_PER_SEED

    first_levels = {}
    for follow in (False, True):
        name = f"follow_{follow}"
        train(config(tiny_model_dir, tmp_path, "sft.enabled=false", "run.steps=1", "seeds.seed=1",
                     f"seeds.levels_follow_seed={str(follow).lower()}", name=name))
        first_levels[follow] = min(t["seed"] for t in trajectories(tmp_path / name, 1))
    assert first_levels[False] == 10_000
    assert first_levels[True] == 10_000 + LEVELS_PER_SEED


def test_the_actor_learning_rate_follows_a_cosine_schedule_after_its_warm_up(tiny_model_dir, tmp_path):
    train(config(tiny_model_dir, tmp_path, "algorithm.advantage=grpo", "run.steps=4", "optim.warmup_steps=1",
                 "optim.lr_schedule=cosine", "optim.min_lr_ratio=0.2"))
    steps = step_records(tmp_path / "run")
    # Logged after each step's update: the rate the next step trains with (1e-3 times the factor); the first
    # step trained at the warm-up's 1, the next three fall along the half cosine from 1 to the floor at step 4.
    after = [steps[s]["actor/lr"] / 1e-3 for s in sorted(steps)]
    assert after == pytest.approx([0.2 + 0.8 * (1 + math.cos(math.pi * k / 3)) / 2 for k in range(4)])
