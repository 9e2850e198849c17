"""The engine's model families: each record's names, norms, sliding-window field and vision side match its
transformers models (tiny, random weights), a record that would run a model wrongly cannot be made, a model no
record names is refused with the families that exist and how to add one, and a Llama 3 model (its RoPE scaling,
tied embeddings) runs on the Llama record."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    MistralConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLForConditionalGeneration,
)

from tests.engine.test_llm_engine import ARCHITECTURES, GREEDY, build, engine_for, hf_greedy, random_prompts
from tests.engine.test_qwen2_vl import full_forward_logprobs, image, joined, message, qwen2_vl_config
from tests.engine.test_qwen3_vl import qwen3_vl_config
from turnrl.config import EngineConfig
from turnrl.engine.cache import PAGE_TOKENS
from turnrl.engine.families import (
    FAMILIES,
    Family,
    Rotary,
    UnsupportedModel,
    VisionParts,
    by_model_type,
    family_of,
)
from turnrl.engine.llm_engine import Engine, Result, SamplingParams
from turnrl.engine.weights import decoder_weights
from turnrl.models.vlm import vlm_config

MODEL_TYPES = [model_type for family in FAMILIES for model_type in family.model_types]
VISION_MODEL_TYPES = [model_type for family in FAMILIES if family.vision is not None
                      for model_type in family.model_types]


@pytest.fixture(scope="module")
def models(tiny_tokenizer) -> dict[str, torch.nn.Module]:
    """A tiny model of every model type the records name."""
    made = {name: build(name) for name in ARCHITECTURES}
    made["qwen2_vl"] = Qwen2VLForConditionalGeneration(qwen2_vl_config(tiny_tokenizer))
    made["qwen2_5_vl"] = Qwen2_5_VLForConditionalGeneration(vlm_config("vlm-tiny", tiny_tokenizer))
    made["qwen3_vl"] = Qwen3VLForConditionalGeneration(qwen3_vl_config(tiny_tokenizer))
    return made


def test_every_model_type_of_the_records_is_checked_here(models):
    assert sorted(models) == sorted(MODEL_TYPES)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_record_names_its_models_weights_norms_and_vision_side(models, model_type):
    model = models[model_type]
    family = family_of(model.config)
    assert model.config.model_type == model_type and model_type in family.model_types
    names = family.weights
    decoder = model.get_submodule(names.decoder)
    for name in (names.layers, names.embed, names.final_norm, names.rotary):
        decoder.get_submodule(name)
    model.get_submodule(names.lm_head)
    for layer in decoder.get_submodule(names.layers):
        modules = dict(layer.named_modules())
        for name in (names.input_norm, *names.qkv, names.o, names.post_norm, *names.gate_up, names.down):
            assert name in modules
        # A family without q/k norms whose model had them would compute other queries and keys.
        assert (names.q_norm in modules, names.k_norm in modules) == (family.qk_norm, family.qk_norm)
    decoder_config = family.decoder_config(model.config)
    if family.sliding_window is not None:
        assert hasattr(decoder_config, family.sliding_window)
    else:  # nothing the engine would have to refuse
        assert not getattr(decoder_config, "use_sliding_window", False)
        assert getattr(decoder_config, "sliding_window", None) is None
    weights = decoder_weights(model, torch.float32)
    assert weights.family is family and weights.shape.num_layers == len(decoder.get_submodule(names.layers))
    assert (weights.vision is not None) == (family.vision is not None)
    if family.vision is not None:
        parts = family.vision
        assert callable(model.get_submodule(parts.tower).get_image_features)
        for field in (parts.image_token, parts.video_token, *parts.never_sampled):
            assert isinstance(getattr(model.config, field), int)
        assert isinstance(getattr(model.config.vision_config, parts.merge_size), int)
        assert parts.deepstack == bool(getattr(model.config.vision_config, "deepstack_visual_indexes", None))


def test_a_model_no_family_names_is_refused_with_the_families_that_exist_and_how_to_add_one():
    config = type("Config", (), {"model_type": "gemma"})()
    with pytest.raises(UnsupportedModel) as refused:
        family_of(config)
    message = str(refused.value)
    assert "not 'gemma'" in message and "model.backend=hf" in message
    assert all(model_type in message for model_type in MODEL_TYPES)
    assert "turnrl/engine/families.py" in message and "Adding a model family" in message


def test_a_model_type_in_two_families_is_refused():
    with pytest.raises(ValueError, match="'x' is in two families: A and B"):
        by_model_type((Family("A", ("x",)), Family("B", ("y", "x"))))


def test_a_vision_side_goes_with_m_rope_and_m_rope_with_a_vision_side():
    """Image tokens take M-RoPE positions (images.py), and M-RoPE positions come from images."""
    with pytest.raises(ValueError, match="rotary=rope and a vision side"):
        Family("X", ("x",), vision=VisionParts())
    with pytest.raises(ValueError, match="rotary=mrope and no vision side"):
        Family("X", ("x",), rotary=Rotary.MROPE)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 64}
"""Long factors past 64 positions: a model's rotary module called for a longer table than that turns every
position by them, where the model turns a shorter sequence by the short ones."""


@pytest.mark.parametrize(("config", "reason"), [
    (MistralConfig(sliding_window=16), "sliding-window"),
    (LlamaConfig(mlp_bias=True), "MLP has no biases"),
    (LlamaConfig(hidden_act="gelu"), "SwiGLU"),
    (LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic RoPE"),
    (LlamaConfig(head_dim=16, rope_parameters=dict(LONGROPE)), "longrope RoPE"),
    (LlamaConfig(partial_rotary_factor=0.5), "turns a share of 0.5"),  # Phi-4-mini's: a shape error before
])
def test_settings_the_decoder_does_not_compute_are_refused_with_the_reason(config, reason):
    with pytest.raises(UnsupportedModel, match=reason):
        family_of(config).check(config)


def test_rope_scaling_whose_factors_depend_on_the_sequence_length_is_refused_where_the_engine_would_run_it():
    """The engine takes its rotary table once, for every position a row can hold: with ``longrope`` that table is
    the long factors', and a short prompt's logprobs would be several nats off the model's. A config with one set of
    RoPE parameters per layer type is read the same way."""
    model = build("llama", head_dim=16, rope_parameters=dict(LONGROPE), max_position_embeddings=256)
    with pytest.raises(UnsupportedModel, match="longrope RoPE scaling .* depend on the sequence's length"):
        engine_for(model, max_len=200)
    config = LlamaConfig()
    config.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}
    with pytest.raises(UnsupportedModel, match="dynamic RoPE"):
        family_of(config).check(config)


def test_a_mistral_model_without_a_sliding_window_is_run():
    config = MistralConfig(sliding_window=None)
    family_of(config).check(config)


def test_a_llama_3_model_runs_on_the_llama_record_with_generates_greedy_tokens():
    """Llama 3's RoPE scaling (``rope_type: llama3``: long wavelengths stretched, fixed whatever the length) is in
    the rotary module's table, which the engine takes; Llama 3.2's embeddings are tied to the LM head. A wavelength
    bound of 64 positions stretches some of the tiny model's frequencies."""
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = build("llama", rope_scaling=rope, tie_word_embeddings=True)
    assert model.model.rotary_emb.rope_type == "llama3" and model.lm_head.weight is model.model.embed_tokens.weight
    prompts = random_prompts([5, 40, 11])
    results = engine_for(model).generate(prompts, [GREEDY] * len(prompts))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model, prompt, 12)


