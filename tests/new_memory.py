"""What tests use to see the memory an operation makes: the float32 tensors that ops write into new memory."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FloatOutputs(TorchDispatchMode):
    """The shapes of the float32 tensors of more than one element that ops make in new memory (not views of an
    input, nor an input written in place), in order, while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() > 1 and \
                out.untyped_storage().data_ptr() not in inputs:
            self.shapes.append(tuple(out.shape))
        return out
