"""The model families the engine runs: one record each, found by a model config's ``model_type``.

The engine's forward pass is one decoder for every family: pre-norm layers of RMSNorm, grouped-query attention
with rotary positions, and a SwiGLU MLP (:mod:`turnrl.engine.forward`). What differs between families is in
their record (:class:`Family`): where their weights are (:class:`WeightNames`), how positions turn queries and
keys (:class:`Rotary`), whether queries and keys get a per-head RMSNorm, which config field turns on
sliding-window attention (refused), and for a VLM its image side (:class:`VisionParts`). The weights
(:mod:`turnrl.engine.weights`), the forward pass and the scheduler read these fields; none of them tests a
model type.

Biases are not a field: a projection's bias is taken where the checkpoint's layer has one (Qwen2's q/k/v
projections always, Llama's and Qwen3's with ``attention_bias``).

Adding a family whose math is this decoder's is one record, registered in :data:`ENGINE_FAMILIES` or named
``model.engine.families=[my_package.module:MY_FAMILY]`` from a user's package (docs/engine.md, "Adding a
model family"; docs/extending.md); one whose math differs (Gemma's norms and activation, for example) needs
the kernels changed where it differs, and a field here that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from turnrl.registry import Registry


class UnsupportedModel(ValueError):
    """The engine cannot run this model; the transformers backend can."""


class Rotary(Enum):
    """How a family's positions turn queries and keys; the table itself comes from the model's own rotary module
    (its scaling included)."""

    ROPE = "rope"
    """One position a token, turning every dim pair (Llama, Qwen2, Qwen3, Mistral)."""
    MROPE = "mrope"
    """Three positions a token (time, height, width: M-RoPE); the rotary half dims in runs of the module's
    ``mrope_section``, taking axes 0, 1, 2 in turn (Qwen2-VL, Qwen2.5-VL)."""
    MROPE_INTERLEAVED = "mrope_interleaved"
    """M-RoPE with the axes interleaved over the half dims (height at every third dim from 1, width from 2, up to
    three times their sections; time elsewhere), whatever the config's ``mrope_interleaved`` says (Qwen3-VL)."""

    @property
    def mrope(self) -> bool:
        """Three positions a token (an image's tokens take theirs from the image's grid)."""
        return self is not Rotary.ROPE


@dataclass(frozen=True)
class WeightNames:
    """Where a family's weights are: module paths for ``nn.Module.get_submodule``, as transformers names them.

    The defaults are the Llama layout, which Qwen2, Qwen3 and Mistral share (a VLM's decoder differs only in
    where it sits: ``decoder``). A peft wrapper's LoRA layers sit at the same paths.
    """

    decoder: str = "model"
    """The decoder stack, from the causal LM (a VLM's language model: ``model.language_model``)."""
    layers: str = "layers"
    """The decoder layers (a ``ModuleList``), from ``decoder``."""
    embed: str = "embed_tokens"
    """The input embeddings, from ``decoder``."""
    final_norm: str = "norm"
    """The RMSNorm after the last layer, from ``decoder``."""
    rotary: str = "rotary_emb"
    """The rotary embedding module, from ``decoder``: the engine takes its cos/sin table (and M-RoPE sections)."""
    lm_head: str = "lm_head"
    """The output projection, from the causal LM (the embeddings themselves where they are tied)."""
    input_norm: str = "input_layernorm"
    """The RMSNorm before attention, from a layer; the modules below are from a layer too."""
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    """Linear layers whose outputs, concatenated in this order, are the queries, keys and values (one name where a
    checkpoint fuses them)."""
    o: str = "self_attn.o_proj"
    """The attention output projection."""
    q_norm: str = "self_attn.q_norm"
    """The per-head RMSNorm of queries, read only where the family has one (:attr:`Family.qk_norm`)."""
    k_norm: str = "self_attn.k_norm"
    """The per-head RMSNorm of keys, read only where the family has one."""
    post_norm: str = "post_attention_layernorm"
    """The RMSNorm before the MLP."""
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    """Linear layers whose outputs, concatenated in this order, are the SwiGLU's gate and up halves."""
    down: str = "mlp.down_proj"
    """The MLP's output projection."""


