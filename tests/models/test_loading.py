"""Loading models by path: the tokenizer with a pad token, the processor where the model has one."""

from __future__ import annotations

from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

from turnrl.models.loading import load_processor, load_tokenizer


def test_a_text_model_has_no_processor_beyond_its_tokenizer(tiny_model_dir):
    assert load_processor(tiny_model_dir) is None
    assert load_tokenizer(tiny_model_dir).pad_token is not None


def test_a_model_with_an_image_processor_gets_its_processor(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    LlavaProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer, patch_size=14,
                   image_token="<image>").save_pretrained(tmp_path)
    processor = load_processor(tmp_path)
    assert isinstance(processor, LlavaProcessor) and processor.image_processor is not None


def test_a_directory_without_model_files_has_no_processor(tmp_path):
    assert load_processor(tmp_path) is None



def test_a_processor_that_needs_a_missing_library_is_reported_and_left_out(tiny_model_dir, monkeypatch, caplog):
    import turnrl.models.loading as models

    def needs_torchvision(path):
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library")

    monkeypatch.setattr(models.AutoProcessor, "from_pretrained", needs_torchvision)
    with caplog.at_level("WARNING"):
        assert load_processor(tiny_model_dir) is None
    assert "Torchvision" in caplog.text


def test_image_size_bounds_set_the_visual_tokens_of_an_image(tiny_vlm_dir):
    from turnrl.envs import make
    from turnrl.models.vision import ImageEncoder

    obs, _ = make("FrozenLake", mode="image").reset(seed=0)  # 100 x 100 pixels
    default = ImageEncoder(load_processor(tiny_vlm_dir)).encode([obs["image"]])[0]
    small = ImageEncoder(load_processor(tiny_vlm_dir, max_pixels=56 * 56)).encode([obs["image"]])[0]
    large = ImageEncoder(load_processor(tiny_vlm_dir, min_pixels=224 * 224, max_pixels=224 * 224)).encode([obs["image"]])[0]
    assert (small.placeholder_tokens, default.placeholder_tokens, large.placeholder_tokens) == (4, 16, 64)
    assert small.model_inputs["pixel_values"].shape[0] == 4 * small.placeholder_tokens
