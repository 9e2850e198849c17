"""How close an update runs to the hardware: model FLOPs utilization (MFU) and the device's peak.

MFU counts the FLOPs the model's math needs, not what the implementation spends: a fully trained model costs
6 x its parameters per token (2 forward, 4 backward), a frozen base under LoRA 4 x (no weight gradients; the
adapters' own FLOPs are negligible), plus attention's scores and weighted sums over each sequence's causal
triangle (:func:`attention_flops`). A VLM's vision tower counts only when it is trained
(:func:`vision_training_flops`): a frozen tower's forward is work the step does, not training, and the
trainer says which it counted (``throughput/update_mfu_counts_vision``). Recomputation for gradient
checkpointing and padding are not counted, so an implementation that wastes work shows a lower MFU. PaLM's
and torchtitan's figures count attention too, but over the whole (t, t) square (12 x layers x width x t a
token): half of it is masked out in a causal model, so the figure here is the lower of the two for the same
run. The denominator is the device's dense bf16 peak (detected for the GPUs below, or configured).

A rollout's engine is measured against its roofline the same way: prefill by its model FLOPs over the bf16 peak
(:func:`prefill_flops`), decode by the bytes each step must read (the weights once, every sequence's cached keys
and values once; :func:`decode_bytes`) over the device's memory bandwidth (:func:`peak_bandwidth`).
"""

from __future__ import annotations

from typing import Any

import torch

PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 SXM": 989.4e12,
    "H100 NVL": 835.5e12,
    "H100 PCIe": 756.0e12,
    "H200": 989.4e12,
    "H20": 148.0e12,
    "GH200": 989.4e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362.1e12,
    "A10G": 70e12,
    "L4": 121e12,
}
"""Dense bf16 matrix FLOP/s by GPU, from the vendors' datasheets (without sparsity)."""


PEAK_HBM_BYTES_PER_S: dict[str, float] = {
    "H100 SXM": 3.35e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H200": 4.8e12,
    "GH200 HBM3": 4.0e12,
    "GH200 HBM3e": 4.9e12,
    "B200": 8.0e12,
    "A100 80GB SXM": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100 40GB": 1.555e12,
    "L40S": 0.864e12,
    "A10G": 0.6e12,
    "L4": 0.3e12,
}
"""GPU memory bandwidth in bytes/s by GPU, from NVIDIA's datasheets: H100 (SXM 3.35 TB/s, PCIe 2 TB/s, NVL
3.9 TB/s), H200 (4.8 TB/s), GH200 Grace Hopper Superchip (96 GB HBM3 4 TB/s, 144 GB HBM3e 4.9 TB/s), HGX B200
(8 TB/s a GPU), A100 (80 GB SXM 2,039 GB/s, 80 GB PCIe 1,935 GB/s, 40 GB 1,555 GB/s), L40S (864 GB/s), A10G
(600 GB/s; AWS's G5 instances) and L4 (300 GB/s)."""


