"""The RL trainer end to end on the tiny model: every estimator path, LoRA, filters, the engine, SFT warm start."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.training.trainer_runs import (
    actor_weights,
    assert_token_exact,
    base_weights,
    config,
    records,
    step_records,
    trajectories,
)
from turnrl.algorithms import seeded_group_scores
from turnrl.config import ConfigError, load_config
from turnrl.engine.cache import PAGE_TOKENS, KVCache
from turnrl.envs import make as make_env
from turnrl.envservice.placement import LocalEnvFactory
from turnrl.models.loading import decoder_layers
from turnrl.rollout.groups import EnvGroups
from turnrl.training import packed_attention
from turnrl.training import trainer as trainer_module
from turnrl.training.commands import train
from turnrl.training.device_idle import read_trace
from turnrl.training.head import ScoringHead
from turnrl.training.packed_attention import CUDNN_ATTENTION
from turnrl.training.train_config import TrainConfig
from turnrl.training.trainer import Trainer


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


def test_a_run_logs_every_metric_the_collapse_plateau_and_format_figures_draw(warm_run):
    from turnrl.viz.plots import COLLAPSE_METRICS, FORMAT_METRICS, PLATEAU_METRICS

    logged = {key for record in records(warm_run) for key in record}
    drawn = {metric.name for metric in (*COLLAPSE_METRICS, *PLATEAU_METRICS, *FORMAT_METRICS)}
    # This run has no KL term (no reference model): its figure leaves that panel out.
    assert drawn - logged == {"actor/kl_ref"}


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


def test_checkpointed_layers_reach_the_actor_and_the_critic(tiny_model_dir, tmp_path):
    trainer = Trainer(config(tiny_model_dir, tmp_path, "model.gradient_checkpointing=true",
                             "model.checkpointed_layers=1"))
    try:
        assert trainer.critic is not None
        for model in (trainer.actor, trainer.critic.backbone):
            assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False]
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


# --------------------------------------------------------------------------- validation, levels, learning rate, rewards
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


def test_a_bad_reward_spec_stops_the_run_before_sft(tiny_model_dir, tmp_path):
    bad = config(tiny_model_dir, tmp_path, "sft.enabled=true",
                 "rewards.extra=[{name: judge, fn: 'tests.nowhere:judge'}]")
    with pytest.raises(ConfigError, match="cannot import module 'tests.nowhere'"):
        train(bad)
    assert not (tmp_path / "run" / "sft").exists()


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
