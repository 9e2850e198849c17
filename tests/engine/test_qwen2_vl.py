"""The engine on Qwen2-VL (random weights, CPU, float32), whose vision tower differs from Qwen2.5-VL's: M-RoPE
positions equal the model's own ``get_rope_index``, greedy tokens of image turns (a second turn adds a new image
and extends the first turn's cached row; with torch's kernels and the Triton ones) equal transformers' ``generate``,
logprobs equal a full forward pass, the M-RoPE sections are the rotary module's own, and a VLM the engine cannot run
is refused with the reason."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    GenerationConfig,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from turnrl.config import EngineConfig
from turnrl.engine.images import PromptImages, prompt_images
from turnrl.engine.llm_engine import Engine, Result, SamplingParams
from turnrl.engine.weights import UnsupportedModel, decoder_weights, rope_axes
from turnrl.models.throughput import vision_training_flops

NEW_TOKENS = 8
MROPE_SECTION = [1, 4, 3]
"""Temporal, height and width sections unlike the usual 1/4, 3/8, 3/8 split and unlike their reverse: sections
read from the wrong place turn the image tokens wrongly."""


VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
"""A Qwen-VL config's vision token fields, and the tokens they name."""


def vision_token_ids(tokenizer) -> dict[str, int]:
    return {field: tokenizer.convert_tokens_to_ids(token) for field, token in VISION_TOKENS.items()}


def qwen2_vl_config(tokenizer, **text) -> Qwen2VLConfig:
    """A Qwen2-VL config laid out as the released checkpoints' (the decoder's fields at the top level, M-RoPE
    sections in ``rope_scaling``), at a tiny size."""
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, vocab_size=len(tokenizer) + 64,
                  rope_scaling={"type": "mrope", "mrope_section": MROPE_SECTION},
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    fields.update(text)
    vision = dict(depth=2, embed_dim=32, hidden_size=fields["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VLConfig(**fields, vision_config=vision, **vision_token_ids(tokenizer))


def greedy_ready(model_class, config, tokenizer):
    """``model_class(config)`` with seeded weights three times the init's (peaked logits: greedy meets no
    near-ties) and no end-of-sequence token (generate runs every sequence to its budget, as the engine does
    without stop ids)."""
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id)
    return model


@pytest.fixture(scope="module")
def model(tiny_tokenizer) -> Qwen2VLForConditionalGeneration:
    return greedy_ready(Qwen2VLForConditionalGeneration, qwen2_vl_config(tiny_tokenizer), tiny_tokenizer)


@pytest.fixture(scope="module")
def processor(tiny_tokenizer) -> Qwen2VLProcessor:
    pixels = dict(min_pixels=28 * 28, max_pixels=112 * 112)
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**pixels),
                            video_processor=Qwen2VLVideoProcessor(**pixels), tokenizer=tiny_tokenizer,
                            chat_template=tiny_tokenizer.chat_template)


def image(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def message(processor, text: str, picture: np.ndarray, first: bool) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A user message with one image (after the previous response when not ``first``) and the assistant's header:
    its tokens, placeholders expanded by the processor, and its image's model inputs."""
    opening = "" if first else "<|im_end|>\n"
    chat = (f"{opening}<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\n"
            "<|im_start|>assistant\n")
    out = processor(text=[chat], images=[picture], return_tensors="pt")
    return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def joined(*inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.cat([part[key] for part in inputs]) for key in inputs[0]}


def model_arguments(model, prompt: list[int], inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers' forward and generate take for one prompt: the 3D positions need ``mm_token_type_ids``."""
    ids = torch.tensor([prompt])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == model.config.image_token_id).int(), **inputs}


def hf_greedy(model, prompt: list[int], inputs: dict[str, torch.Tensor], new_tokens: int = NEW_TOKENS) -> list[int]:
    """``generate``'s greedy tokens with the vision tokens suppressed, as the engine never samples them."""
    suppressed = [getattr(model.config, field) for field in VISION_TOKENS]
    out = model.generate(**model_arguments(model, prompt, inputs), max_new_tokens=new_tokens, do_sample=False,
                         suppress_tokens=suppressed)
    return out[0, len(prompt):].tolist()


