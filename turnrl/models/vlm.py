"""A small vision-language model of a real architecture: Qwen2.5-VL, built here.

The VLM counterpart of :mod:`turnrl.models.tiny`: the same tokenizer (it
already has Qwen's ``<|vision_start|>``, ``<|image_pad|>`` and
``<|vision_end|>``), a randomly initialized, seeded
``Qwen2_5_VLForConditionalGeneration`` of a preset's sizes, and the model's own
processor (``Qwen2_5_VLProcessor`` with a ``Qwen2VLImageProcessor``, a
``Qwen2VLVideoProcessor``, the tokenizer and the chat template). :func:`build_vlm`
saves all of it with ``save_pretrained``, so that it loads like any downloaded
Qwen2.5-VL checkpoint::

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)

(``AutoModelForCausalLM`` does not map Qwen2.5-VL configs.) Builds are cached
exactly like :func:`~turnrl.models.tiny.build_model`'s, by the same helpers.

What the architecture fixes, and what the presets choose:

- Images are cut into 14x14 patches, two frames deep (a still image is repeated
  to two frames), and every 2x2 patches merge into one token of the language
  model. So an image resized to ``H x W`` (multiples of 28) takes
  ``(H/28) * (W/28)`` ``<|image_pad|>`` tokens: 112x112 takes 16, 224x224 64.
- The image processor resizes each image to multiples of 28 with about its own
  number of pixels, then scales it into ``[min_pixels, max_pixels]``. Each
  preset sets that range (:attr:`VLMPreset.min_pixels`, :attr:`VLMPreset.max_pixels`).
- The language model rotates positions with M-RoPE: the rotary frequencies of
  a head are split into temporal, height and width sections
  (``mrope_section``, which sums to ``head_dim / 2``); the presets split them
  1/4, 3/8, 3/8 as Qwen2.5-VL's ``[16, 24, 24]`` does for head_dim 128.
  The height and width sections get the lowest frequencies, so in a small
  model the rotation barely tells an image's columns apart; the model learns
  where a token sits from the token order as well (the presets still learn
  board images, see :data:`VLM_PRESETS`; rope_theta 1e4 instead of 1e6 did no
  better there). A forward pass gets those 3D positions only when it is given
  the processor's ``mm_token_type_ids`` (or ``position_ids``); without them
  the model falls back to 1D positions, silently.
- The vision tower attends within windows of 112x112 pixels except in its
  full-attention layers (:attr:`VisionPreset.fullatt_block_indexes`).

The language model is a Qwen2 decoder (the same layers as Qwen2.5's), so the
text half of a preset is a :class:`~turnrl.models.tiny.ModelPreset`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from turnrl.models.templates import template_spec
from turnrl.models.tiny import (
    BuildRecipe,
    ModelPreset,
    _round_up,
    build_tokenizer,
    cached_build,
    count_parameters,
    texts_digest,
)

VLM_PREFIX = "vlm-"
"""Every VLM preset's name starts with it (how :mod:`turnrl.models.builtin` tells them from text presets)."""

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
"""The tokens a Qwen2.5-VL tokenizer must have; the model config takes their ids."""

# Bump when the VLM build procedure changes, so that cached VLM builds are remade.
_VLM_VERSION = 1

_PATCH = 14
_TEMPORAL_PATCH = 2
_MERGE = 2
_FACTOR = _PATCH * _MERGE  # an image side is resized to a multiple of 28 pixels


@dataclass(frozen=True)
class VisionPreset:
    """Sizes of a Qwen2.5-VL vision tower (patch 14, temporal patch 2, 2x2 merge, as Qwen2.5-VL)."""

    depth: int
    """Number of transformer blocks."""
    hidden_size: int
    """Width of the tower."""
    num_heads: int
    """Attention heads; hidden_size / num_heads must divide by 4 (2D rotary: half for rows, half for columns)."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    fullatt_block_indexes: tuple[int, ...]
    """Blocks that attend over the whole image; the others attend within 112x112-pixel windows."""
    window_size: int = 112
    """Side of an attention window, in pixels (Qwen2.5-VL: 112, i.e. 8x8 patches, 4x4 tokens)."""


@dataclass(frozen=True)
class VLMPreset:
    """Sizes of a built-in Qwen2.5-VL model and the image sizes its processor produces."""

    text: ModelPreset
    """The language model (a Qwen2 decoder with M-RoPE)."""
    vision: VisionPreset
    """The vision tower."""
    min_pixels: int
    """Smallest image area after resizing, in pixels; each side is a multiple of 28."""
    max_pixels: int
    """Largest image area after resizing: at most ``max_pixels / 784`` image tokens an image."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary frequencies (Qwen2.5-VL: 1e6)."""


