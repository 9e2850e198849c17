"""The engine on Qwen3-VL (random weights, CPU, float32), whose decoder differs from Qwen2-VL's: M-RoPE positions
equal the model's own ``get_rope_index`` and its tokens turn by the cos/sin rows its rotary module gives them (the
axes interleaved over the rotary dims); greedy tokens of image turns (a second turn adds a new image and extends the
first turn's cached row) equal transformers' ``generate``, and logprobs a full forward pass, which needs the vision
tower's deepstack features added to the right decoder layers' outputs, with torch's kernels and the Triton ones."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from tests.engine.paging import filled_cache
from tests.engine.test_qwen2_vl import (
    VISION_TOKENS,
    checked_positions,
    full_forward_logprobs,
    greedy_ready,
    hf_greedy,
    image,
    joined,
    message,
    model_arguments,
    one_and_two_image_prompts,
    run,
    vision_token_ids,
)
from tests.engine.test_qwen2_vl import episodes as qwen2_vl_episodes
from turnrl.config import EngineConfig
from turnrl.engine.forward import Deepstack, decoder_forward, mrope_rows, rotary_table
from turnrl.engine.images import image_digest, placeholder_spans
from turnrl.engine.llm_engine import Engine
from turnrl.engine.weights import decoder_weights, rope_axes

HEAD_DIM = 32
MROPE_SECTION = [6, 4, 6]
"""Interleaved over 16 half dims: height at 1, 4, 7, 10 (below 3 * 4), width at 2, 5, 8, 11, 14, time at the rest
(seven dims, not six): laid out in runs, or from the default [24, 20, 20], they would turn image tokens wrongly."""
DEEPSTACK_INDEXES = [0, 1]
"""Vision blocks whose features the decoder's first two layers (of three) add: added after the wrong layer, or not
at all, the image tokens' hidden states differ."""


def qwen3_vl_config(tokenizer, **text) -> Qwen3VLConfig:
    """A Qwen3-VL config laid out as the released checkpoints' (M-RoPE sections and the interleaved flag in the text
    config's ``rope_scaling``), at a tiny size."""
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=1024,
                  vocab_size=len(tokenizer) + 64,
                  rope_scaling={"rope_type": "default", "mrope_section": MROPE_SECTION, "mrope_interleaved": True})
    fields.update(text)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=fields["hidden_size"],
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=DEEPSTACK_INDEXES)
    return Qwen3VLConfig(text_config=fields, vision_config=vision, **vision_token_ids(tokenizer))


@pytest.fixture(scope="module")
def model(tiny_tokenizer) -> Qwen3VLForConditionalGeneration:
    return greedy_ready(Qwen3VLForConditionalGeneration, qwen3_vl_config(tiny_tokenizer), tiny_tokenizer)


@pytest.fixture(scope="module")
def processor(tiny_tokenizer) -> Qwen3VLProcessor:
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16, min_pixels=32 * 32,
                                                                  max_pixels=128 * 128),
                            video_processor=Qwen3VLVideoProcessor(), tokenizer=tiny_tokenizer,
                            chat_template=tiny_tokenizer.chat_template)


def episodes(processor) -> tuple[list, list]:
    """:func:`tests.engine.test_qwen2_vl.episodes` with images in Qwen3-VL's patches of 16 pixels."""
    return qwen2_vl_episodes(processor, sizes=(((64, 96), (128, 64)), ((96, 96), (32, 128))))


def test_mrope_positions_and_rotary_rows_equal_the_models_own(model, processor):
    weights = decoder_weights(model, torch.float32)
    table = rotary_table(weights, 512, torch.device("cpu"))
    for prompt, inputs in one_and_two_image_prompts(processor, episodes):
        images, expected = checked_positions(model, prompt, inputs)
        cos, sin = model.model.language_model.rotary_emb(torch.zeros(1), expected)
        positions = torch.from_numpy(images.positions.T)
        for ours, theirs in zip(table, (cos[0], sin[0])):
            torch.testing.assert_close(mrope_rows(ours, positions, weights.vision.rope_axes), theirs)


def test_mrope_sections_are_the_rotary_modules_own_and_interleaved(tiny_tokenizer):
    """A config that names no sections rotates by the module's default, Qwen3-VL's [24, 20, 20] (head dim 128)."""
    config = qwen3_vl_config(tiny_tokenizer, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                             head_dim=128, num_hidden_layers=1, intermediate_size=64, rope_scaling=None)
    model = Qwen3VLForConditionalGeneration(config)
    assert "mrope_section" not in config.text_config.rope_parameters
    axes = decoder_weights(model, torch.float32).vision.rope_axes
    assert axes.tolist() == rope_axes([24, 20, 20], 128, interleaved=True).tolist()
    assert axes[:64].bincount().tolist() == [24, 20, 20] and axes[:6].tolist() == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize(("triton", "new_tokens"),
                         [("false", 8), pytest.param("true", 2, marks=pytest.mark.cpu_triton)])
