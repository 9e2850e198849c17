"""The built-in Qwen2.5-VL: presets, the build and its cache, loading by path, images through processor and model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)

from turnrl.chat.templates import CHATML
from turnrl.config import ModelConfig
from turnrl.models import (
    VLM_PRESETS,
    build_tokenizer,
    build_vlm,
    count_vlm_parameters,
    image_tokens,
    mrope_section,
    vlm_config,
    vlm_preset,
)
from turnrl.models.builtin import builtin_model_path
from turnrl.models.tiny import BUILD_FILE, ModelPreset
from turnrl.models.vlm import VisionPreset, VLMPreset

CORPUS = [
    f"Turn {i}. {text}"
    for i in range(12)
    for text in [
        "FrozenLake. The image shows the lake from above: light blue tiles are frozen and safe.",
        "<think>The goal is below me.</think><answer>Down</answer>",
        "Boxes on targets: 0 of 1.",
    ]
]

# Parameter ranges the presets are documented with (turnrl/models/vlm.py).
RANGES = {
    "vlm-tiny": (500_000, 1_000_000),
    "vlm-small": (3_500_000, 5_000_000),
    "vlm-0.5b": (420_000_000, 500_000_000),
    "vlm-3b": (3_700_000_000, 3_800_000_000),
    "vlm-7b": (8_250_000_000, 8_350_000_000),
    "vlm-8b": (8_700_000_000, 8_800_000_000),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_vlm(tmp_path_factory.mktemp("vlm") / "tiny", CORPUS, preset="vlm-tiny", seed=0)


@pytest.fixture(scope="module")
def loaded(built):
    return AutoProcessor.from_pretrained(built), AutoModelForImageTextToText.from_pretrained(built).eval()


def frame(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def two_image_chat() -> list[dict]:
    """A multi-turn chat with one new image a turn, as the envs' image modes make it."""
    return [
        {"role": "system", "content": "FrozenLake."},
        {"role": "user", "content": [{"type": "image", "image": frame(100, 100, 0)}, {"type": "text", "text": "Go."}]},
        {"role": "assistant", "content": "<answer>Down</answer>"},
        {"role": "user", "content": [
            {"type": "text", "text": "Turn 2."},
            {"type": "image", "image": frame(112, 320, 1)},
        ]},
    ]


def test_presets_sizes_and_parameter_counts():
    assert set(VLM_PRESETS) == set(RANGES)
    tok = build_tokenizer(CORPUS, vocab_size=512)
    for name, (low, high) in RANGES.items():
        preset = vlm_preset(name)
        assert low < count_vlm_parameters(name) < high
        config = vlm_config(name, tok)
        head_dim = preset.text.hidden_size // preset.text.num_heads
        assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
        vision = config.vision_config
        patch = 16 if preset.family == "qwen3_vl" else 14
        assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size) == (patch, 2, 2)
        assert vision.out_hidden_size == preset.text.hidden_size
        if preset.family == "qwen3_vl":
            continue  # counted on the meta device already
        with torch.device("meta"):  # counts the big one without allocating it
            model = Qwen2_5_VLForConditionalGeneration(config)
        assert sum(p.numel() for p in model.parameters()) == count_vlm_parameters(name, len(tok))
    # The released embedding rows, whatever the tokenizer; Qwen3-VL-8B's interleaved sections.
    assert [vlm_config(name, tok).text_config.vocab_size for name in ("vlm-3b", "vlm-7b", "vlm-8b")] == [
        151_936, 152_064, 151_936]
    rope = vlm_config("vlm-8b", tok).text_config.rope_parameters
    assert rope["mrope_section"] == [24, 20, 20] and rope["mrope_interleaved"]
    assert vlm_preset("vlm-0.5b").text.num_layers == 24 and vlm_preset("vlm-0.5b").text.hidden_size == 896
    assert mrope_section(128) == [16, 24, 24] and mrope_section(64) == [8, 12, 12]
    with pytest.raises(ValueError, match="unknown VLM preset"):
        vlm_preset("vlm-huge")


def test_a_qwen3_vl_preset_builds_loads_and_generates_from_an_image(tmp_path, monkeypatch):
    """The Qwen3-VL family through the same build as the others, at a small size: saved, loaded by path with
    its processor, an image chat through processor and model."""
    small = VLMPreset(
        text=ModelPreset(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         max_position_embeddings=4096, vocab_size=512),
        vision=VisionPreset(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, fullatt_block_indexes=(),
                            patch_size=16, deepstack_visual_indexes=(0,)),
        min_pixels=64 * 64, max_pixels=128 * 128, family="qwen3_vl")
    monkeypatch.setitem(VLM_PRESETS, "vlm-test3", small)
    path = build_vlm(tmp_path / "q3", CORPUS, preset="vlm-test3", seed=0)
    assert json.loads((path / BUILD_FILE).read_text())["architecture"] == "Qwen3VLForConditionalGeneration"
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    assert count_vlm_parameters(small, len(processor.tokenizer)) == sum(p.numel() for p in model.parameters())
    chat = two_image_chat()[:2]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[chat[1]["content"][0]["image"]], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.image_token_id).sum()) == image_tokens(100, 100, small)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


def test_image_sizes_per_preset():
    # The tiny preset keeps every env image at 16 tokens or fewer; a 4x4 FrozenLake (100x100) is 4x4 tokens.
    assert image_tokens(100, 100, "vlm-tiny") == 16
    assert image_tokens(225, 225, "vlm-tiny") == 16
    assert image_tokens(112, 320, "vlm-tiny") <= 16
    assert image_tokens(225, 225, "vlm-small") == 64  # a 9x9 maze at its own size
    assert image_tokens(20, 20, "vlm-small") == 4  # min_pixels: at least 2x2 tokens