VLM_PRESETS: dict[str, VLMPreset] = {
    # Unit tests and the CPU quickstart: about 0.78M parameters at vocab 1024
    # (0.26M of them the vision tower and merger). Images become 4 to 16
    # tokens (56x56 to 112x112 pixels): a 4x4 FrozenLake (100x100) is
    # 112x112, one token a cell; larger boards are scaled down to 16 tokens.
    # A forward+backward of 8 sequences of ~100 tokens with 16 such images
    # takes about 50 ms on two CPU cores. Fit to image -> expert action on
    # 4x4 FrozenLake (held-out maps), it chose an optimal move 95% of the time
    # within 2,700 steps of 32 at lr 3e-4 (two seeds of two; 0.1 s a step on
    # two cores, so under 5 minutes); at lr 1e-3 it stayed on the loss plateau.
    "vlm-tiny": VLMPreset(
        text=ModelPreset(
            hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=384,
            max_position_embeddings=4096, vocab_size=1024,
        ),
        vision=VisionPreset(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, fullatt_block_indexes=(1,)),
        min_pixels=56 * 56,
        max_pixels=112 * 112,
    ),
    # CPU learning runs from images: about 4.3M parameters at vocab 1024. The
    # language model is the text preset "small" (the width and head count that
    # leave the SFT loss plateau on FrozenLake); a two-block, 128-wide tower
    # tells the few flat colours and shapes of the env images apart, and the
    # merger hands each 28x28-pixel cell to the language model as one token.
    # Images keep their own size up to 224x224 (4 to 64 tokens), so a 9x9
    # maze (225x225) is 8x8 tokens. A forward+backward of the batch above
    # takes about 140 ms on two CPU cores (350 ms with 64-token maze images).
    # Fit to image -> expert action, it chose an optimal move 90% of the time
    # on held-out 4x4 FrozenLake maps after 650 to 1,050 steps of 32 at lr
    # 1e-4 (three seeds of three; 0.32 s a step on two cores, so 3.5 to 5.5
    # minutes); at 3e-4 one seed of two left the loss plateau, at 1e-3 none. A one-block, 64-wide tower reached 74%
    # in 1,300 steps; 6x6 FrozenLake (25 tokens, cells not aligned with
    # tokens) reached 86% in 760 steps; a 9x9 maze (64 tokens, 1 s a step)
    # about 47% (chance 25%) in the 300 steps that were tried.
    "vlm-small": VLMPreset(
        text=ModelPreset(
            hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768,
            max_position_embeddings=4096, vocab_size=1024,
        ),
        vision=VisionPreset(depth=2, hidden_size=128, num_heads=4, intermediate_size=256, fullatt_block_indexes=(1,)),
        min_pixels=56 * 56,
        max_pixels=224 * 224,
    ),
    # GPU runs at a real size: about 463M parameters at vocab 8192. The
    # language model has Qwen2.5-0.5B's shapes (24 layers, 896 wide, 14 heads,
    # 2 KV heads, MLP 4864). Qwen2.5-VL's own tower (32 blocks, 1280 wide,
    # about 670M parameters) would outweigh that language model and cost more per
    # image token than it; this one is ViT-B sized (12 blocks, 768 wide, 12
    # heads of 64: 86M, 98M with the merger), the tower size that small open VLMs
    # pair with 0.1-0.5B language models (SmolVLM's SigLIP-B/16). Full
    # attention every fourth block, where Qwen2.5-VL has it every eighth of
    # 32. Images up to 448x448 (256 tokens) keep every env image (at most a
    # few hundred pixels wide) at its own size.
    "vlm-0.5b": VLMPreset(
        text=ModelPreset(
            hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
            max_position_embeddings=32768, vocab_size=8192,
        ),
        vision=VisionPreset(
            depth=12, hidden_size=768, num_heads=12, intermediate_size=2048, fullatt_block_indexes=(3, 7, 11)
        ),
        min_pixels=56 * 56,
        max_pixels=448 * 448,
    ),
}
"""Built-in VLM presets by name; every name starts with :data:`VLM_PREFIX`."""


