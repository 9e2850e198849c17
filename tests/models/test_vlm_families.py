"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL, each built small from its transformers config with its own
processor, saved and loaded by path like a downloaded checkpoint: a multi-turn image rollout samples
tokens whose logprobs a training forward pass reproduces (the same images, the same 3D positions), and
every sample has one placeholder per visual token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, ModelConfig, SamplingConfig
from turnrl.envs import make
from turnrl.policy.hf import HFPolicy
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.training.batch import collate, turn_samples
from turnrl.training.head import install_scoring_head
from turnrl.training.model_passes import token_logprobs
from turnrl.training.packed_attention import ATTENTION, CUDNN_ATTENTION

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, spatial_merge_size=2,
              temporal_patch_size=2)


def build(family: str, tokenizer, out: Path) -> Path:
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>")
           for name in ("image_pad", "video_pad", "vision_start", "vision_end")}
    tokens = dict(image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
                  vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"])
    vocab = len(tokenizer) + 64
    pixels = dict(min_pixels=28 * 28, max_pixels=112 * 112)
    if family == "qwen3_vl":
        config = Qwen3VLConfig(
            text_config={**TEXT, "head_dim": 16, "vocab_size": vocab,
                         "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
            vision_config={**VISION, "depth": 2, "patch_size": 16, "deepstack_visual_indexes": [0]}, **tokens)
        model = Qwen3VLForConditionalGeneration(config)
        processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16, **pixels),
                                     video_processor=Qwen3VLVideoProcessor(), tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template)
    else:
        text = {**TEXT, "vocab_size": vocab, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
        vision = {**VISION, "depth": 1, "patch_size": 14}
        if family == "qwen2_vl":
            vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
            model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **tokens))
            processor_class = Qwen2VLProcessor
        else:
            vision["fullatt_block_indexes"] = [0]
            model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                                        **tokens))
            processor_class = Qwen2_5_VLProcessor
        processor = processor_class(image_processor=Qwen2VLImageProcessor(**pixels),
                                    video_processor=Qwen2VLVideoProcessor(), tokenizer=tokenizer,
                                    chat_template=tokenizer.chat_template)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_vlm_of_each_family_trains_on_the_tokens_it_sampled(family, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    path = build(family, AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path / family)
    policy = HFPolicy.from_config(ModelConfig(device="cpu", dtype="float32"), str(path), max_batch_size=8)
    assert policy.accepts_images
    agent = AgentConfig(format="no_think", max_turns=3, max_actions_per_episode=10)
    rollout = Rollout(policy, get_format("no_think"), agent, "Maze2D")
    slots = [EpisodeSlot(env=make("Maze2D", mode="image"), seed=s, group=s) for s in range(3)]
    trajectories = rollout.run(slots, SamplingConfig(temperature=1.0, max_new_tokens=6))
    assert all(t.status != "error" for t in trajectories), [t.error for t in trajectories]
    batch = collate(turn_samples(trajectories, [0, 1, 2]), pad_id=policy.tokenizer.pad_token_id)
    pad = policy.image_encoder.image_token_id
    merge = policy.image_encoder.merge_size
    visual_tokens = (batch.model_inputs["image_grid_thw"].prod(-1) // merge**2).split(
        batch.model_input_rows["image_grid_thw"].tolist())
    for row, tokens in enumerate(visual_tokens):
        assert int((batch.input_ids[row] == pad).sum()) == int(tokens.sum()) > 0
    install_scoring_head(policy.model, len(policy.tokenizer))  # as the trainer does: the sampler's vocabulary
    with torch.no_grad():
        logprobs, _ = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                                     model_inputs=batch.model_inputs)
    mismatch = ((logprobs - batch.sampler_logprobs).abs() * batch.loss_mask).max()
    assert mismatch < 1e-3, f"{family}: training forward and sampler disagree by {float(mismatch):.2e}"
    # Packed end to end, each row keeps its images' M-RoPE positions and attends only to itself, at its own
    # length and at cuDNN's bucketed one (on a CPU, SDPA's flash kernel runs it).
    for attention in (ATTENTION, CUDNN_ATTENTION):
        policy.model.set_attn_implementation(attention)
        with torch.no_grad():
            packed, _ = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, batch.loss_mask,
                                       model_inputs=batch.model_inputs, packed=True)
        torch.testing.assert_close(packed, logprobs, atol=1e-5, rtol=1e-5, msg=attention)
