"""The weights the engine computes with: the policy's own tensors, read where they live.

The engine runs Llama-family decoders (Llama, Qwen2, Qwen3, Mistral: RMSNorm,
rotary positions, grouped-query attention, SwiGLU) with its own forward pass,
so that it can keep a KV cache per sequence across turns and capture decode in
CUDA graphs. It reads the model's parameters directly: an optimizer step on
the policy is seen by the next generation with no weight sync.

Three kinds of weights need a computed tensor instead, kept in a buffer that
:meth:`DecoderWeights.refresh` rewrites in place before a generation when one
of the parameters it is computed from changed (their in-place version counters
tell):

- LoRA layers (peft): the engine uses the merged weight ``W + scale * B A``, so
  adapters cost nothing in decode.
- Float32 weights when the engine computes in bf16/fp16 (mixed-precision
  training keeps float32 weights): cast once per generation rather than in
  every decode step, as autocast would.
- Fused projections: the query, key and value weights stacked into one matrix,
  and the gate and up weights into another (with their biases), so that a
  decode step runs one GEMM for each group instead of three and two. Small
  decode GEMMs are bound by their launch and by reading the activations, not
  by the weights, so fewer and wider ones are faster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""VLMs whose language model is a Qwen2 or Qwen3 decoder with M-RoPE: the engine runs it, and the model's own vision
tower makes the image features its prefill takes (:class:`VisionWeights`). Qwen2-VL and Qwen2.5-VL differ only in
their towers (Qwen2.5-VL's attends within windows and has an RMSNorm SwiGLU MLP), which the engine calls as a whole.
Qwen3-VL's decoder is Qwen3's (per-head query and key norms); it interleaves the M-RoPE axes over the rotary dims
(:data:`INTERLEAVED_MROPE_TYPES`) and adds the tower's deepstack features to its first layers' outputs at the image
tokens (:class:`ImageFeatures`)."""
INTERLEAVED_MROPE_TYPES = ("qwen3_vl",)
"""VLMs whose rotary module interleaves the M-RoPE axes over the half dims (:func:`rope_axes`). Qwen3-VL's does so
whatever its config's ``mrope_interleaved`` says (transformers 5.17 to 5.24 read only ``mrope_section``)."""


class UnsupportedModel(ValueError):
    """The engine cannot run this model; the transformers backend can."""


@dataclass
class DecoderShape:
    """The numbers of a decoder that its forward pass needs."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float


def parameters_version(inputs: tuple[torch.Tensor, ...]) -> int:
    """A number that changes whenever one of ``inputs`` is modified in place (an optimizer step, a load)."""
    return sum(tensor._version for tensor in inputs)


@dataclass
class WeightRef:
    """One weight: the model's parameter itself, or a buffer recomputed from parameters by ``source``."""

    value: torch.Tensor
    source: Callable[[], torch.Tensor] | None = None
    inputs: tuple[torch.Tensor, ...] = ()
    """The parameters ``source`` reads; the buffer is recomputed only when one of them changed (empty: always)."""
    seen_version: int = -1
    """``inputs``' version when ``value`` was last computed."""

    def refresh(self) -> bool:
        """Recompute the buffer if its parameters changed; True if it was rewritten."""
        if self.source is None:
            return False
        version = parameters_version(self.inputs)
        if self.inputs and version == self.seen_version:
            return False
        with torch.no_grad():
            self.value.copy_(self.source())
        self.seen_version = version
        return True


@dataclass
class LayerWeights:
    input_norm: WeightRef
    qkv: list[WeightRef]
    """The query, key and value projections, whose outputs are concatenated in that order: one buffer of
    their weights stacked (one GEMM), or the three weights (``fuse=False``)."""
    o: WeightRef
    post_norm: WeightRef
    gate_up: list[WeightRef]
    """The gate and up projections, outputs concatenated: one stacked buffer, or the two weights."""
    down: WeightRef
    qkv_bias: list[WeightRef] | None = None
    """Biases matching ``qkv`` (Qwen2), or None."""
    o_bias: WeightRef | None = None
    q_norm: WeightRef | None = None
    """Qwen3's per-head RMSNorm of queries and keys; None elsewhere."""
    k_norm: WeightRef | None = None


