"""RL and SFT with a VLM on image observations (the built-in tiny Qwen2.5-VL, visual FrozenLake):
updates in both sample modes, with a critic on the VLM backbone, LoRA beside a frozen vision tower,
and SFT on visual expert demos."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from turnrl.config import load_config
from turnrl.training.commands import train
from turnrl.training.train_config import TrainConfig

COMMON = [
    "model.device=cpu", "model.dtype=float32", "run.tensorboard=false", "run.trajectories_every=1",
    "env.id=FrozenLake", "env.settings.mode=image", "agent.format=no_think", "agent.env_instructions=false",
    "agent.format_instructions=false", "agent.system_prompt=FrozenLake. Reach G. Answer <answer>Left|Down|Right|Up</answer>.",
    "agent.max_turns=2", "sampling.max_new_tokens=8", "groups.n_groups=2", "groups.group_size=2",
    "validation.episodes=2", "run.steps=2", "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
    "optim.actor_lr=1e-3", "optim.critic_lr=1e-3",
]


def run(model_dir, out: Path, *overrides: str) -> tuple[dict, list[dict]]:
    config = load_config(TrainConfig, None, [*COMMON, f"model.path={model_dir}", f"run.output_dir={out}", *overrides])
    summary = train(config)
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, [r for r in records if "rollout/success" in r]


def vision_weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(path / "model.safetensors").items() if "visual" in k}


@pytest.mark.parametrize(("mode", "advantage"), [("trajectory", "gae"), ("turn", "bilevel_gae")])
def test_ppo_with_a_critic_on_image_observations(tiny_vlm_dir, tmp_path, mode, advantage):
    summary, steps = run(tiny_vlm_dir, tmp_path, f"algorithm.sample_mode={mode}", f"algorithm.advantage={advantage}")
    assert len(steps) == 2 and summary["steps"] == 2
    for record in steps:
        assert record["actor/grad_norm"] > 0 and record["critic/grad_norm"] > 0
        assert record["actor/logprob_mismatch"] < 1e-4  # the batch holds the sampled tokens, images included
    actor = tmp_path / "run" / "checkpoints" / "step_000002" / "actor"
    before, after = vision_weights(Path(tiny_vlm_dir)), vision_weights(actor)
    assert before and all(torch.equal(before[k], after[k]) for k in before)  # the vision tower stays frozen
    language = load_file(actor / "model.safetensors")
    base = load_file(Path(tiny_vlm_dir) / "model.safetensors")
    assert any(not torch.equal(language[k], base[k]) for k in base if "visual" not in k)
    step_file = tmp_path / "run" / "trajectories" / "step_000001.jsonl"
    step = [json.loads(line) for line in step_file.read_text().splitlines()]
    assert all(record["images"] for record in step)  # image files beside the trajectories


def test_grpo_with_lora_leaves_the_vision_tower_out_and_trains_it_when_asked(tiny_vlm_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    _, steps = run(tiny_vlm_dir, tmp_path / "frozen", "algorithm.advantage=grpo", "algorithm.sample_mode=turn",
                   "lora.enabled=true", "lora.r=4", "lora.alpha=8", "algorithm.kl_coef=0.05")
    # generation through the adapters gives image tokens the same 3D positions as training does
    assert all(record["actor/logprob_mismatch"] < 1e-4 for record in steps)
    adapters = load_file(tmp_path / "frozen" / "run" / "checkpoints" / "step_000002" / "actor" /
                         "adapter_model.safetensors")
    assert adapters and not any("visual" in k for k in adapters)
    assert all(record["throughput/update_mfu_counts_vision"] == 0.0 for record in steps)
    _, trained = run(tiny_vlm_dir, tmp_path / "trained", "algorithm.advantage=grpo", "lora.enabled=true", "lora.r=4",
                     "lora.alpha=8", "model.train_vision=true")
    assert all(record["throughput/update_mfu_counts_vision"] == 1.0 for record in trained)
    assert not any("vision/images_encoded" in record for record in trained)  # a trained tower encodes each pass
    adapters = load_file(tmp_path / "trained" / "run" / "checkpoints" / "step_000002" / "actor" /
                         "adapter_model.safetensors")
    assert any("visual" in k for k in adapters)
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir),
                                      tmp_path / "trained" / "run" / "checkpoints" / "step_000002" / "actor")
    assert model is not None


def test_sft_on_visual_expert_demos_then_rl(tiny_vlm_dir, tmp_path):
    summary, steps = run(tiny_vlm_dir, tmp_path, "sft.enabled=true", "sft.episodes=24", "sft.epochs=4", "sft.lr=3e-3",
                         "sft.batch_size=8", "sft.micro_batch_size=8", "sft.warmup_steps=1", "algorithm.advantage=grpo")
    assert summary["sft/steps"] >= 3 and summary["sft/final_epoch_loss"] > 0
    sft_losses = [json.loads(line)["sft/loss"] for line in (tmp_path / "run" / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert sft_losses[-1] < 0.5 * sft_losses[0]  # the demos are learned, images and all
    sft_model = tmp_path / "run" / "sft" / "model"
    assert (sft_model / "preprocessor_config.json").exists() or (sft_model / "processor_config.json").exists()
    demos = [json.loads(line) for line in (tmp_path / "run" / "sft" / "demos_sample.jsonl").read_text().splitlines()]
    assert demos and all(d["images"] for d in demos)
    assert len(steps) == 2


def test_an_episode_cut_by_the_context_budget_trains_in_trajectory_mode(tiny_vlm_dir, tmp_path):
    _, steps = run(tiny_vlm_dir, tmp_path, "algorithm.advantage=grpo", "agent.max_turns=4", "agent.max_context_tokens=130")
    assert len(steps) == 2 and all(record["rollout/truncated"] > 0 for record in steps)


def test_the_critics_vision_tower_stays_frozen_after_resume(tiny_vlm_dir, tmp_path):
    run(tiny_vlm_dir, tmp_path, "run.steps=1")
    config = load_config(TrainConfig, None, [*COMMON, f"model.path={tiny_vlm_dir}", f"resume={tmp_path / 'run'}",
                                             "run.steps=2"])
    train(config)
    critic = vision_weights(tmp_path / "run" / "checkpoints" / "step_000002" / "critic")
    base = {k.removeprefix("model."): v for k, v in vision_weights(Path(tiny_vlm_dir)).items()}
    assert critic and all(torch.equal(v, base[k]) for k, v in critic.items() if k in base)


@pytest.mark.parametrize("mode", ["trajectory", "turn"])
def test_images_encoded_once_a_step_train_as_when_every_pass_encodes(tiny_vlm_dir, tmp_path, mode):
    """A frozen tower's features made once a step (the images named by the rollout's digests, so an image
    a later turn's prompt shows again is encoded once) give the update every pass's own encoding gives."""
    options = (f"algorithm.sample_mode={mode}", "algorithm.advantage=gae", "algorithm.kl_coef=0.05")
    _, once = run(tiny_vlm_dir, tmp_path / "once", *options)
    _, every = run(tiny_vlm_dir, tmp_path / "every", *options, "model.encode_images_once=false")
    for a, b in zip(once, every):
        assert a["vision/images_encoded"] > 0 and a["vision/images_reused"] > 0
        assert "vision/images_encoded" not in b
        for key in ("actor/grad_norm", "critic/grad_norm", "losses/policy", "actor/kl_ref", "actor/logprob_mismatch"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    if mode == "turn":  # each turn's prompt shows the earlier turns' images again: encoded once
        assert once[0]["vision/images_reused"] > once[0]["vision/images_encoded"]