@pytest.mark.parametrize("model_type", VISION_MODEL_TYPES)
def test_a_tower_sees_the_same_pixels_kept_in_its_dtype_as_in_float32(models, model_type):
    """The engine keeps a rollout's pixel values in its own dtype (``ImageEncoder``'s ``pixel_dtype``: half the
    bytes to carry, gather and move): the tower's first step casts its pixels to that dtype, so its features
    from pixels kept in it are the features from the processor's float32, bit for bit."""
    model = copy.deepcopy(models[model_type]).to(torch.bfloat16)
    vision = decoder_weights(model, torch.bfloat16).vision
    assert vision is not None
    tower = model.config.vision_config
    grids = torch.tensor([[1, 4, 4], [1, 2, 6]])
    pixels = torch.randn(int(grids.prod(-1).sum()), tower.in_channels * tower.temporal_patch_size * tower.patch_size**2,
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        made, kept = vision.features(pixels, grids), vision.features(pixels.to(torch.bfloat16), grids)
    assert torch.equal(made.merged, kept.merged)
    assert len(made.deepstack) == len(kept.deepstack)
    assert all(torch.equal(a, b) for a, b in zip(made.deepstack, kept.deepstack))


@pytest.mark.parametrize("model_type", VISION_MODEL_TYPES)
def test_each_vlm_s_sampled_logprobs_equal_its_forward_over_turns_past_a_page_and_chunks_through_images(
        models, tiny_tokenizer, model_type):
    """Every VLM record against its transformers model (Qwen2.5-VL's windowed tower included): an episode of five
    image turns grows past the cache's 128-position pages, each turn extending the cached row, and prefill chunks
    of 40 tokens cut through images (a chunk encodes a whole image and takes the rows of its tokens). Sampled at
    temperature 1, each turn's logprobs are the model's full forward pass over the whole episode so far."""
    model = models[model_type]
    patch = model.config.vision_config.patch_size
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=patch), tokenizer=tiny_tokenizer,
                                 video_processor=Qwen2VLVideoProcessor(patch_size=patch),
                                 chat_template=tiny_tokenizer.chat_template)
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=2, max_seq_len=640, triton="false",
                                        prefill_chunk_tokens=40))
    side = 8 * patch  # 4 x 4 tokens an image
    prompt, inputs = message(processor, "Where next? " * 8, image(side, side, seed=1), first=True)
    torch.manual_seed(0)
    observation: list[int] = []
    for turn in range(5):
        engine.submit(prompt, SamplingParams(temperature=1.0, max_new_tokens=10), inputs)
        finished: list[Result] = []
        while not finished:
            finished = engine.step()
        (result,) = finished
        assert result.reused_tokens == (0 if turn == 0 else len(prompt) - len(observation) - 1)
        torch.testing.assert_close(torch.tensor(result.logprobs),
                                   full_forward_logprobs(model, prompt, result.token_ids, inputs), atol=1e-4, rtol=0)
        observation, seen = message(processor, "And now?", image(side - 2 * patch * (turn % 2), side, seed=turn),
                                    first=False)
        prompt, inputs = prompt + result.token_ids + observation, joined(inputs, seen)
    assert len(prompt) > 2 * PAGE_TOKENS