class ImageFeatures(NamedTuple):
    """A vision tower's features of some images, one row per placeholder token, in order.

    Notation: n the images' placeholder tokens.
    """

    merged: torch.Tensor
    """What replaces the placeholders' input embeddings, Shape (n, hidden)."""
    deepstack: list[torch.Tensor]
    """Qwen3-VL's deepstack features: ``deepstack[l]`` is added to the output of decoder layer l at the
    placeholders, each Shape (n, hidden); empty for a tower without them."""


@dataclass
class VisionWeights:
    """A VLM's image side: its vision tower, which the engine's prefill calls, and how its decoder places images."""

    model: nn.Module
    """The VLM's inner model (``Qwen2VLModel``, ``Qwen2_5_VLModel``, ``Qwen3VLModel``), whose ``get_image_features``
    runs the vision tower and its patch merger."""
    image_token_id: int
    merge_size: int
    """Patches merged into one token along each spatial side."""
    rope_axes: torch.Tensor
    """Which M-RoPE position (0 temporal, 1 height, 2 width) each rotary dim turns by, Shape (D,) int64."""
    special_token_ids: list[int]
    """Vision tokens never sampled: a sampled placeholder would be read as an image slot."""
    video_token_id: int | None = None
    """Videos are not run by the engine: a prompt with their placeholder is refused."""

    def features(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> ImageFeatures:
        """The decoder-side features of images, one row per placeholder token, in order.

        Args:
            pixel_values: the images' patches, concatenated, Shape (patches, patch_dim). grids: each image's
                (temporal, height, width) patch grid, Shape (m, 3).

        Returns:
            Each tensor Shape (tokens, hidden), tokens = sum over images of t * h * w / merge_size**2.
        """
        # transformers 5.x returns an output object whose pooler_output holds the merged features, one tensor per
        # image; a config with return_dict=False would make it a tuple, so the object is asked for. Its
        # deepstack_features (Qwen3-VL) hold a layer's features split per image like pooler_output (5.24), or
        # whole (5.17).
        out = self.model.get_image_features(pixel_values, grids, return_dict=True)  # type: ignore[operator]
        features = ImageFeatures(_concatenated(out.pooler_output),
                                 [_concatenated(layer) for layer in getattr(out, "deepstack_features", None) or []])
        tokens = int((grids.prod(-1) // self.merge_size**2).sum())
        for made in (features.merged, *features.deepstack):
            if made.shape[0] != tokens:
                raise ValueError(f"the vision tower made {made.shape[0]} image features for {tokens} placeholders")
        return features


def _concatenated(features: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Features split per image, joined along dim 0 (a tensor already whole: itself)."""
    return features if isinstance(features, torch.Tensor) else torch.cat(list(features))


def mrope_section(rotary: nn.Module, config: Any) -> list[int]:
    """The temporal, height and width sections of a VLM decoder's rotary half dims, as its rotary module lays them out
    (:func:`rope_axes`).

    The module's own ``mrope_section`` is what it rotates by: it is the config's ``rope_parameters["mrope_section"]``
    (where transformers 5 puts a checkpoint's ``rope_scaling: {"type": "mrope", ...}``), or when the config names
    none the module's default ([16, 24, 24] for Qwen2-VL, [24, 20, 20] for Qwen3-VL). Early 5.x versions of
    Qwen2-VL, whose module has no such attribute, read the config's in their attention layers.
    """
    section = getattr(rotary, "mrope_section", None)
    if section is None:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        section = rope.get("mrope_section") if isinstance(rope, dict) else None
    if section is None:
        raise UnsupportedModel("this VLM's config names no mrope_section (its M-RoPE sections); use model.backend=hf")
    return [int(size) for size in section]


def rope_axes(mrope_section: list[int], head_dim: int, interleaved: bool = False) -> torch.Tensor:
    """Each rotary dim's M-RoPE axis (0 temporal, 1 height, 2 width), the second half as the first, Shape (head_dim,).

    Split (Qwen2-VL's rotary embedding): the half dims in ``mrope_section`` runs taking axes 0, 1, 2, 0, ...
    Interleaved (Qwen3-VL's): half dim j turns by height where j % 3 == 1 and j < 3 * mrope_section[1], by width
    where j % 3 == 2 and j < 3 * mrope_section[2], else by time.
    """
    if interleaved:
        half = torch.zeros(head_dim // 2, dtype=torch.long)
        for axis in (1, 2):
            half[axis : 3 * mrope_section[axis] : 3] = axis
        return torch.cat((half, half))
    half = torch.cat([torch.full((size,), index % 3, dtype=torch.long) for index, size in enumerate(mrope_section)])
    if len(half) != head_dim // 2:
        raise UnsupportedModel(f"mrope_section {mrope_section} does not cover half the head dim ({head_dim // 2})")
    return torch.cat((half, half))


@dataclass
class DecoderWeights:
    shape: DecoderShape
    embed: WeightRef
    layers: list[LayerWeights]
    norm: WeightRef
    lm_head: WeightRef
    rotary: nn.Module
    """The model's rotary embedding module (it knows the model's RoPE scaling)."""
    dtype: torch.dtype
    tensors: list[WeightRef] = field(default_factory=list)
    vision: VisionWeights | None = None
    """A VLM's image side; None for a text model."""

    def refresh(self) -> int:
        """Recompute the merged, cast and fused buffers whose parameters changed; returns how many were."""
        return sum(tensor.refresh() for tensor in self.tensors)


def base_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def text_config(config: Any) -> Any:
    """The decoder's config: a VLM's ``text_config``, or the config itself."""
    return config.text_config if getattr(config, "model_type", None) in VLM_MODEL_TYPES else config


def check_supported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModel` with the reason when the engine cannot run ``model``."""
    model_type = getattr(base_causal_lm(model).config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES + VLM_MODEL_TYPES:
        raise UnsupportedModel(
            f"the engine runs {', '.join(SUPPORTED_MODEL_TYPES)} decoders and {', '.join(VLM_MODEL_TYPES)} VLMs, "
            f"not {model_type!r} (other architectures use model.backend=hf)"
        )
    config: Any = text_config(base_causal_lm(model).config)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"the engine's MLP is SwiGLU; this model uses {config.hidden_act!r}")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModel("the engine's MLP has no biases; this model's has (use model.backend=hf)")
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        raise UnsupportedModel("the engine has no sliding-window attention; use model.backend=hf")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        raise UnsupportedModel("dynamic RoPE scaling depends on the sequence length; use model.backend=hf")


@dataclass
class _Source:
    """How to compute one weight from the model's parameters."""

    parameter: torch.Tensor
    """The tensor itself when nothing needs computing (no LoRA)."""
    compute: Callable[[], torch.Tensor] | None = None
    """The merged weight of a LoRA layer; None: the parameter as it is."""
    inputs: tuple[torch.Tensor, ...] = ()
    """Every parameter ``compute`` reads."""

    def __call__(self) -> torch.Tensor:
        return (self.compute() if self.compute is not None else self.parameter).detach()

    @property
    def all_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.inputs or (self.parameter,)


def _linear_sources(module: Any) -> tuple[_Source, _Source | None]:
    """A linear layer's weight and bias, the weight merged with its adapters if it is LoRA."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return _Source(module.weight), _Source(module.bias) if module.bias is not None else None
    lora = module

    def merged() -> torch.Tensor:
        weight = base.weight
        if lora.merged or lora.disable_adapters:
            return weight
        for adapter in lora.active_adapters:
            if adapter in lora.lora_A:
                weight = weight + lora.get_delta_weight(adapter).to(weight.dtype)
        return weight

    weight = _Source(base.weight, merged, tuple(lora.parameters()))
    return weight, _Source(base.bias) if base.bias is not None else None


def decoder_weights(model: nn.Module, dtype: torch.dtype, fuse: bool = True) -> DecoderWeights:
    """The engine's view of ``model``'s weights, computing in ``dtype``.

    A parameter already in ``dtype`` and not under LoRA is used as it is (no copy), unless ``fuse`` stacks it
    with its group (q/k/v, gate/up) into one buffer: that costs a copy of those weights, and saves three GEMM
    launches per layer and decode step.
    """
    check_supported(model)
    causal: Any = base_causal_lm(model)
    config: Any = text_config(causal.config)
    decoder: Any = causal.model
    vision = None
    if config is not causal.config:  # a VLM: the decoder is its language model
        decoder = causal.model.language_model
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        vision = VisionWeights(
            model=causal.model, image_token_id=causal.config.image_token_id,
            merge_size=causal.config.vision_config.spatial_merge_size,
            rope_axes=rope_axes(mrope_section(decoder.rotary_emb, config), head_dim,
                                interleaved=causal.config.model_type in INTERLEAVED_MROPE_TYPES
                                ).to(causal.lm_head.weight.device),
            special_token_ids=sorted({getattr(causal.config, name) for name in names
                                      if getattr(causal.config, name, None) is not None}),
            video_token_id=getattr(causal.config, "video_token_id", None),
        )
    tensors: list[WeightRef] = []

    def buffer(sources: list[_Source]) -> WeightRef:
        """A buffer in ``dtype`` holding ``sources`` stacked along the output dimension (one source: itself)."""
        inputs = tuple(dict.fromkeys(t for s in sources for t in s.all_inputs))  # unique, in order

        def compute() -> torch.Tensor:
            return sources[0]() if len(sources) == 1 else torch.cat([source() for source in sources])

        with torch.no_grad():
            value = compute().to(dtype).clone()
        made = WeightRef(value, compute, inputs, parameters_version(inputs))
        tensors.append(made)
        return made

    def tensor(source: _Source) -> WeightRef:
        if source.compute is None and source.parameter.dtype == dtype:
            return WeightRef(source.parameter)
        return buffer([source])

    def group(modules: list[nn.Module]) -> tuple[list[WeightRef], list[WeightRef] | None]:
        """Linear layers that read the same input, as one fused weight (and bias) or one per layer."""
        weights, biases = zip(*(_linear_sources(module) for module in modules))
        if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
            raise UnsupportedModel("the engine needs biases on all of q/k/v (or gate/up) or on none of them")
        with_bias = biases[0] is not None
        if fuse:
            return [buffer(list(weights))], [buffer(list(biases))] if with_bias else None
        return [tensor(w) for w in weights], [tensor(b) for b in biases] if with_bias else None

    layers = []
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = group([attention.q_proj, attention.k_proj, attention.v_proj])
        gate_up, _ = group([mlp.gate_proj, mlp.up_proj])
        o, o_bias = _linear_sources(attention.o_proj)
        q_norm = getattr(attention, "q_norm", None)
        k_norm = getattr(attention, "k_norm", None)
        layers.append(LayerWeights(
            input_norm=tensor(_Source(layer.input_layernorm.weight)), qkv=qkv, qkv_bias=qkv_bias,
            o=tensor(o), o_bias=tensor(o_bias) if o_bias is not None else None,
            q_norm=tensor(_Source(q_norm.weight)) if q_norm is not None else None,
            k_norm=tensor(_Source(k_norm.weight)) if k_norm is not None else None,
            post_norm=tensor(_Source(layer.post_attention_layernorm.weight)),
            gate_up=gate_up, down=tensor(_linear_sources(mlp.down_proj)[0]),
        ))
    embed_module = decoder.embed_tokens
    if getattr(embed_module, "base_layer", None) is not None or getattr(causal.lm_head, "base_layer", None) is not None:
        raise UnsupportedModel("LoRA on the embeddings or the LM head is not supported by the engine")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = DecoderShape(
        num_layers=len(layers),
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=causal.lm_head.weight.shape[0],
        rms_eps=config.rms_norm_eps,
    )
    return DecoderWeights(
        shape=shape,
        embed=tensor(_Source(embed_module.weight)),
        layers=layers,
        norm=tensor(_Source(decoder.norm.weight)),
        lm_head=tensor(_Source(causal.lm_head.weight)),
        rotary=decoder.rotary_emb,
        dtype=dtype,
        tensors=tensors,
        vision=vision,
    )
