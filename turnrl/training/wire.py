"""Python objects as one byte tensor for ``torch.distributed`` (trajectories, metrics, the pool's messages), their
CPU tensors and numpy arrays carried as raw bytes beside the pickle.

Written here because pickling a torch tensor saves its storage with ``torch.save``, and unpickling it runs
``torch.load`` once a storage: a VisGym step's 64 episodes of 15 turns carry 960 images' pixel values and frames
(724 MB), which took 2.4 s to pickle and unpickle on a 2-core machine and on a GPU host alike, and 0.2-0.3 s as
raw buffers (``benchmarks/wire.py``). Pickle's protocol 5 keeps large buffers out of the pickle (PEP 574): here
they are laid after it in the payload, each at a 64-byte boundary, and read back as views of the received bytes,
without a copy.

A payload: ``[n, head bytes, n buffer sizes]`` (little-endian uint64), the pickle, then the n buffers.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

ALIGN = 64
"""Each buffer starts at a multiple of this many bytes from the payload's start (torch's CPU allocator aligns the
payload itself so), so that the tensors viewing it are as aligned as freshly allocated ones."""


def _tensor(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``data``'s bytes (a view when they can be written)."""
    if not data.flags.writeable:
        data = data.copy()
    return torch.from_numpy(data).view(getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles a plain CPU tensor as its bytes (an out-of-band numpy buffer), its dtype and its shape; everything
    else as pickle does (numpy arrays are out-of-band buffers of their own)."""

    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
                and not obj.requires_grad and not obj.is_quantized):
            values = obj.resolve_conj().resolve_neg().contiguous()
            return _tensor, (values.reshape(-1).view(torch.uint8).numpy(), str(values.dtype).removeprefix("torch."),
                             tuple(values.shape))
        return NotImplemented


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def dumps(value: Any, persistent_id: Callable[[Any], Any] | None = None) -> torch.Tensor:
    """``value`` as a uint8 CPU tensor for :func:`loads`; ``persistent_id`` as pickle's (objects that do not
    travel, named by what it returns)."""
    head = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    pickler = _Pickler(head, protocol=5, buffer_callback=buffers.append)
    if persistent_id is not None:
        pickler.persistent_id = persistent_id  # type: ignore[method-assign]
    pickler.dump(value)
    raws = [buffer.raw() for buffer in buffers]
    pickled = head.getbuffer()
    index = np.array([len(raws), pickled.nbytes, *(raw.nbytes for raw in raws)], dtype="<u8")
    offsets, end = [], index.nbytes + pickled.nbytes
    for raw in raws:
        start = _aligned(end)
        offsets.append(start)
        end = start + raw.nbytes
    payload = torch.empty(end, dtype=torch.uint8)
    out = payload.numpy()
    out[:index.nbytes] = index.view(np.uint8)
    out[index.nbytes:index.nbytes + pickled.nbytes] = np.frombuffer(pickled, dtype=np.uint8)
    for start, raw in zip(offsets, raws):
        out[start:start + raw.nbytes] = np.frombuffer(raw, dtype=np.uint8)
    return payload


def loads(payload: torch.Tensor, persistent_load: Callable[[Any], Any] | None = None) -> Any:
    """The value :func:`dumps` made ``payload`` of (a uint8 CPU tensor); its tensors and arrays view ``payload``'s
    memory, so any of them keeps all of it alive (the messages here are a step's trajectories, kept and dropped
    together). ``persistent_load`` as pickle's. A payload cut short or not made by :func:`dumps` raises
    ValueError."""
    data = payload.numpy()
    if data.dtype != np.uint8 or data.ndim != 1 or data.nbytes < 16:
        raise ValueError(f"not a payload of turnrl.training.wire.dumps: {data.nbytes} bytes of {data.dtype}")
    count, pickled_size = (int(x) for x in np.frombuffer(data[:16], dtype="<u8"))
    index_size = 8 * (2 + count)
    if data.nbytes < index_size:
        raise ValueError(f"a payload of {data.nbytes} bytes cannot hold the index of {count} buffers: cut short?")
    sizes = [int(x) for x in np.frombuffer(data[16:index_size], dtype="<u8")]
    views, end = [], index_size + pickled_size
    for size in sizes:
        start = _aligned(end)
        end = start + size
        views.append(data[start:end])
    if end > data.nbytes:
        raise ValueError(f"a payload of {data.nbytes} bytes whose index says {end}: cut short")
    unpickler = pickle.Unpickler(io.BytesIO(data[index_size:index_size + pickled_size].tobytes()), buffers=views)
    if persistent_load is not None:
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
    return unpickler.load()
