"""Models: loading one by path or hub id onto devices (:mod:`~turnrl.models.loading`,
:mod:`~turnrl.models.devices`), the built-in models of real architectures built from a config with a tokenizer
the project trains (Qwen2 presets in :mod:`~turnrl.models.tiny`, Qwen2.5-VL and Qwen3-VL presets in
:mod:`~turnrl.models.vlm`), and a VLM's vision side (the image encoder, M-RoPE positions, the tower's
attention)."""

from turnrl.models.tiny import (
    PRESETS,
    BuildSpec,
    ModelPreset,
    build_model,
    build_tokenizer,
    count_parameters,
    model_preset,
    preset_config,
    tiny_qwen2_config,
)
from turnrl.models.vlm import (
    VLM_PRESETS,
    VisionPreset,
    VLMPreset,
    build_vlm,
    count_vlm_parameters,
    image_tokens,
    is_vlm_preset,
    mrope_section,
    vlm_config,
    vlm_preset,
    vlm_processor,
)

__all__ = [
    "PRESETS",
    "VLM_PRESETS",
    "BuildSpec",
    "ModelPreset",
    "VLMPreset",
    "VisionPreset",
    "build_model",
    "build_tokenizer",
    "build_vlm",
    "count_parameters",
    "count_vlm_parameters",
    "image_tokens",
    "is_vlm_preset",
    "model_preset",
    "mrope_section",
    "preset_config",
    "tiny_qwen2_config",
    "vlm_config",
    "vlm_preset",
    "vlm_processor",
]
