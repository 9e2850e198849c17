"""Device and dtype resolution of ``model.device`` and ``model.dtype``."""

import pytest
import torch

from turnrl.models.devices import resolve_device, resolve_dtype


def test_auto_takes_the_gpu_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_auto_dtype_is_bf16_on_a_gpu_and_float32_elsewhere():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(KeyError):
        resolve_dtype("int8", torch.device("cpu"))
