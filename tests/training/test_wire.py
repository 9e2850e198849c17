import pickle

import numpy as np
import pytest
import torch

from turnrl.models.vision import EncodedImage, MessageImages
from turnrl.training import wire


def same(a, b) -> bool:
    """Equal values, type for type: tensors by dtype, shape and values; arrays likewise; objects by their fields."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.resolve_conj(), b.resolve_conj())
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__"):
        return same(vars(a), vars(b))
    return a == b


def values() -> dict:
    frame = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    return {
        "bf16": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "bool": torch.tensor([True, False, True]),
        "int64 scalar": torch.tensor(7),
        "empty": torch.empty(0, 5),
        "columns of a matrix": torch.arange(20.0).reshape(4, 5)[:, 1:3],
        "a view past the storage's start": torch.arange(10)[3:7],
        "conjugate": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
        "float8": torch.tensor([0.5, 1.0]).to(torch.float8_e4m3fn),
        "frame": frame,
        "fortran order": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "every other": np.arange(10)[::2],
        "objects": np.array([{"a": 1}, "b"], dtype=object),
        "images": MessageImages([1], {"pixel_values": torch.ones(4, 6, dtype=torch.bfloat16),
                                      "image_grid_thw": torch.tensor([[1, 2, 2]])}, [123]),
        "encoded": EncodedImage({"pixel_values": torch.zeros(4, 6)}, placeholder_tokens=1, digest=-5),
        "trained": torch.nn.Parameter(torch.ones(2)),
        "needs grad": torch.ones(2, requires_grad=True),
        "python": [1, 2.5, "x", None, (3, b"bytes")],
    }


def test_values_come_back_as_pickle_gives_them():
    sent = values()
    assert same(wire.loads(wire.dumps(sent)), sent)
    del sent["float8"]  # which torch's own pickling of a storage fails to load (AttributeError, torch 2.14)
    assert same(wire.loads(wire.dumps(sent)), pickle.loads(pickle.dumps(sent)))


def test_tensors_and_arrays_view_the_received_bytes_at_aligned_addresses():
    sent = {"pixels": torch.randn(256, 1176).to(torch.bfloat16), "frame": np.ones((225, 225, 3), np.uint8),
            "small": torch.arange(3)}
    payload = wire.dumps(sent)
    start, end = payload.data_ptr(), payload.data_ptr() + payload.numel()
    back = wire.loads(payload)
    for tensor in (back["pixels"], back["small"], torch.from_numpy(back["frame"])):
        assert start <= tensor.data_ptr() < end  # no copy
        assert (tensor.data_ptr() - start) % wire.ALIGN == 0
    # Each tensor's storage holds its own bytes alone: pickled again, it does not carry the payload along.
    assert back["small"].untyped_storage().nbytes() == 3 * 8
    assert len(pickle.dumps(back["small"])) < 1000
    # The pixel values are the payload's bytes: carried once, not pickled through torch.save.
    assert payload.numel() < sent["pixels"].numel() * 2 + 225 * 225 * 3 + 4096


def test_an_object_sent_twice_comes_back_once():
    tensor = torch.ones(3)
    frame = np.zeros(4, np.uint8)
    back = wire.loads(wire.dumps([tensor, tensor, frame, frame]))
    assert back[0] is back[1] and back[2] is back[3]


def test_objects_that_do_not_travel_are_named_and_replaced():
    class Local:
        pass

    local = Local()
    payload = wire.dumps({"tokenizer": local, "n": 1}, persistent_id=lambda obj: "local" if obj is local else None)
    assert wire.loads(payload, persistent_load=lambda name: f"this side's {name}") == {"tokenizer": "this side's local",
                                                                                        "n": 1}


@pytest.mark.parametrize("cut", [0, 10, 23, -1])
def test_a_payload_cut_short_is_refused(cut):
    payload = wire.dumps([torch.ones(100), np.ones(100)])
    with pytest.raises(ValueError, match="cut short|not a payload"):
        wire.loads(payload[:cut] if cut >= 0 else payload[:-1])


def test_a_payload_of_another_dtype_is_refused():
    with pytest.raises(ValueError, match="not a payload"):
        wire.loads(torch.zeros(100, dtype=torch.int32))
