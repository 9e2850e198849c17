"""The weights the engine computes with: the policy's own tensors, read where they live.

The engine runs Llama-family decoders (Llama, Qwen2, Qwen3, Mistral: RMSNorm,
rotary positions, grouped-query attention, SwiGLU) with its own forward pass,
so that it can keep a KV cache per sequence across turns and capture decode in
CUDA graphs. It reads the model's parameters directly: an optimizer step on
the policy is seen by the next generation with no weight sync.

Two kinds of layers need a computed tensor instead, kept in a buffer that
:meth:`DecoderWeights.refresh` rewrites in place before each generation:

- LoRA layers (peft): the engine uses the merged weight ``W + scale * B A``, so
  adapters cost nothing in decode.
- Float32 weights when the engine computes in bf16/fp16 (mixed-precision
  training keeps float32 weights): cast once per generation rather than in
  every decode step, as autocast would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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


@dataclass
class WeightRef:
    """One weight: the model's parameter itself, or a buffer recomputed from it by ``source``."""

    value: torch.Tensor
    source: Callable[[], torch.Tensor] | None = None

    def refresh(self) -> None:
        if self.source is not None:
            with torch.no_grad():
                self.value.copy_(self.source())


@dataclass
class LayerWeights:
    input_norm: WeightRef
    q: WeightRef
    k: WeightRef
    v: WeightRef
    o: WeightRef
    post_norm: WeightRef
    gate: WeightRef
    up: WeightRef
    down: WeightRef
    q_bias: WeightRef | None = None
    k_bias: WeightRef | None = None
    v_bias: WeightRef | None = None
    o_bias: WeightRef | None = None
    q_norm: WeightRef | None = None
    """Qwen3's per-head RMSNorm of queries and keys; None elsewhere."""
    k_norm: WeightRef | None = None


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

    def refresh(self) -> None:
        """Recompute the merged and cast buffers from the model's current parameters."""
        for tensor in self.tensors:
            tensor.refresh()


def base_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def check_supported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedModel` with the reason when the engine cannot run ``model``."""
    config: Any = base_causal_lm(model).config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"the engine runs {', '.join(SUPPORTED_MODEL_TYPES)} decoders, not {model_type!r} "
            "(VLMs and other architectures use model.backend=hf)"
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"the engine's MLP is SwiGLU; this model uses {config.hidden_act!r}")
    if getattr(config, "use_sliding_window", False) or (
        model_type == "mistral" and getattr(config, "sliding_window", None)
    ):
        raise UnsupportedModel("the engine has no sliding-window attention; use model.backend=hf")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        raise UnsupportedModel("dynamic RoPE scaling depends on the sequence length; use model.backend=hf")


def _linear_sources(module: Any) -> tuple[torch.Tensor, torch.Tensor | None, Callable[[], torch.Tensor] | None]:
    """A linear layer's weight and bias parameters, and how to compute its merged weight if it is LoRA."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight, module.bias, None
    lora = module

    def merged() -> torch.Tensor:
        weight = base.weight
        if lora.merged or lora.disable_adapters:
            return weight
        for adapter in lora.active_adapters:
            if adapter in lora.lora_A:
                weight = weight + lora.get_delta_weight(adapter).to(weight.dtype)
        return weight

    return base.weight, base.bias, merged


def decoder_weights(model: nn.Module, dtype: torch.dtype) -> DecoderWeights:
    """The engine's view of ``model``'s weights, computing in ``dtype``.

    A parameter already in ``dtype`` and not under LoRA is used as it is (no copy).
    """
    check_supported(model)
    causal: Any = base_causal_lm(model)
    config: Any = causal.config
    decoder: Any = causal.model
    tensors: list[WeightRef] = []

    def tensor(parameter: torch.Tensor, source: Callable[[], torch.Tensor] | None = None) -> WeightRef:
        if source is None and parameter.dtype == dtype:
            return WeightRef(parameter)
        compute = source or (lambda: parameter)
        with torch.no_grad():
            value = compute().detach().to(dtype).clone()
        made = WeightRef(value, lambda: compute().detach())
        tensors.append(made)
        return made

    def linear(module: nn.Module) -> tuple[WeightRef, WeightRef | None]:
        weight, bias, merged = _linear_sources(module)
        return tensor(weight, merged), tensor(bias) if bias is not None else None

    layers = []
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        q, q_bias = linear(attention.q_proj)
        k, k_bias = linear(attention.k_proj)
        v, v_bias = linear(attention.v_proj)
        o, o_bias = linear(attention.o_proj)
        q_norm = getattr(attention, "q_norm", None)
        k_norm = getattr(attention, "k_norm", None)
        layers.append(LayerWeights(
            input_norm=tensor(layer.input_layernorm.weight), q=q, k=k, v=v, o=o,
            q_bias=q_bias, k_bias=k_bias, v_bias=v_bias, o_bias=o_bias,
            q_norm=tensor(q_norm.weight) if q_norm is not None else None,
            k_norm=tensor(k_norm.weight) if k_norm is not None else None,
            post_norm=tensor(layer.post_attention_layernorm.weight),
            gate=linear(mlp.gate_proj)[0], up=linear(mlp.up_proj)[0], down=linear(mlp.down_proj)[0],
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
        embed=tensor(embed_module.weight),
        layers=layers,
        norm=tensor(decoder.norm.weight),
        lm_head=tensor(causal.lm_head.weight),
        rotary=decoder.rotary_emb,
        dtype=dtype,
        tensors=tensors,
    )