def full_forward_logprobs(model, prompt: list[int], response: list[int], inputs: dict[str, torch.Tensor]
                          ) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**model_arguments(model, prompt + response, inputs)).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) + len(response) - 1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def run(engine: Engine, requests: list[tuple[list[int], dict[str, torch.Tensor]]], new_tokens: int = NEW_TOKENS
        ) -> list[Result]:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    ids = [engine.submit(prompt, greedy, inputs) for prompt, inputs in requests]
    results: dict[int, Result] = {}
    while len(results) < len(ids):
        results.update({result.id: result for result in engine.step()})
    return [results[i] for i in ids]


def episodes(processor, sizes=(((56, 84), (112, 56)), ((84, 84), (28, 112)))) -> tuple[list, list]:
    """Two episodes' first and second turns; images of different shapes (their height and width positions differ;
    ``sizes`` per episode, whole patches of the processor's), each turn a new one."""
    firsts = [message(processor, "Where next?", image(*first, seed=episode), first=True)
              for episode, (first, _) in enumerate(sizes)]
    observations = [message(processor, "And now?", image(*second, seed=10 + episode), first=False)
                    for episode, (_, second) in enumerate(sizes)]
    return firsts, observations


def one_and_two_image_prompts(processor, episodes=episodes) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """An episode's first prompt, and its second (first prompt, a response, a new image)."""
    (first, _), (observation, _) = episodes(processor)
    response = processor.tokenizer.encode("Go left")
    return [first, (first[0] + response + observation[0], joined(first[1], observation[1]))]


def checked_positions(model, prompt: list[int], inputs: dict[str, torch.Tensor]) -> tuple[PromptImages, torch.Tensor]:
    """The engine's view of a prompt's images, its M-RoPE positions and delta checked against the model's own
    ``get_rope_index``; and those positions, Shape (3, 1, length)."""
    images = prompt_images(prompt, inputs, model.config.image_token_id, model.config.vision_config.spatial_merge_size)
    arguments = model_arguments(model, prompt, inputs)
    expected, delta = model.model.get_rope_index(
        arguments["input_ids"], arguments["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        attention_mask=arguments["attention_mask"])
    np.testing.assert_array_equal(images.positions, expected[:, 0].numpy())
    assert images.delta == int(delta) < 0
    return images, expected


def test_mrope_positions_equal_the_models_get_rope_index(model, processor):
    for prompt, inputs in one_and_two_image_prompts(processor):
        checked_positions(model, prompt, inputs)


@pytest.mark.parametrize(("triton", "new_tokens"),
                         [("false", NEW_TOKENS), pytest.param("true", 2, marks=pytest.mark.cpu_triton)])
def test_greedy_image_turns_equal_generate_and_the_second_extends_the_cached_row(model, processor, triton,
                                                                                new_tokens):
    """With the Triton kernels (Triton's interpreter) the turns are short: their prefills, which rotate the image
    tokens by their M-RoPE positions as they write them into the cache, are what differs from a text model's."""
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=4, max_seq_len=512, triton=triton))
    firsts, observations = episodes(processor)
    first_results = run(engine, firsts, new_tokens)
    seconds = [(prompt + result.token_ids + observation, joined(inputs, observation_inputs))
               for (prompt, inputs), result, (observation, observation_inputs)
               in zip(firsts, first_results, observations)]
    second_results = run(engine, seconds, new_tokens)
    for (prompt, inputs), result in zip(firsts + seconds, first_results + second_results):
        assert result.token_ids == hf_greedy(model, prompt, inputs, new_tokens)
        torch.testing.assert_close(torch.tensor(result.logprobs),
                                   full_forward_logprobs(model, prompt, result.token_ids, inputs),
                                   atol=1e-4, rtol=0)
    # Each second turn prefilled only its observation: its row held the first prompt and all but the last token.
    assert [r.reused_tokens for r in second_results] == [len(p) + new_tokens - 1 for p, _ in firsts]