@dataclass(frozen=True)
class VisionParts:
    """A VLM's image side, as the engine uses it: the model's own vision tower, and the config fields that name its
    vision tokens. The defaults are the Qwen-VL layout."""

    tower: str = "model"
    """The module (from the causal LM) whose ``get_image_features(pixel_values, image_grid_thw, return_dict=True)``
    runs the vision tower and its merger: an output whose ``pooler_output`` holds each image's features, one row
    per placeholder token."""
    deepstack: bool = False
    """The tower's output also holds ``deepstack_features``: one set per early decoder layer, added to that layer's
    output at the image tokens (Qwen3-VL)."""
    image_token: str = "image_token_id"
    """The config field of the image placeholder token (repeated once per visual token in a prompt)."""
    video_token: str = "video_token_id"
    """The config field of the video placeholder: the engine runs images only, and refuses a prompt with one."""
    never_sampled: tuple[str, ...] = ("image_token_id", "video_token_id", "vision_start_token_id",
                                      "vision_end_token_id")
    """Config fields of the vision tokens never sampled (a sampled placeholder would be read as an image slot); a
    field the config lacks is skipped."""
    merge_size: str = "spatial_merge_size"
    """The field of the config's ``vision_config`` that counts the patches merged into one token along each
    spatial side."""


@dataclass(frozen=True)
class Family:
    """What the engine needs to know about one model family beyond the numbers in its config."""

    name: str
    """For people: messages and docs."""
    model_types: tuple[str, ...]
    """The transformers ``model_type`` values (of the model's top-level config) this record runs."""
    rotary: Rotary = Rotary.ROPE
    """How positions turn queries and keys."""
    qk_norm: bool = False
    """Queries and keys get a per-head RMSNorm before the rotary (Qwen3): the norms' weights are read
    (:attr:`WeightNames.q_norm`, :attr:`WeightNames.k_norm`), and attention keeps the compiled path in place of
    the fused rotary-and-cache-write kernel."""
    sliding_window: str | None = None
    """The field of the decoder's config that turns on sliding-window attention when set (``use_sliding_window``
    for Qwen2, ``sliding_window`` for Mistral): the engine has none and refuses such a model. None: the family
    has no sliding window."""
    weights: WeightNames = field(default_factory=WeightNames)
    """Where the weights are."""
    vision: VisionParts | None = None
    """A VLM's image side; None for a text model. A VLM's decoder config is its ``text_config``."""

    def __post_init__(self) -> None:
        # Image positions are M-RoPE's (turnrl/engine/images.py), and M-RoPE positions come from images.
        if (self.vision is not None) != self.rotary.mrope:
            raise ValueError(f"family {self.name}: the engine runs VLMs with M-RoPE and text models with plain RoPE; "
                             f"this record has rotary={self.rotary.value} and "
                             f"{'a' if self.vision is not None else 'no'} vision side")

    def decoder_config(self, config: Any) -> Any:
        """The decoder's config: a VLM's ``text_config``, or the config itself."""
        return config.text_config if self.vision is not None else config

    def check(self, config: Any) -> None:
        """Raise :class:`UnsupportedModel` with the reason where a model's config (the top-level one) asks for
        something the engine's decoder does not compute."""
        decoder: Any = self.decoder_config(config)
        if getattr(decoder, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"the engine's MLP is SwiGLU; this model uses {decoder.hidden_act!r}")
        if getattr(decoder, "mlp_bias", False):
            raise UnsupportedModel("the engine's MLP has no biases; this model's has (use model.backend=hf)")
        if self.sliding_window is not None and getattr(decoder, self.sliding_window, None):
            raise UnsupportedModel("the engine has no sliding-window attention; use model.backend=hf")
        rope = getattr(decoder, "rope_parameters", None) or getattr(decoder, "rope_scaling", None) or {}
        partial = getattr(decoder, "partial_rotary_factor", None) or (rope.get("partial_rotary_factor")
                                                                      if isinstance(rope, dict) else None)
        if partial is not None and partial < 1:  # Phi-4-mini's: only part of each head turns
            raise UnsupportedModel(f"the engine turns every dimension of a head; this model turns a share of "
                                   f"{partial} (partial_rotary_factor): use model.backend=hf")
        length_dependent = _length_dependent_rope(rope)
        if length_dependent is not None:
            raise UnsupportedModel(f"{length_dependent} RoPE scaling turns positions by factors that depend on the "
                                   "sequence's length, where the engine turns every position by one table; use "
                                   "model.backend=hf")


