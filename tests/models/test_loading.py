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
