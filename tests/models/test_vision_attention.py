"""The vision towers' chunked attention: one SDPA call a layer gives transformers' attention chunk by chunk."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AttentionInterface,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from tests.engine.test_qwen2_vl import qwen2_vl_config
from tests.engine.test_qwen3_vl import qwen3_vl_config
from turnrl.models import vlm_config
from turnrl.models.loading import load_model, prepare_vision_tower, vision_tower
from turnrl.models.vision_attention import VISION_ATTENTION, chunk_extremes, chunk_layout, chunked_attention


def per_chunk(query, key, value, bounds):
    """The plain reference: SDPA over each chunk on its own. Shapes as :func:`chunked_attention`'s."""
    parts = [torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b])
             for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    return torch.cat(parts, dim=2).transpose(1, 2)


@pytest.mark.parametrize("lengths", [[3, 7, 1, 5], [4], [4, 4, 4], [2, 0, 6]])
def test_one_call_over_padded_chunks_equals_attention_chunk_by_chunk_forward_and_backward(lengths):
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    tokens = int(bounds[-1])
    generator = torch.Generator().manual_seed(0)
    states = [torch.randn(1, 3, tokens, 8, generator=generator, requires_grad=True) for _ in range(3)]
    expected = per_chunk(*states, bounds)
    gradient = torch.randn(expected.shape, generator=generator)
    expected_grads = torch.autograd.grad(expected, states, gradient)
    got, weights = chunked_attention(torch.nn.Module(), *states, None, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
    assert weights is None and got.shape == (1, tokens, 3, 8)
    torch.testing.assert_close(got, expected)
    for mine, reference in zip(torch.autograd.grad(got, states, gradient), expected_grads):
        torch.testing.assert_close(mine, reference)


def test_the_layout_places_each_token_in_its_chunks_row_and_marks_the_real_keys():
    slots, real = chunk_layout(torch.tensor([0, 2, 5, 6]), 6, 3)
    assert slots.tolist() == [0, 1, 3, 4, 5, 6]  # chunks padded to 3: rows 0-2, 3-5, 6-8
    assert real.tolist() == [[True, True, False], [True, True, True], [True, False, False]]


def test_causal_or_masked_calls_are_refused():
    states = [torch.randn(1, 2, 4, 8) for _ in range(3)]
    bounds = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="non-causal"):
        chunked_attention(torch.nn.Module(), *states, None, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, is_causal=True)
    with pytest.raises(ValueError, match="non-causal"):
        chunked_attention(torch.nn.Module(), *states, None, cu_seq_lens_q=bounds, cu_seq_lens_k=torch.tensor([0, 1, 4]))


def models(tokenizer):
    torch.manual_seed(0)
    return {
        "qwen2_5_vl (windows)": Qwen2_5_VLForConditionalGeneration(vlm_config("vlm-tiny", tokenizer)),
        "qwen2_vl": Qwen2VLForConditionalGeneration(qwen2_vl_config(tokenizer)),
        "qwen3_vl": Qwen3VLForConditionalGeneration(qwen3_vl_config(tokenizer)),
    }


def images(vision_config, grids):
    """Random patches for images of ``grids`` (t, h, w patches each): the vision tower's inputs."""
    patch = vision_config.patch_size
    width = vision_config.in_channels * vision_config.temporal_patch_size * patch * patch
    grid = torch.tensor(grids)
    return torch.randn(int(grid.prod(-1).sum()), width, generator=torch.Generator().manual_seed(1)), grid