def _length_dependent_rope(rope: Any) -> str | None:
    """The RoPE type of a config's ``rope_parameters`` whose frequencies the rotary module picks by the length of the
    positions it is called with, or None. transformers' modules recompute them for a type named ``dynamic``, and
    switch ``longrope`` from its short to its long factors past ``original_max_position_embeddings``: the engine
    takes its table once for every position of a row, so a short sequence would turn by a long one's factors.
    ``rope`` may hold one set per layer type (a dict of dicts)."""
    if not isinstance(rope, dict):
        return None
    if all(isinstance(value, dict) for value in rope.values()) and rope:
        return next((found for value in rope.values() if (found := _length_dependent_rope(value)) is not None), None)
    rope_type = str(rope.get("rope_type", rope.get("type")))
    return rope_type if "dynamic" in rope_type or rope_type == "longrope" else None


VLM_WEIGHTS = WeightNames(decoder="model.language_model")
"""The Qwen-VL layout: the Llama layout's decoder inside the VLM's inner model."""

def as_family(obj: Any) -> Family:
    """What ``model.engine.families`` names by ``module:attr``: a :class:`Family` record."""
    if not isinstance(obj, Family):
        raise TypeError(f"an engine family is a turnrl.engine.families.Family record, got {type(obj).__name__}")
    return obj


ENGINE_FAMILIES: Registry[Family] = Registry("engine family", coerce=as_family)
"""Every family the engine runs, by name. A model type missing from them runs on the transformers backend."""

ENGINE_FAMILIES.register("Llama", Family("Llama", ("llama",)))
ENGINE_FAMILIES.register("Mistral", Family("Mistral", ("mistral",), sliding_window="sliding_window"))
ENGINE_FAMILIES.register("Qwen2", Family("Qwen2", ("qwen2",), sliding_window="use_sliding_window"))
ENGINE_FAMILIES.register("Qwen3", Family("Qwen3", ("qwen3",), qk_norm=True, sliding_window="use_sliding_window"))
# Qwen2-VL and Qwen2.5-VL differ only in their vision towers (Qwen2.5-VL's attends within windows and has an
# RMSNorm SwiGLU MLP), which the engine calls as a whole.
ENGINE_FAMILIES.register("Qwen2-VL", Family("Qwen2-VL", ("qwen2_vl", "qwen2_5_vl"), rotary=Rotary.MROPE,
                                            sliding_window="use_sliding_window", weights=VLM_WEIGHTS,
                                            vision=VisionParts()))
ENGINE_FAMILIES.register("Qwen3-VL", Family("Qwen3-VL", ("qwen3_vl",), rotary=Rotary.MROPE_INTERLEAVED, qk_norm=True,
                                            weights=VLM_WEIGHTS, vision=VisionParts(deepstack=True)))

FAMILIES: tuple[Family, ...] = tuple(ENGINE_FAMILIES.values())
"""The families that come with turnrl."""


def add_families(names: Sequence[str]) -> None:
    """Register the families that ``model.engine.families`` names (registered names, or ``module:attr`` of a
    :class:`Family` record in the user's package) under their names, so that :func:`family_of` finds them;
    naming one already registered is a no-op.

    Raises:
        RegistryError: a name that is neither registered nor an importable ``module:attr``.
        ValueError: a family whose name or model type another family already has.
    """
    for name in names:
        family = ENGINE_FAMILIES.get(name)
        if ENGINE_FAMILIES.find(family) is None:
            by_model_type((*ENGINE_FAMILIES.values(), family))  # refuses a model type claimed twice
            ENGINE_FAMILIES.register(family.name, family)


def by_model_type(families: Sequence[Family]) -> dict[str, Family]:
    """Each model type's family; a model type claimed by two families is refused."""
    found: dict[str, Family] = {}
    for family in families:
        for model_type in family.model_types:
            if model_type in found:
                raise ValueError(f"model type {model_type!r} is in two families: {found[model_type].name} and "
                                 f"{family.name}")
            found[model_type] = family
    return found


def family_of(config: Any) -> Family:
    """The family of a transformers model config, by its ``model_type``, among :data:`ENGINE_FAMILIES`.

    Raises:
        UnsupportedModel: no family runs this model type; the message lists those that do and where to add one.
    """
    families = ENGINE_FAMILIES.values()
    model_type = getattr(config, "model_type", None)
    found = by_model_type(families)
    if model_type in found:
        return found[model_type]
    text = [t for family in families if family.vision is None for t in family.model_types]
    vlms = [t for family in families if family.vision is not None for t in family.model_types]
    raise UnsupportedModel(
        f"the engine runs {', '.join(text)} decoders and {', '.join(vlms)} VLMs, not {model_type!r} "
        "(other architectures use model.backend=hf; to run one in the engine, write its Family record "
        "(turnrl/engine/families.py) and name it in model.engine.families, as docs/engine.md says under "
        "'Adding a model family')"
    )
