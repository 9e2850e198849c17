"""Device and dtype resolution of ``model.device`` and ``model.dtype``."""

import pytest
import torch

from turnrl.config import ConfigError
from turnrl.models.devices import indexed, resolve_device, resolve_dtype


def test_auto_takes_the_gpu_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_a_gpu_the_process_cannot_see_is_one_line_naming_the_setting(monkeypatch):
    """torch takes ``cuda`` on a machine without a GPU and fails at the first tensor moved, with a traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"model.device='cuda', but this process sees no GPU .* use model.device=auto"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"model.device='cuda:2', but this process sees 2 GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_dtype_is_bf16_on_a_gpu_and_float32_elsewhere():
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(KeyError):
        resolve_dtype("int8", torch.device("cpu"))


def test_host_values_reach_the_device_as_they_are():
    import numpy as np

    from turnrl.models.devices import to_device

    index = torch.tensor([3, 0, 2])
    assert torch.equal(to_device(index, torch.device("cpu")), index)
    assert torch.equal(to_device(np.array([1, 2]), torch.device("cpu")), torch.tensor([1, 2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_copy_to_the_gpu_queued_behind_work_reads_the_host_values():
    # Pinned and not waited for: the values must still be the host's when the copy finally runs.
    from turnrl.models.devices import to_device

    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # work queued ahead of the copy
        busy = busy @ busy / 64
    index = torch.arange(1000)
    copied = to_device(index, device)
    assert torch.equal(copied.cpu(), torch.arange(1000))
    selected = torch.arange(1000, device=device) * 2
    assert torch.equal(selected[to_device(torch.tensor([5, 1]), device)].cpu(), torch.tensor([10, 2]))


def test_host_parts_are_joined_on_the_device_as_torch_cat_joins_them():
    from turnrl.models.devices import cat_to_device

    parts = [torch.randn(3, 5), torch.randn(0, 5), torch.randn(7, 5)]
    assert torch.equal(cat_to_device(parts, torch.device("cpu")), torch.cat(parts))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_parts_joined_in_pinned_memory_reach_a_busy_gpu_intact():
    # The joined copy is not waited for; the caching host allocator keeps its pinned block until the copy has run.
    from turnrl.models.devices import cat_to_device

    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):
        busy = busy @ busy / 64
    parts = [torch.randn(1000, 64), torch.randn(24, 64)]
    joined = cat_to_device(parts, device)
    for _ in range(3):  # later joins may reuse pinned memory only once the first copy is done
        cat_to_device([torch.zeros(1024, 64)], device)
    assert torch.equal(joined.cpu(), torch.cat(parts))


def test_a_bare_cuda_device_gets_the_current_gpu_s_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)  # an index given stays
    assert indexed(torch.device("cpu")) == torch.device("cpu")