def vlm_preset(name: str) -> VLMPreset:
    """The :class:`VLMPreset` called ``name`` (a key of :data:`VLM_PRESETS`)."""
    try:
        return VLM_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown VLM preset {name!r}; choose one of {sorted(VLM_PRESETS)}") from None


def is_vlm_preset(name: str) -> bool:
    """Whether ``name`` names a VLM preset (it starts with ``vlm-``)."""
    return name.startswith(VLM_PREFIX)


def mrope_section(head_dim: int) -> list[int]:
    """Temporal, height and width rotary sections for ``head_dim``: 1/4, 3/8, 3/8 of ``head_dim / 2``.

    Qwen2.5-VL's ``[16, 24, 24]`` for head_dim 128; ``[8, 12, 12]`` for 64, ``[4, 6, 6]`` for 32.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def image_tokens(height: int, width: int, preset: str | VLMPreset) -> int:
    """How many ``<|image_pad|>`` tokens a ``height x width`` image takes with ``preset``'s processor."""
    p = vlm_preset(preset) if isinstance(preset, str) else preset
    h, w = smart_resize(height, width, factor=_FACTOR, min_pixels=p.min_pixels, max_pixels=p.max_pixels)
    return (h // _FACTOR) * (w // _FACTOR)


def vlm_config(preset: str | VLMPreset, tokenizer: PreTrainedTokenizerBase) -> Qwen2_5_VLConfig:
    """The ``Qwen2_5_VLConfig`` of ``preset`` for ``tokenizer``; embeddings padded to a multiple of 64.

    The vision token ids are the tokenizer's; the tokenizer must have :data:`VISION_TOKENS`.
    """
    p = vlm_preset(preset) if isinstance(preset, str) else preset
    ids = _vision_token_ids(tokenizer)
    t, v = p.text, p.vision
    if t.hidden_size % t.num_heads or t.num_heads % t.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    if v.hidden_size % v.num_heads or (v.hidden_size // v.num_heads) % 4:
        raise ValueError("the vision head size (hidden_size / num_heads) must divide by 4")
    if not all(0 <= i < v.depth for i in v.fullatt_block_indexes):
        raise ValueError(f"fullatt_block_indexes {v.fullatt_block_indexes} must lie in 0..{v.depth - 1}")
    text_config = {
        "vocab_size": _round_up(len(tokenizer), 64),
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": p.rope_theta,
            "mrope_section": mrope_section(t.hidden_size // t.num_heads),
        },
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision_config = {
        "depth": v.depth,
        "hidden_size": v.hidden_size,
        "num_heads": v.num_heads,
        "intermediate_size": v.intermediate_size,
        "hidden_act": "silu",
        "patch_size": _PATCH,
        "temporal_patch_size": _TEMPORAL_PATCH,
        "spatial_merge_size": _MERGE,
        "window_size": v.window_size,
        "fullatt_block_indexes": list(v.fullatt_block_indexes),
        "tokens_per_second": 2,  # as Qwen2.5-VL's released configs (videos only)
        "out_hidden_size": t.hidden_size,
    }
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=t.tie_word_embeddings,
    )


def _vision_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    missing = [token for token in VISION_TOKENS if token not in vocab]
    if missing:
        raise ValueError(f"the tokenizer lacks the vision tokens {missing}: build it with a Qwen template")
    return {token: vocab[token] for token in VISION_TOKENS}


def count_vlm_parameters(preset: str | VLMPreset, vocab_size: int | None = None) -> int:
    """Parameters of a preset's VLM (tied embeddings counted once), without building it."""
    p = vlm_preset(preset) if isinstance(preset, str) else preset
    v, d = p.vision, p.vision.hidden_size
    patch_embed = 3 * _TEMPORAL_PATCH * _PATCH * _PATCH * d  # Conv3d, no bias
    attention = d * 3 * d + 3 * d + d * d + d  # qkv and proj, with biases
    mlp = 3 * d * v.intermediate_size + 2 * v.intermediate_size + d  # gate, up, down, with biases
    block = attention + mlp + 2 * d  # two RMSNorms
    merged = d * _MERGE**2
    merger = d + merged * merged + merged + merged * p.text.hidden_size + p.text.hidden_size
    return count_parameters(p.text, vocab_size) + patch_embed + v.depth * block + merger


def vlm_processor(preset: str | VLMPreset, tokenizer: PreTrainedTokenizerBase) -> Qwen2_5_VLProcessor:
    """Qwen2.5-VL's processor for ``preset``: its image sizes, ``tokenizer`` and the tokenizer's chat template."""
    p = vlm_preset(preset) if isinstance(preset, str) else preset
    image_processor = Qwen2VLImageProcessor(
        min_pixels=p.min_pixels,
        max_pixels=p.max_pixels,
        patch_size=_PATCH,
        temporal_patch_size=_TEMPORAL_PATCH,
        merge_size=_MERGE,
    )
    video_processor = Qwen2VLVideoProcessor(  # video frames get the same size range as images
        min_pixels=p.min_pixels,
        max_pixels=p.max_pixels,
        patch_size=_PATCH,
        temporal_patch_size=_TEMPORAL_PATCH,
        merge_size=_MERGE,
    )
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=tokenizer.chat_template,
    )


@dataclass(frozen=True)
class VLMBuildRecipe(BuildRecipe):
    """A :class:`~turnrl.models.tiny.BuildRecipe` for a VLM; its hash keys the cache."""

    architecture: str = "Qwen2_5_VLForConditionalGeneration"
    """The model class built."""
    vlm_version: int = _VLM_VERSION
    """Version of the VLM build procedure."""


def build_vlm(
    out_dir: str | os.PathLike[str],
    texts: Iterable[str],
    *,
    preset: str,
    template: str = "chatml",
    seed: int = 0,
    vocab_size: int | None = None,
) -> Path:
    """Build (or reuse) a tokenizer, processor and randomly initialized ``Qwen2_5_VLForConditionalGeneration``.

    Args:
        out_dir: where ``save_pretrained`` puts the model and processor, next
            to ``turnrl_model.json`` (the recipe and its key).
        texts: tokenizer corpus (env instructions, observations, examples).
        preset: model size, see :data:`VLM_PRESETS`.
        template: chat template family with Qwen's vision tokens: ``"chatml"`` or ``"qwen3"``.
        seed: seed of the weight initialization.
        vocab_size: tokenizer vocabulary bound; default from the preset.

    Returns:
        ``out_dir`` as a ``Path``. If it already holds a build of the same
        recipe, nothing is rebuilt. A stale turnrl build there is replaced; a
        directory that is not a turnrl build is never overwritten.
    """
    p = vlm_preset(preset)
    if not set(VISION_TOKENS) <= set(template_spec(template).special_tokens):
        raise ValueError(f"template {template!r} has no Qwen vision tokens; a Qwen2.5-VL needs chatml or qwen3")
    out = Path(out_dir)
    texts = list(texts)
    recipe = VLMBuildRecipe(
        preset=preset,
        sizes=asdict(p),
        template=template,
        vocab_size=vocab_size or p.text.vocab_size,
        texts_digest=texts_digest(texts),
        n_texts=len(texts),
        seed=seed,
    )
    return cached_build(out, recipe, lambda path: _build_into(path, texts, recipe))


def _build_into(path: Path, texts: Sequence[str], recipe: VLMBuildRecipe) -> dict:
    p = vlm_preset(recipe.preset)
    tokenizer = build_tokenizer(texts, vocab_size=recipe.vocab_size, template=recipe.template)
    tokenizer.model_max_length = p.text.max_position_embeddings
    config = vlm_config(p, tokenizer)
    spec = template_spec(recipe.template)
    # Seed only a forked RNG: building a model must not move the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    # Sampling stops at the end of a turn or at the end of text, as with Qwen's
    # released generation configs.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids([spec.end_of_turn, spec.end_of_text]),
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(path)
    vlm_processor(p, tokenizer).save_pretrained(path)
    return {
        "recipe": asdict(recipe),
        "key": recipe.key(),
        "architecture": recipe.architecture,
        "parameters": sum(t.numel() for t in model.parameters()),
        "vision_parameters": sum(t.numel() for t in model.model.visual.parameters()),
        "tokenizer_size": len(tokenizer),
        "embedding_rows": model.get_input_embeddings().num_embeddings,
        "preset": asdict(p),
        "load_with": "AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)",
    }