def peak_flops(device: torch.device, configured: float = 0.0) -> float | None:
    """The device's dense bf16 peak in FLOP/s: ``configured`` when above 0, else looked up by the GPU's name;
    None on a CPU or an unknown GPU (the MFU metric is then left out)."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "H100" in name:
        kind = "H100 NVL" if "NVL" in name else "H100 PCIe" if "PCIe" in name else "H100 SXM"
        return PEAK_BF16_FLOPS[kind]
    for kind in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # "GH200" before "H200", "A100" before "A10"
        if kind in name:
            return PEAK_BF16_FLOPS[kind]
    return None


def peak_bandwidth(device: torch.device, configured: float = 0.0) -> float | None:
    """The device's memory bandwidth in bytes/s: ``configured`` when above 0, else looked up by the GPU's name
    (:data:`PEAK_HBM_BYTES_PER_S`); None on a CPU or an unknown GPU."""
    if configured > 0:
        return configured
    if device.type != "cuda":
        return None
    return bandwidth_of(torch.cuda.get_device_name(device))


def bandwidth_of(name: str) -> float | None:
    """The memory bandwidth of a GPU by its CUDA name (``NVIDIA H100 80GB HBM3``, ``NVIDIA A100-SXM4-40GB``), or
    None for a GPU not in :data:`PEAK_HBM_BYTES_PER_S`."""
    if "GH200" in name:  # the HBM3e part names its memory (144G HBM3e), the HBM3 one its CPU memory (480GB)
        return PEAK_HBM_BYTES_PER_S["GH200 HBM3e" if "HBM3e" in name or "144G" in name else "GH200 HBM3"]
    if "H100" in name:
        return PEAK_HBM_BYTES_PER_S["H100 NVL" if "NVL" in name else "H100 PCIe" if "PCIe" in name else "H100 SXM"]
    if "A100" in name:
        if "80GB" not in name:
            return PEAK_HBM_BYTES_PER_S["A100 40GB"]
        return PEAK_HBM_BYTES_PER_S["A100 80GB PCIe" if "PCIe" in name else "A100 80GB SXM"]
    for kind in sorted(PEAK_HBM_BYTES_PER_S, key=len, reverse=True):  # "L40S" before "L4"
        if kind in name:
            return PEAK_HBM_BYTES_PER_S[kind]
    return None


def training_flops_per_token(model: torch.nn.Module, lookup_only: torch.Tensor | None = None) -> float:
    """Model FLOPs of one trained token (forward and backward) through ``model``: 6 x its trained parameters
    plus 4 x the frozen ones (a LoRA base: the forward pass and the input gradients run through them).

    Args:
        lookup_only: the input embeddings when they are not also the LM head: a lookup costs no FLOPs.
            A vision tower's parameters (names with ``visual`` or ``vision``) are left out too: they see image
            patches, not the tokens counted.
    """
    seen = {id(lookup_only)} if lookup_only is not None else set()
    trained = frozen = 0
    for name, parameter in model.named_parameters():
        if id(parameter) in seen or "visual" in name or "vision" in name:
            continue
        seen.add(id(parameter))
        if parameter.requires_grad:
            trained += parameter.numel()
        else:
            frozen += parameter.numel()
    return 6.0 * trained + 4.0 * frozen


def attention_flops(layers: int, query_width: int, sequence_lengths: torch.Tensor) -> float:
    """FLOPs of causal attention in one training pass (forward and backward) over a batch of sequences.

    Per layer and sequence of ``s`` tokens the forward pass takes ``s^2 / 2`` query-key dot products and as many
    weighted sums of values, each ``2 x query_width`` FLOPs (``s^2 x query_width`` apiece); the backward pass
    twice the forward. Attention has no weights, so a frozen base (LoRA) costs the same.

    Args:
        layers: the decoder's layers.
        query_width: query heads x head dimension (keys and values shared among heads (GQA) change nothing).
        sequence_lengths: Shape (n,), each sequence's tokens.
    """
    squares = float((sequence_lengths.double() ** 2).sum())
    return 6.0 * layers * query_width * squares


def attention_shape(model_config: Any) -> tuple[int, int]:
    """(layers, query heads x head dimension) of a transformers config (a VLM's text config)."""
    text = model_config.get_text_config()
    # transformers' own rule: Qwen3's config names its head dimension, Qwen2's leaves it to width / heads.
    head_dim = text.head_dim if getattr(text, "head_dim", None) else text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_attention_heads * head_dim


def training_flops(flops_per_token: float, model_config: Any, sequence_lengths: torch.Tensor) -> float:
    """Model FLOPs of one training pass of a model over sequences: ``flops_per_token``
    (:func:`training_flops_per_token`) for each token, plus their causal attention (:func:`attention_flops`).

    Args:
        model_config: the model's transformers config (its layers and attention width).
        sequence_lengths: Shape (n,), each sequence's tokens.
    """
    attention = attention_flops(*attention_shape(model_config), sequence_lengths)
    return flops_per_token * float(sequence_lengths.sum()) + attention


def vision_training_flops(tower: torch.nn.Module, vision_config: Any, grids: torch.Tensor,
                          forward_only: bool = False) -> float:
    """Model FLOPs of one training pass (forward and backward) of a trained vision tower over images; with
    ``forward_only``, of its forward pass alone (2 x a parameter, a third of the attention's).

    A Qwen-VL tower runs its blocks over every patch and its mergers (the final one and Qwen3-VL's deepstack
    ones) over every group of ``spatial_merge_size**2`` patches: 6 x the blocks' trained parameters a patch
    plus 6 x the mergers' a merged token, 4 x for frozen ones (a LoRA base; the position-embedding table of
    Qwen3-VL is a lookup). Its attention is not
    causal: each layer costs ``12 x width`` FLOPs a pair of patches that attend to each other (forward and
    backward), each image's patches all pairs in the full-attention blocks
    (``fullatt_block_indexes``; every block when the config names none) and, in Qwen2.5-VL's windowed ones,
    each patch the patches of its window (``window_size / patch_size`` squared; fewer at a cut image's edge,
    which is not counted: a slight overcount).

    Args:
        tower: the vision encoder (its parameters are counted).
        vision_config: its transformers config.
        grids: Shape (n, 3): each image's ``image_grid_thw`` (frames, patch rows, patch columns).
    """
    return vision_grid_flops(vision_weight_flops(tower, forward_only), vision_config, grids, forward_only)


def vision_weight_flops(tower: torch.nn.Module, forward_only: bool = False) -> tuple[float, float]:
    """The FLOPs a patch and a merged token cost in a vision tower's weights (:func:`vision_training_flops`): a
    walk over its parameters, which a caller counting many passes of one tower makes once."""
    per_patch = per_merged = 0.0
    for name, parameter in tower.named_parameters():
        if "pos_embed" in name and "patch" not in name:
            continue
        flops = (2.0 if forward_only else 6.0 if parameter.requires_grad else 4.0) * parameter.numel()
        if "merger" in name:
            per_merged += flops
        else:
            per_patch += flops
    return per_patch, per_merged


def vision_grid_flops(weight_flops: tuple[float, float], vision_config: Any, grids: torch.Tensor,
                      forward_only: bool = False) -> float:
    """:func:`vision_training_flops` from the tower's :func:`vision_weight_flops` (a patch's, a merged token's)."""
    per_patch, per_merged = weight_flops
    patches = grids.reshape(-1, 3).prod(-1).double()
    merged = float(patches.sum()) / vision_config.spatial_merge_size**2
    weights = per_patch * float(patches.sum()) + per_merged * merged
    depth, width = vision_config.depth, vision_config.hidden_size
    full = getattr(vision_config, "fullatt_block_indexes", None)
    full_blocks = depth if full is None else len(full)
    window = (vision_config.window_size // vision_config.patch_size) ** 2 if full is not None else 0
    pairs = full_blocks * float((patches**2).sum()) + (depth - full_blocks) * float(
        (patches * patches.clamp(max=window)).sum())
    return weights + (4.0 if forward_only else 12.0) * width * pairs


def prefill_flops(layer_parameters: int, layers: int, query_width: int, new_tokens: int, attention_pairs: int
                  ) -> float:
    """Model FLOPs of a decoder's prefill: 2 x its layers' parameters a new token (a forward pass), and causal
    attention of the new tokens against their cached prefix and each other, ``4 x layers x query_width`` a query-key
    pair (the score's dot product and the value's weighted sum, ``2 x query_width`` each). The LM head runs only at
    each sequence's last new token and is left out (with a few hundred new tokens a turn, well under 1%); a VLM's
    vision tower is counted apart (:func:`vision_training_flops` with ``forward_only``).

    Args:
        layer_parameters: the decoder layers' parameters (no embeddings, no LM head).
        layers: the decoder's layers. query_width: query heads x head dimension.
        new_tokens: tokens prefilled. attention_pairs: their query-key pairs, ``new x (cached + (new + 1) / 2)``
            summed over the sequences (the engine's ``prefill_attention_pairs``).
    """
    return 2.0 * layer_parameters * new_tokens + 4.0 * layers * query_width * attention_pairs


def key_value_bytes(layers: int, key_value_heads: int, head_dim: int, element_bytes: int) -> int:
    """Bytes of one cached token's keys and values over every layer: ``2 x layers x kv heads x head dim x
    element_bytes``."""
    return 2 * layers * key_value_heads * head_dim * element_bytes


def decode_bytes(weight_bytes: int, steps: int, token_bytes: int, key_tokens: int) -> float:
    """Bytes decode steps must read from memory at the least: the weights once a step (however many rows it
    decodes), and each row's cached keys and values once a step.

    Args:
        weight_bytes: the weights a step reads (the decoder's layers, final norm and LM head, in their dtype).
        steps: decode steps. token_bytes: a cached token's keys and values (:func:`key_value_bytes`).
        key_tokens: cached tokens attended to, summed over the rows of every step (the engine's
            ``decode_key_tokens``).
    """
    return float(weight_bytes) * steps + float(token_bytes) * key_tokens


def roofline_share(work: float, seconds: float, peak: float | None) -> float | None:
    """The share of the hardware's limit a phase reached: ``work`` (FLOPs, bytes) over ``seconds`` at ``peak`` (a
    second's FLOPs, bytes); None when the peak is unknown or no time was spent."""
    if peak is None or seconds <= 0:
        return None
    return work / (seconds * peak)


def mfu(flops: float, seconds: float, peak: float | None, processes: int = 1) -> float | None:
    """Model FLOPs utilization: ``flops / seconds`` over ``processes`` devices of ``peak``."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / (peak * processes)