def test_pixels_of_another_width_end_their_request_alone(model, processor):
    """Patches the tower cannot take (another processor's, cut short) are refused at submit: in the prefill's one
    tower call they failed every request of the batch."""
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=4, max_seq_len=512, triton="false"))
    (good, bad), _ = episodes(processor)
    pixels = bad[1]["pixel_values"]
    narrow = (bad[0], {**bad[1], "pixel_values": pixels[:, :-1]})
    results = run(engine, [good, narrow])
    assert results[0].finish_reason == "length" and results[0].token_ids == hf_greedy(model, *good)
    assert results[1].finish_reason == "error"
    assert f"rows of {pixels.shape[1]} floats" in (results[1].error or "")


def test_the_timer_counts_the_images_the_prefill_encodes_and_not_those_in_the_cache(model, processor):
    """The vision tower's work for a roofline: the first turns encode their images, the second turns only their
    new ones (the first images' tokens are in the rows), each image's forward FLOPs counted as the throughput
    formula counts its grid; nothing is counted while the timer is off."""
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=4, max_seq_len=512, triton="false"))
    firsts, observations = episodes(processor)
    run(engine, firsts)
    assert (engine.timer.images, engine.timer.vision_flops) == (0, 0.0)
    engine.table.clear()
    engine.timer.enabled = True

    def flops(encoded: list[tuple[list[int], dict]]) -> float:
        grids = torch.cat([inputs["image_grid_thw"] for _, inputs in encoded])
        return vision_training_flops(model.model.visual, model.config.vision_config, grids, forward_only=True)

    first_results = run(engine, firsts)
    assert engine.timer.images == len(firsts)
    assert engine.timer.vision_flops == pytest.approx(flops(firsts))
    work = engine.device_work()
    assert work["images_encoded"] == len(firsts) and work["vision_flops"] == engine.timer.vision_flops
    engine.timer.reset()
    seconds = [(prompt + result.token_ids + observation, joined(inputs, observation_inputs))
               for (prompt, inputs), result, (observation, observation_inputs)
               in zip(firsts, first_results, observations)]
    run(engine, seconds)
    assert engine.timer.images == len(observations)
    assert engine.timer.vision_flops == pytest.approx(flops(observations))


def test_image_features_are_the_towers_even_where_the_config_asks_for_tuples(model, processor, monkeypatch):
    """``return_dict=False`` in a config makes ``get_image_features`` return a tuple; the engine asks for the
    output object, whose ``pooler_output`` holds each image's merged features."""
    (first, _), (observation, _) = episodes(processor)
    inputs = joined(first[1], observation[1])
    pixels, grids = inputs["pixel_values"], inputs["image_grid_thw"]
    expected = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
    vision = decoder_weights(model, torch.float32).vision
    monkeypatch.setattr(model.config, "return_dict", False)
    torch.testing.assert_close(vision.features(pixels, grids).merged, torch.cat(expected))
    assert [len(features) for features in expected] == (grids.prod(-1) // vision.merge_size**2).tolist()


def test_mrope_sections_are_the_rotary_modules_own(tiny_tokenizer):
    """A config that names no sections rotates by the module's default, Qwen2-VL's [16, 24, 24] (head dim 128),
    where reading the config alone found none."""
    config = qwen2_vl_config(tiny_tokenizer, hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                             num_hidden_layers=1, intermediate_size=64, rope_scaling=None)
    model = Qwen2VLForConditionalGeneration(config)
    assert "mrope_section" not in config.text_config.rope_parameters
    assert model.model.language_model.rotary_emb.mrope_section == [16, 24, 24]
    assert decoder_weights(model, torch.float32).vision.rope_axes.tolist() == rope_axes([16, 24, 24], 128).tolist()


def test_a_vlm_the_engine_cannot_run_is_refused_with_the_reason(tiny_tokenizer):
    """Qwen3-VL-MoE's decoder layers are mixtures of experts, which the engine's are not."""
    config = Qwen3VLMoeConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=len(tiny_tokenizer) + 64,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, deepstack_visual_indexes=[0]),
        **vision_token_ids(tiny_tokenizer))
    with pytest.raises(UnsupportedModel, match=r"qwen3_vl VLMs, not 'qwen3_vl_moe' .*model.backend=hf"):
        Engine(Qwen3VLMoeForConditionalGeneration(config), EngineConfig(kv_cache_gb=0.1, max_rows=1, triton="false"))