def test_greedy_image_turns_equal_generate_and_the_second_extends_the_cached_row(model, processor, triton,
                                                                                new_tokens):
    """With the Triton kernels (Triton's interpreter) the turns are short: their prefills, which take the images,
    are what differs from text Qwen3, whose decode those kernels run elsewhere."""
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=4, max_seq_len=128, triton=triton))
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


def test_an_image_partly_in_the_cached_row_adds_the_deepstack_features_of_its_tokens_prefilled(model, processor):
    """A prompt that ends in an image, sent again, reuses its row but for the last token (its logits are needed):
    that placeholder alone is prefilled, with its own row of the merged and deepstack features. (Tokens are checked
    against a forward pass, not ``generate``: after a prompt that ends in an image, ``generate`` turns the next
    token by the image's last position plus one on each axis, where the model's forward and the engine put it past
    the image's larger side on all three.)"""
    prompt, inputs = message(processor, "", image(128, 128, seed=3), first=True)
    prompt = prompt[: max(end for _, end in placeholder_spans(prompt, model.config.image_token_id))]
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=2, max_seq_len=128, triton="false"))
    first, again = run(engine, [(prompt, inputs)], 4) + run(engine, [(prompt, inputs)], 4)
    assert again.reused_tokens == len(prompt) - 1 >= 16
    with torch.no_grad():
        logits = model(**model_arguments(model, prompt + again.token_ids, inputs)).logits[0, len(prompt) - 1 : -1]
    logits[:, [getattr(model.config, field) for field in VISION_TOKENS]] = float("-inf")  # never sampled
    assert again.token_ids == first.token_ids == logits.argmax(-1).tolist()
    torch.testing.assert_close(torch.tensor(again.logprobs),
                               full_forward_logprobs(model, prompt, again.token_ids, inputs), atol=1e-4, rtol=0)


def test_kept_image_features_are_each_encoded_images_own_once_by_digest(model, processor):
    """What a training step takes instead of encoding the rollout's images again: every image a prefill encoded
    (a second turn only its new one: the first is in the cached row), kept once though two rows showed it,
    with the tower's merged and deepstack features of that image alone; nothing before it is asked, and
    nothing of older weights."""
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=4, max_seq_len=128, triton="false"))
    firsts, observations = episodes(processor)
    run(engine, firsts[:1], 2)
    assert engine.take_image_features() == {}  # not kept until asked
    assert engine.keep_image_features()
    first_results = run(engine, firsts + firsts[1:], 2)  # the second episode's first prompt in two rows
    seconds = [(prompt + result.token_ids + observation, joined(inputs, observation_inputs))
               for (prompt, inputs), result, (observation, observation_inputs)
               in zip(firsts, first_results, observations)]
    run(engine, seconds, 2)
    kept = engine.take_image_features()
    images = [(pixels, grid) for _, inputs in [firsts[1], *observations]
              for pixels, grid in zip(inputs["pixel_values"].split(inputs["image_grid_thw"].prod(-1).tolist()),
                                      inputs["image_grid_thw"])]
    assert sorted(kept) == sorted(image_digest(pixels, grid) for pixels, grid in images)
    vision = engine.weights.vision
    for pixels, grid in images:
        with torch.no_grad():
            alone = vision.features(pixels, grid[None])
        features = kept[image_digest(pixels, grid)]
        assert len(features.deepstack) == len(DEEPSTACK_INDEXES)
        for got, expected in zip((features.merged, *features.deepstack), (alone.merged, *alone.deepstack)):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert engine.take_image_features() == {}
    run(engine, [message(processor, "", image(64, 64, seed=5), first=True)], 2)
    assert len(engine.runner.kept_images) == 1
    with torch.no_grad():
        next(model.parameters()).add_(0.0)  # a new version of the weights, the same values
    engine.sync_weights()
    assert engine.take_image_features() == {}  # what the old weights computed is not handed out


@pytest.mark.cpu_triton
def test_deepstack_features_are_added_to_whole_layer_outputs_where_the_mlp_output_is_pending(model):
    """With the Triton kernels and no per-head norms (not Qwen3-VL's decoder: its layers' norms taken out for both
    runs), a layer's MLP output is added in the next layer's projection: the deepstack features are added to the
    completed output there, as on the torch path."""
    weights = decoder_weights(model, torch.float32)
    for layer in weights.layers:
        layer.q_norm = layer.k_norm = None
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (2, 12), generator=generator)
    positions = torch.arange(12).expand(2, 12)
    slots = (torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 4, 5, 6, 11]))
    deepstack = Deepstack(slots, [torch.randn(5, 64, generator=generator) for _ in DEEPSTACK_INDEXES])
    rope = rotary_table(weights, 64, torch.device("cpu"))
    hidden = []
    for triton in (False, True):
        cache = filled_cache(weights.shape, 2, 64)
        hidden.append(decoder_forward(weights, cache, rope, tokens, positions, positions, torch.arange(2), 64,
                                      triton_attention=triton, deepstack=deepstack))
    without = decoder_forward(weights, filled_cache(weights.shape, 2, 64), rope,
                              tokens, positions, positions, torch.arange(2), 64)
    torch.testing.assert_close(hidden[1], hidden[0], atol=1e-4, rtol=1e-4)
    assert (hidden[0] - without).abs().amax() > 0.1
