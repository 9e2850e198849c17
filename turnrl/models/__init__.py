"""Built-in small models: chat templates, a tokenizer builder and Qwen2 presets."""

from turnrl.models.templates import CHATML, LLAMA3, QWEN3, TEMPLATES, TemplateSpec, template_spec
from turnrl.models.tiny import (
    PRESETS,
    BuildRecipe,
    ModelPreset,
    build_model,
    build_tokenizer,
    count_parameters,
    model_preset,
    preset_config,
    tiny_qwen2_config,
)

__all__ = [
    "CHATML",
    "LLAMA3",
    "PRESETS",
    "QWEN3",
    "TEMPLATES",
    "BuildRecipe",
    "ModelPreset",
    "TemplateSpec",
    "build_model",
    "build_tokenizer",
    "count_parameters",
    "model_preset",
    "preset_config",
    "template_spec",
    "tiny_qwen2_config",
]
