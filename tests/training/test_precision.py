"""How training computes: autocast only where the dtype asks, without a cache of weight casts."""

import torch

from turnrl.training.precision import autocast, skip_cudnn_attention


def test_autocast_is_off_for_float32_and_keeps_no_weight_casts_otherwise():
    cpu = torch.device("cpu")
    with autocast(cpu, torch.float32):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(cpu, torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert not torch.is_autocast_cache_enabled()


def test_cudnn_attention_is_left_alone_off_a_gpu():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    skip_cudnn_attention(torch.device("cpu"))
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
