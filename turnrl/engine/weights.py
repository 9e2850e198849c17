"""The weights the engine computes with: the policy's own tensors, read where they live.

The engine runs pre-norm decoders (RMSNorm, rotary positions, grouped-query attention, SwiGLU) of the families
in :mod:`turnrl.engine.families` with its own forward pass, so that it can keep a KV cache per sequence across
turns and capture decode in CUDA graphs. It reads the model's parameters directly, where the family's record
says they are: an optimizer step on the policy is seen by the next generation with no weight sync.

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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from turnrl.engine.families import Family, Rotary, UnsupportedModel, family_of
from turnrl.models.loading import vision_tower
from turnrl.models.throughput import vision_grid_flops, vision_weight_flops
from turnrl.models.vision_layout import TowerLayouts


@dataclass
class DecoderShape:
    """The numbers of a decoder that its forward pass needs."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float

    @property
    def key_width(self) -> int:
        """A token's cached keys over every layer (layers x key/value heads x head size), and as many values."""
        return self.num_layers * self.num_kv_heads * self.head_dim


def parameters_version(inputs: tuple[torch.Tensor, ...]) -> int:
    """A number that changes whenever one of ``inputs`` is modified in place (an optimizer step, a load)."""
    return sum(tensor._version for tensor in inputs)