def test_vision_towers_give_transformers_features_with_one_attention_call_a_layer(tiny_tokenizer):
    for name, model in models(tiny_tokenizer).items():
        model.eval()
        tower = vision_tower(model)
        assert tower is not None
        # Two images; the larger one holds 2 x 3 Qwen2.5-VL windows of 8 x 8 patches.
        pixels, grids = images(model.config.vision_config, [[1, 16, 24], [1, 8, 8]])
        with torch.no_grad():
            plain = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        prepare_vision_tower(model)
        assert tower.config._attn_implementation == VISION_ATTENTION, name
        calls: list[int] = []

        def counted(*args, calls=calls, **kwargs):
            calls.append(kwargs["cu_seq_lens_q"].numel() - 1)
            return chunked_attention(*args, **kwargs)

        AttentionInterface.register(VISION_ATTENTION, counted)
        try:
            with torch.no_grad():
                chunked = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        finally:
            AttentionInterface.register(VISION_ATTENTION, chunked_attention)
        for mine, reference in zip(chunked, plain):
            torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)
        assert len(calls) == model.config.vision_config.depth, name  # one call a layer, not one a chunk
        assert max(calls) >= 2, name


def test_a_bounds_tensor_is_read_to_the_host_once_until_it_changes(monkeypatch):
    """Every block of a kind gets the same bounds tensor: its lengths are read once (a read waits for the device),
    and read again only for another tensor or after an in-place change."""
    reads: list[int] = []
    aminmax = torch.aminmax

    def counted(lengths):
        reads.append(len(lengths))
        return aminmax(lengths)

    monkeypatch.setattr(torch, "aminmax", counted)
    windows, images = torch.tensor([0, 4, 8, 10], dtype=torch.int32), torch.tensor([0, 10])
    for _ in range(3):
        assert chunk_extremes(windows) == (2, 4) and chunk_extremes(images) == (10, 10)
    assert reads == [3, 1]
    windows[3] = 16  # the same tensor, changed in place
    assert chunk_extremes(windows) == (4, 8) and reads == [3, 1, 3]
    assert chunk_extremes(windows.clone()) == (4, 8) and len(reads) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("lengths", [[64] * 20, [64, 40, 64, 7]])
def test_a_tower_call_on_a_gpu_runs_no_cudnn_kernel_and_equals_attention_chunk_by_chunk(lengths):
    """cuDNN plans each new shape on the host, and a tower's shapes change with its images: its calls keep off it,
    whatever the process's own settings (here cuDNN attention is allowed and would be SDPA's first choice)."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    generator = torch.Generator(device="cuda").manual_seed(0)
    states = [torch.randn(1, 16, int(bounds[-1]), 80, generator=generator, device="cuda", dtype=torch.bfloat16)
              for _ in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        got, _ = chunked_attention(torch.nn.Module(), *states, None, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
        torch.cuda.synchronize()
    kernels = [event.name for event in trace.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and not [name for name in kernels if "cudnn" in name.lower()], kernels
    torch.testing.assert_close(got.float(), per_chunk(*(s.float() for s in states), bounds.long()), atol=2e-2, rtol=0)


def test_the_loader_puts_a_vlm_tower_on_chunked_attention_and_keeps_other_choices(tiny_vlm_dir, tiny_model_dir):
    assert vision_tower(load_model(tiny_vlm_dir)).config._attn_implementation == VISION_ATTENTION
    assert vision_tower(load_model(tiny_vlm_dir, device="meta")).config._attn_implementation == VISION_ATTENTION
    assert vision_tower(load_model(tiny_vlm_dir, attention="eager")).config._attn_implementation == "eager"
    load_model(tiny_model_dir)  # a text model: nothing to change


def test_a_loaded_tower_runs_under_inference_mode_as_under_no_grad(tiny_vlm_dir):
    """Serving code runs models under ``torch.inference_mode``, whose tensors have no version counter: their chunk
    bounds are read each time, not kept, and the features are no_grad's."""
    model = load_model(tiny_vlm_dir).eval()
    pixels, grids = images(model.config.vision_config, [[1, 8, 8], [1, 4, 12]])
    with torch.no_grad():
        expected = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
    for _ in range(2):  # the second pass meets bounds the first made under inference mode
        with torch.inference_mode():
            served = model.model.get_image_features(pixels, grids, return_dict=True).pooler_output
        for a, b in zip(served, expected):
            torch.testing.assert_close(a, b)