def test_loads_like_a_downloaded_vlm(built, loaded):
    processor, model = loaded
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert isinstance(processor.image_processor, Qwen2VLImageProcessor)
    assert isinstance(processor.video_processor, Qwen2VLVideoProcessor)
    assert processor.chat_template == processor.tokenizer.chat_template == CHATML
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied, as saved
    preset = vlm_preset("vlm-tiny")
    for image_processor in (processor.image_processor, processor.video_processor):
        assert image_processor.size["shortest_edge"] == preset.min_pixels
        assert image_processor.size["longest_edge"] == preset.max_pixels
        assert (image_processor.patch_size, image_processor.merge_size) == (14, 2)
    info = json.loads((built / BUILD_FILE).read_text())
    assert info["architecture"] == "Qwen2_5_VLForConditionalGeneration"
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_token_ids_come_from_the_tokenizer(loaded):
    processor, model = loaded
    tok, config = processor.tokenizer, model.config
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
    assert config.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert config.vision_end_token_id == tok.convert_tokens_to_ids("<|vision_end|>")
    assert config.text_config.vocab_size >= len(tok) and config.text_config.vocab_size % 64 == 0
    stops = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert model.generation_config.eos_token_id == stops
    assert model.generation_config.pad_token_id == tok.pad_token_id


def test_two_image_chat_placeholders_match_image_features(loaded):
    processor, model = loaded
    inputs = processor.apply_chat_template(
        two_image_chat(), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    grids = inputs["image_grid_thw"]
    assert grids.tolist() == [[1, 8, 8], [1, 4, 12]]  # 112x112 and 56x168: both within 112*112 pixels
    placeholders = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert placeholders == int(grids.prod(-1).sum()) // 2**2 == 16 + 12
    with torch.no_grad():
        features = model.get_image_features(inputs["pixel_values"], grids).pooler_output
    assert [f.shape[0] for f in features] == [16, 12]
    assert features[0].shape[1] == model.config.text_config.hidden_size
    # The processor marks the image tokens, from which the model computes M-RoPE's 3D positions:
    # the first image's 16 tokens share one temporal position and span 4 rows and 4 columns.
    assert torch.equal(inputs["mm_token_type_ids"].bool(), inputs["input_ids"] == model.config.image_token_id)
    positions, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], grids)
    first = positions[:, 0, inputs["mm_token_type_ids"][0].bool()][:, :16]
    assert [len(set(axis.tolist())) for axis in first] == [1, 4, 4]


def test_forward_and_generate_with_images(loaded):
    processor, model = loaded
    chats = [two_image_chat(), two_image_chat()[:2]]
    inputs = processor.apply_chat_template(
        chats,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True},
    )
    assert (inputs["attention_mask"][:, -1] == 1).all()  # left padding
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (2, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    torch.manual_seed(0)
    out = model.generate(**inputs, max_new_tokens=5, do_sample=True)
    prompt_length = inputs["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_length < out.shape[1] <= prompt_length + 5
    assert torch.equal(out[:, :prompt_length], inputs["input_ids"])


def test_build_is_cached_and_seeded(built, tmp_path):
    weights = built / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_vlm(built, list(reversed(CORPUS)), preset="vlm-tiny", seed=0) == built
    assert weights.stat().st_mtime_ns == stamp  # same recipe: reused, nothing written

    same = build_vlm(tmp_path / "same", CORPUS, preset="vlm-tiny", seed=0)
    other = build_vlm(tmp_path / "seed1", CORPUS, preset="vlm-tiny", seed=1)
    a, b, c = (AutoModelForImageTextToText.from_pretrained(p).state_dict() for p in (built, same, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)

    # Another recipe in the same directory replaces the build.
    build_vlm(tmp_path / "same", CORPUS, preset="vlm-small", seed=0)
    assert json.loads((tmp_path / "same" / BUILD_FILE).read_text())["build"]["preset"] == "vlm-small"
    assert json.loads((tmp_path / "same" / "config.json").read_text())["text_config"]["hidden_size"] == 256


def test_build_refuses_foreign_directory_and_templates_without_vision_tokens(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_vlm(tmp_path / "mine", CORPUS, preset="vlm-tiny")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="vision tokens"):
        build_vlm(tmp_path / "llama", CORPUS, preset="vlm-tiny", template="llama3")
    with pytest.raises(ValueError, match="unknown VLM preset"):
        build_vlm(tmp_path / "x", CORPUS, preset="vlm-huge")


def test_builtin_model_path_builds_a_vlm_for_vlm_presets(tmp_path):
    config = ModelConfig(builtin_preset="vlm-tiny", builtin_template="qwen3", builtin_dir=str(tmp_path))
    path = builtin_model_path(config)
    assert path == tmp_path / "qwen2.5-vl-tiny-qwen3"
    processor = AutoProcessor.from_pretrained(path)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    # The corpus has what the envs say in image mode: their picture legends are few tokens.
    legend = "light blue tiles are frozen and safe, dark blue tiles are holes"
    assert len(processor.tokenizer.encode(legend)) < len(legend) / 3
    assert builtin_model_path(config) == path  # cached


@pytest.mark.parametrize(("preset", "template", "match"), [("nope", "chatml", "not a built-in model"),
                                                           ("vlm-tiny", "llama3", "no Qwen vision tokens")])
def test_builtin_model_path_names_a_bad_preset_as_a_config_error(tmp_path, preset, template, match):
    from turnrl.config import ConfigError, ModelConfig
    from turnrl.models.builtin import builtin_model_path

    with pytest.raises(ConfigError, match=match):
        builtin_model_path(ModelConfig(builtin_preset=preset, builtin_template=template, builtin_dir=str(tmp_path)))
    assert not any(tmp_path.iterdir())