def write_rows(value: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    """Copy ``blocks`` into ``value`` one after the other along its first dimension, each cast as it is copied: a
    fused buffer is filled from its float32 parameters without a float32 concatenation of them (0.17 GiB for a
    3B model's gate and up projections)."""
    row = 0
    for block in blocks:
        value[row:row + block.shape[0]].copy_(block)
        row += block.shape[0]


@dataclass
class WeightRef:
    """One weight: the model's parameter itself, or a buffer recomputed from parameters by ``source``."""

    value: torch.Tensor
    source: Callable[[], list[torch.Tensor]] | None = None
    """The buffer's row blocks, in order (one block: the whole weight)."""
    inputs: tuple[torch.Tensor, ...] = ()
    """The parameters ``source`` reads; the buffer is recomputed only when one of them changed (empty: always)."""
    seen_version: int = -1
    """``inputs``' version when ``value`` was last computed."""

    def refresh(self) -> bool:
        """Recompute the buffer if its parameters changed or it was released; True if it was rewritten."""
        if self.source is None:
            return False
        version = parameters_version(self.inputs)
        if self.inputs and version == self.seen_version:
            return False
        storage = self.value.untyped_storage()
        if storage.size() == 0:  # released
            storage.resize_(self.value.numel() * self.value.element_size())
        with torch.no_grad():
            write_rows(self.value, self.source())
        self.seen_version = version
        return True

    def release(self) -> None:
        """Free a computed buffer's memory (the tensor keeps its shape); :meth:`refresh` computes it again. The
        model's own parameters are left alone."""
        if self.source is not None:
            self.value.untyped_storage().resize_(0)
            self.seen_version = -1  # no version of its inputs: computed again whatever they are


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
    """The per-head RMSNorm of queries and keys where the family has one (Qwen3's); None elsewhere."""
    k_norm: WeightRef | None = None

    def refs(self) -> list[WeightRef]:
        """Every weight of the layer (the optional ones it has)."""
        optional = [*(self.qkv_bias or []), self.o_bias, self.q_norm, self.k_norm]
        return [self.input_norm, *self.qkv, self.o, self.post_norm, *self.gate_up, self.down,
                *(ref for ref in optional if ref is not None)]


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
    """The family's tower module (:attr:`~turnrl.engine.families.VisionParts.tower`: a Qwen-VL's inner model,
    ``Qwen2VLModel``, ``Qwen2_5_VLModel``, ``Qwen3VLModel``), whose ``get_image_features`` runs the vision tower and
    its patch merger."""
    image_token_id: int
    merge_size: int
    """Patches merged into one token along each spatial side."""
    rope_axes: torch.Tensor
    """Which M-RoPE position (0 temporal, 1 height, 2 width) each rotary dim turns by, Shape (D,) int64."""
    special_token_ids: list[int]
    """Vision tokens never sampled: a sampled placeholder would be read as an image slot."""
    video_token_id: int | None = None
    """Videos are not run by the engine: a prompt with their placeholder is refused."""
    deepstack: bool = False
    """The tower returns deepstack features too (the family's :attr:`~turnrl.engine.families.VisionParts.deepstack`)."""
    dtype: torch.dtype = torch.float32
    """The engine's compute dtype, the tower's too: a tower whose weights are in another (a trained VLM's float32
    weights under a bf16 engine) runs under autocast to it, as the trainer's passes run it."""
    _weight_flops: tuple[float, float] | None = field(default=None, init=False, repr=False)
    _patch_width: int | None = field(default=None, init=False, repr=False)
    _layouts: TowerLayouts | None = field(default=None, init=False, repr=False)

    def forward_flops(self, grids: torch.Tensor) -> float:
        """The tower's forward FLOPs over images of these patch grids, Shape (m, 3)
        (:func:`~turnrl.models.throughput.vision_training_flops`); its weights' share is counted once."""
        if self._weight_flops is None:
            tower = vision_tower(self.model)
            self._weight_flops = vision_weight_flops(tower, forward_only=True) if tower is not None else (0.0, 0.0)
        config: Any = self.model.config
        return vision_grid_flops(self._weight_flops, config.vision_config, grids, forward_only=True)

    def patch_width(self) -> int:
        """Values a patch holds, a ``pixel_values`` row's width: channels x frames x pixels of a patch, the inputs
        of the tower's patch embedding (every Qwen-VL's: a 3-D convolution over a patch)."""
        if self._patch_width is None:
            tower: Any = vision_tower(self.model)
            self._patch_width = math.prod(tower.patch_embed.proj.weight.shape[1:])
        return self._patch_width

    def features(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> ImageFeatures:
        """The decoder-side features of images, one row per placeholder token, in order.

        Args:
            pixel_values: the images' patches, concatenated, Shape (patches, patch_dim). grids: each image's
                (temporal, height, width) patch grid, Shape (m, 3), best on the host: the tower's layout is
                made from them there (:mod:`turnrl.models.vision_layout`), so that nothing is read from the device.

        Returns:
            Each tensor Shape (tokens, hidden), tokens = sum over images of t * h * w / merge_size**2.
        """
        if self._layouts is None:
            self._layouts = TowerLayouts(vision_tower(self.model))
        layout = self._layouts.inputs(grids, pixel_values.device)
        if not layout:  # the tower makes its own layout, from grids beside the pixels
            grids = grids.to(pixel_values.device)
        # transformers 5.x returns an output object whose pooler_output holds the merged features, one tensor per
        # image; a config with return_dict=False would make it a tuple, so the object is asked for. Its
        # deepstack_features (Qwen3-VL) hold a layer's features split per image like pooler_output (5.24), or
        # whole (5.17).
        # The engine switches a caller's autocast off, and the decoder's float32 weights get bf16 copies; the tower
        # has none, so without autocast here it ran its matrix products in float32 in every training rollout.
        with torch.autocast(pixel_values.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            out = self.model.get_image_features(pixel_values, grids, return_dict=True,  # type: ignore[operator]
                                                **layout)
        deepstack = (out.deepstack_features or []) if self.deepstack else []
        features = ImageFeatures(_concatenated(out.pooler_output), [_concatenated(layer) for layer in deepstack])
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
    family: Family
    """The model's family: what the forward pass computes beyond these tensors (rotary kind, q/k norms)."""
    tensors: list[WeightRef] = field(default_factory=list)
    vision: VisionWeights | None = None
    """A VLM's image side; None for a text model."""

    def layer_parameters(self) -> int:
        """The decoder layers' parameters: what each token goes through (the input embedding is a lookup and the LM
        head runs at the tokens sampled from)."""
        return sum(ref.value.numel() for layer in self.layers for ref in layer.refs())

    def decode_bytes(self) -> int:
        """Bytes of weights a decode step reads, in the dtype the engine computes with: every layer's, the final
        norm's and the LM head's (the input embeddings are read a row a token: not counted)."""
        refs = [ref for layer in self.layers for ref in layer.refs()] + [self.norm, self.lm_head]
        return sum(ref.value.numel() * ref.value.element_size() for ref in refs)

    def refresh(self) -> int:
        """Recompute the merged, cast and fused buffers whose parameters changed; returns how many were."""
        return sum(tensor.refresh() for tensor in self.tensors)

    def release(self) -> None:
        """Free the merged, cast and fused buffers until the next :meth:`refresh`."""
        for tensor in self.tensors:
            tensor.release()

    def checksum(self) -> WeightsChecksum:
        """The checksum of what the engine computes with (merged, cast or fused buffers as they are now, not
        refreshed) for the weights :func:`model_checksum` probes: the query, key and value and the down
        projections of the first and last layers, and the LM head."""
        probed = [ref for layer in (self.layers[0], self.layers[-1]) for ref in (*layer.qkv, layer.down)]
        return checksum([ref.value for ref in (*probed, self.lm_head)], self.dtype)


def base_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_supported(model: nn.Module) -> Family:
    """The family that runs ``model``; :class:`UnsupportedModel` with the reason when the engine cannot run it."""
    config = base_causal_lm(model).config
    family = family_of(config)
    family.check(config)
    return family


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


def check_mergeable(layer: Any, linear: bool = False) -> None:
    """Raise :class:`UnsupportedModel` where a peft layer's weight is not ``W + scale * B A`` (what
    :func:`lora_merged_weight` computes): another tuner than LoRA (LoHa, IA3, ...), a LoRA variant (DoRA rescales
    the merged weight by its magnitude vector) or a bias on the adapters (``lora_bias``, added to the layer's
    bias); with ``linear``, also LoRA on anything but a plain linear layer (a quantized one). Merged as plain LoRA,
    such a layer would give other weights than the trained model's, silently."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    problem = None
    if not isinstance(layer, LoraLinear if linear else LoraLayer):
        problem = f"a {type(layer).__module__}.{type(layer).__qualname__} layer"
    elif layer.lora_variant or any(layer.use_dora.values()):
        problem = "a LoRA variant (DoRA)"
    elif any(layer.lora_bias.values()):
        problem = "a bias on its adapters (lora_bias)"
    if problem is not None:
        raise UnsupportedModel(f"the engine merges plain LoRA adapters into linear layers; this model has {problem}: "
                               "merge the adapters into the model first (peft's merge_and_unload), train plain "
                               "LoRA, or use model.backend=hf")


def lora_merged_weight(layer: Any) -> torch.Tensor:
    """A peft LoRA layer's weight with its active adapters merged (peft's ``get_delta_weight``), out of place:
    the frozen base weight is never written (merging and unmerging in place would round it a little each time).
    The base weight itself where peft merged the adapters into it already or they are disabled.

    Raises:
        UnsupportedModel: the layer's adapters are not plain LoRA (:func:`check_mergeable`).
    """
    check_mergeable(layer)
    weight = layer.base_layer.weight
    if layer.merged or layer.disable_adapters:
        return weight
    # A LoRA embedding keeps its matrices in lora_embedding_A/B, its lora_A empty: looked up in lora_A alone, its
    # adapters were never merged.
    held = {*layer.lora_A.keys(), *layer.lora_embedding_A.keys()}
    for adapter in layer.active_adapters:
        if adapter in held:
            weight = weight + layer.get_delta_weight(adapter).to(weight.dtype)
    return weight


def _linear_sources(module: Any) -> tuple[_Source, _Source | None]:
    """A linear layer's weight and bias, the weight merged with its adapters if it is LoRA."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return _Source(module.weight), _Source(module.bias) if module.bias is not None else None
    check_mergeable(module, linear=True)
    weight = _Source(base.weight, lambda: lora_merged_weight(module), tuple(module.parameters()))
    return weight, _Source(base.bias) if base.bias is not None else None


def decoder_weights(model: nn.Module, dtype: torch.dtype, fuse: bool = True) -> DecoderWeights:
    """The engine's view of ``model``'s weights, computing in ``dtype``.

    A parameter already in ``dtype`` and not under LoRA is used as it is (no copy), unless ``fuse`` stacks it
    with its group (q/k/v, gate/up) into one buffer: that costs a copy of those weights, and saves three GEMM
    launches per layer and decode step.
    """
    family = check_supported(model)
    names = family.weights
    causal: Any = base_causal_lm(model)
    config: Any = family.decoder_config(causal.config)
    decoder = causal.get_submodule(names.decoder)
    rotary = decoder.get_submodule(names.rotary)
    lm_head = causal.get_submodule(names.lm_head)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    vision = None
    if family.vision is not None:
        parts = family.vision
        vision = VisionWeights(
            model=causal.get_submodule(parts.tower), image_token_id=getattr(causal.config, parts.image_token),
            merge_size=getattr(causal.config.vision_config, parts.merge_size),
            rope_axes=rope_axes(mrope_section(rotary, config), head_dim,
                                interleaved=family.rotary is Rotary.MROPE_INTERLEAVED).to(lm_head.weight.device),
            special_token_ids=sorted({getattr(causal.config, name) for name in parts.never_sampled
                                      if getattr(causal.config, name, None) is not None}),
            video_token_id=getattr(causal.config, parts.video_token, None),
            deepstack=parts.deepstack,
            dtype=dtype,
        )
    tensors: list[WeightRef] = []

    def buffer(sources: list[_Source]) -> WeightRef:
        """A buffer in ``dtype`` holding ``sources`` stacked along the output dimension (one source: itself)."""
        inputs = tuple(dict.fromkeys(t for s in sources for t in s.all_inputs))  # unique, in order

        def compute() -> list[torch.Tensor]:
            return [source() for source in sources]

        with torch.no_grad():
            blocks = compute()
            value = torch.empty((sum(block.shape[0] for block in blocks), *blocks[0].shape[1:]), dtype=dtype,
                                device=blocks[0].device)
            write_rows(value, blocks)
        made = WeightRef(value, compute, inputs, parameters_version(inputs))
        tensors.append(made)
        return made

    cast: dict[int, WeightRef] = {}  # by parameter: a tied input embedding and LM head get one buffer

    def tensor(source: _Source) -> WeightRef:
        if source.compute is None and source.parameter.dtype == dtype:
            return WeightRef(source.parameter)
        if source.compute is not None:
            return buffer([source])
        if id(source.parameter) not in cast:
            cast[id(source.parameter)] = buffer([source])
        return cast[id(source.parameter)]

    def group(modules: list[nn.Module]) -> tuple[list[WeightRef], list[WeightRef] | None]:
        """Linear layers that read the same input, as one fused weight (and bias) or one per layer."""
        weights, biases = zip(*(_linear_sources(module) for module in modules))
        if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
            raise UnsupportedModel("the engine needs biases on all of q/k/v (or gate/up) or on none of them")
        with_bias = biases[0] is not None
        if fuse:
            return [buffer(list(weights))], [buffer(list(biases))] if with_bias else None
        return [tensor(w) for w in weights], [tensor(b) for b in biases] if with_bias else None

    def norm(parent: nn.Module, name: str) -> WeightRef:
        module: Any = parent.get_submodule(name)
        return tensor(_Source(module.weight))

    layers = []
    for layer in decoder.get_submodule(names.layers):
        qkv, qkv_bias = group([layer.get_submodule(name) for name in names.qkv])
        gate_up, _ = group([layer.get_submodule(name) for name in names.gate_up])
        o, o_bias = _linear_sources(layer.get_submodule(names.o))
        layers.append(LayerWeights(
            input_norm=norm(layer, names.input_norm), qkv=qkv, qkv_bias=qkv_bias,
            o=tensor(o), o_bias=tensor(o_bias) if o_bias is not None else None,
            q_norm=norm(layer, names.q_norm) if family.qk_norm else None,
            k_norm=norm(layer, names.k_norm) if family.qk_norm else None,
            post_norm=norm(layer, names.post_norm),
            gate_up=gate_up, down=tensor(_linear_sources(layer.get_submodule(names.down))[0]),
        ))
    embed_module = decoder.get_submodule(names.embed)
    if getattr(embed_module, "base_layer", None) is not None or getattr(lm_head, "base_layer", None) is not None:
        raise UnsupportedModel("LoRA on the embeddings or the LM head is not supported by the engine")
    shape = DecoderShape(
        num_layers=len(layers),
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=lm_head.weight.shape[0],
        rms_eps=config.rms_norm_eps,
    )
    return DecoderWeights(
        shape=shape,
        embed=tensor(_Source(embed_module.weight)),
        layers=layers,
        norm=norm(decoder, names.final_norm),
        lm_head=tensor(_Source(lm_head.weight)),
        rotary=rotary,
        dtype=dtype,
        family=family,
        tensors=tensors,
        vision=vision,
    )


# --------------------------------------------------------------------------- the check after a weights sync
@dataclass(frozen=True)
class WeightsChecksum:
    """A fingerprint of a few of a model's weights as something computes with them (see :func:`model_checksum`).

    Cheap by design (five or so tensors, summed on their device): it tells that two holders of the weights agree,
    or that one changed, without comparing every parameter.
    """

    total: float
    """The probed tensors' elements summed in float64."""
    norm: float
    """Their Euclidean norm (float64): the scale of the rounding differences between two computations of them."""
    dtype: torch.dtype
    """The dtype the probed tensors were computed in (the rollout's; the trainer's side casts to it)."""

    def agrees(self, other: WeightsChecksum) -> bool:
        """Whether ``other`` holds the same weights, up to the rounding of computing them differently.

        Merging LoRA adapters in another dtype or on another device moves an element by an ulp or so, up or down
        at random (rounding to nearest is unbiased), so the totals differ by about ``eps * norm``; a margin of 8 of
        those never fails on rounding, and a real difference (stale adapters, other weights) is far larger.
        """
        tolerance = 8 * torch.finfo(self.dtype).eps * max(self.norm, other.norm)
        return abs(self.total - other.total) <= tolerance


CHECKSUM_CHUNK = 1 << 24
"""Elements cast to float64 at a time by :func:`checksum`: 128 MB, where a 3B model's LM head whole in float64
would take 2.5 GB more at the moment a run's memory is fullest (the weights just updated, the rollout next)."""


def checksum(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> WeightsChecksum:
    """:class:`WeightsChecksum` of ``tensors`` (each cast to ``dtype`` first), summed on their device in float64,
    :data:`CHECKSUM_CHUNK` elements at a time.

    A sharded tensor (an FSDP2 ``DTensor``) is summed where it lies: each process sums its own shard and the
    partial sums are all-reduced over the processes that hold its shards (a collective: every process calls this
    with the same tensors), so no process ever holds such a tensor whole.
    """
    total = squares = 0.0
    with torch.no_grad():
        for tensor in tensors:
            if isinstance(tensor, DTensor):
                sums = _sharded_sums(tensor, dtype)
            elif tensor.untyped_storage().size() == 0:  # a released buffer: no weights to compute with
                return WeightsChecksum(math.nan, math.nan, dtype)
            else:
                sums = _local_sums(tensor, dtype)
            total += float(sums[0])
            squares += float(sums[1])
    return WeightsChecksum(total, math.sqrt(squares), dtype)


def _local_sums(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum and the sum of squares of ``tensor``'s elements cast to ``dtype``, in float64 on its device.

    Returns:
        Shape (2,) float64.
    """
    sums = torch.zeros(2, dtype=torch.float64, device=tensor.device)
    for chunk in tensor.detach().reshape(-1).split(CHECKSUM_CHUNK):
        values = chunk.to(dtype).double()
        sums[0] += values.sum()
        sums[1] += values.square().sum()
    return sums


def _sharded_sums(tensor: DTensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_local_sums` of a ``DTensor`` as a whole, from its shards: this process's shard summed, then the
    sums all-reduced over each mesh dimension the tensor is sharded along. A replicated dimension holds the same
    elements on each of its processes and is counted once; a partial one (not yet reduced) is reduce-scattered
    into shards first, since its parts' squares do not add up to the square of their sum."""
    if any(placement.is_partial() for placement in tensor.placements):
        tensor = tensor.redistribute(placements=[Shard(0) if placement.is_partial() else placement
                                                 for placement in tensor.placements])
    sums = _local_sums(tensor.to_local(), dtype)
    # An offloaded shard lives on the host while the mesh's collectives run on its devices (NCCL takes no host
    # tensor): the two sums go where the mesh computes.
    sums = sums.to(_mesh_device(tensor.device_mesh.device_type))
    for dim, placement in enumerate(tensor.placements):
        if placement.is_shard():
            torch.distributed.all_reduce(sums, group=tensor.device_mesh.get_group(dim))
    return sums


def _mesh_device(device_type: str) -> torch.device:
    """This process's device of a mesh's type (its current GPU for ``cuda``)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def model_checksum(model: nn.Module, dtype: torch.dtype) -> WeightsChecksum:
    """The checksum of the weights the engine probes in :meth:`DecoderWeights.checksum`, computed from ``model``'s
    own modules as the engine computes them (LoRA adapters merged, cast to ``dtype``): the query, key and value and
    the down projections of the first and last decoder layers, and the LM head.

    ``model`` may be peft-wrapped and FSDP2-sharded (every process must then call it: each sums its shards of
    the probed tensors, and the sums are all-reduced; see :func:`checksum`). Raises
    :class:`~turnrl.engine.families.UnsupportedModel` for a model of no engine family.
    """
    names = check_supported(model).weights
    causal: Any = base_causal_lm(model)
    layers = causal.get_submodule(names.decoder).get_submodule(names.layers)
    modules = [layer.get_submodule(name) for layer in (layers[0], layers[len(layers) - 1])
               for name in (*names.qkv, names.down)]
    with torch.no_grad():
        weights = [_linear_sources(module)[0]() for module in modules]
        weights.append(causal.get_submodule(names.lm_head).weight)
    return checksum(weights, dtype)
