"""A vision tower's MLP computed as if its hidden width were a multiple of 64, with the same result.

Qwen2.5-VL's vision blocks (the one 675M-parameter tower of every size, 3B to 72B) have an MLP 3,420 wide. Rows
of 3,420 bf16 values are 6,840 bytes, not a multiple of 16, and cuBLAS then falls back to Ampere-generation
kernels: on an H200 its gate, up and down products ran at 221-255 TFLOP/s against 723-777 TFLOP/s at a width of
3,456, and the eager tower took 1.37x as long over 64 images (docs/benchmarks.md, "Each phase's kernels").

:func:`aligned_mlp_forward` computes the gate and up projections with their weights and biases padded by zero rows
to the next multiple of 64, and the down projection with its weight padded by as many zero columns: each padded
hidden unit is ``SiLU(0) x 0 = 0`` and adds nothing, so the function is the MLP's (to the rounding of other
kernels). The padding is made from the parameters at each call (a copy of a few megabytes a block, against
matrix products of gigaflops), so the parameters, their gradients, optimizer states and checkpoints keep the
model's shapes, and a trained tower's gradients flow through the padding to them unchanged. A loaded tower's
unaligned MLPs are made :class:`AlignedQwen2_5_VLMLP` (:func:`align_vision_mlps`), whose forward it is.

A block compiled by :func:`turnrl.models.loading.compile_layer_parts` compiles this forward too. Inductor may pad
the products of Qwen2_5_VLMLP's own forward itself, but only where a benchmark at the sizes a graph is first
compiled for says it pays (its ``pad_mm`` pass; a dynamic graph keeps that choice for every later size), and it
slices and re-pads the outputs around the SiLU product: over passes of 56-60 images of the 3B tower on an H200
(padded to 3,424 there) the compiled own forward took 0.0803 s a pass and the compiled aligned one 0.0696 s, its
elementwise kernels 2.1 ms against 4.9 ms (docs/benchmarks.md; ``benchmarks/vision_attention.py --mlp`` times
both). A LoRA-wrapped projection (peft's layers replace
``nn.Linear``) runs Qwen2_5_VLMLP's own forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

ALIGN = 64
"""Hidden widths are padded to a multiple of this many units (128 bytes of bf16)."""


def aligned(width: int) -> int:
    """``width`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-width // ALIGN) * ALIGN


def aligned_mlp_forward(self: Qwen2_5_VLMLP, hidden_state: torch.Tensor) -> torch.Tensor:
    """:class:`Qwen2_5_VLMLP`'s forward, ``down(act(gate(x)) * up(x))``, on weights padded to an aligned width.

    Args:
        hidden_state: Shape (..., hidden).

    Returns:
        Shape (..., hidden).
    """
    gate, up, down = self.gate_proj, self.up_proj, self.down_proj
    if not all(type(layer) is nn.Linear for layer in (gate, up, down)):  # adapters wrap them: plain forward
        return Qwen2_5_VLMLP.forward(self, hidden_state)
    extra = aligned(gate.out_features) - gate.out_features

    def widened(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:  # zero rows: extra outputs of 0 (+ 0 bias)
        bias = None if layer.bias is None else F.pad(layer.bias, (0, extra))
        return F.linear(x, F.pad(layer.weight, (0, 0, 0, extra)), bias)

    hidden = self.act_fn(widened(gate, hidden_state)) * widened(up, hidden_state)
    return F.linear(hidden, F.pad(down.weight, (0, extra)), down.bias)  # zero columns: the extra units add 0


class AlignedQwen2_5_VLMLP(Qwen2_5_VLMLP):
    """A Qwen2.5-VL vision MLP that runs :func:`aligned_mlp_forward`: its class, not a forward bound to the
    instance, so that copies and pickles of a model (which name an object's class, and cannot name a function
    bound to it) run it too. Its parameters, state dict and checkpoints are its parent's."""

    forward = aligned_mlp_forward


def align_vision_mlps(model: Any) -> int:
    """Make each Qwen2.5-VL vision MLP of ``model`` whose width is not a multiple of :data:`ALIGN` an
    :class:`AlignedQwen2_5_VLMLP`, in place; returns how many. Other models (text, Qwen2-VL and Qwen3-VL towers,
    whose widths are aligned) are left alone."""
    count = 0
    for module in model.modules():
        if type(module) is Qwen2_5_VLMLP and module.gate_proj.out_features % ALIGN:
            module.__class__ = AlignedQwen2_5_VLMLP
            count += 1
    return count
