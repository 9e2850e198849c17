"""MFU's parts: the FLOPs a trained token costs, and the device's peak; a rollout's roofline: prefill's FLOPs,
decode's bytes, and the device's bandwidth."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3VLConfig

from turnrl.engine.timing import causal_pairs
from turnrl.models.throughput import (
    attention_flops,
    attention_shape,
    bandwidth_of,
    decode_bytes,
    key_value_bytes,
    mfu,
    peak_bandwidth,
    peak_flops,
    prefill_flops,
    roofline_share,
    training_flops,
    training_flops_per_token,
    vision_training_flops,
)


def model(tied: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config)


@pytest.mark.parametrize("tied", [True, False])
def test_a_fully_trained_model_costs_six_times_its_parameters_less_the_embedding_lookup(tied):
    m = model(tied)
    embeddings = m.get_input_embeddings().weight
    total = sum(p.numel() for p in m.parameters())  # tied weights counted once
    expected = 6 * (total if tied else total - embeddings.numel())
    assert training_flops_per_token(m, None if tied else embeddings) == expected


def test_a_frozen_base_costs_four_times_and_the_trained_part_six():
    m = model(tied=False)
    embeddings = m.get_input_embeddings().weight
    for name, parameter in m.named_parameters():
        parameter.requires_grad_("layers.1." in name)
    trained = sum(p.numel() for n, p in m.named_parameters() if "layers.1." in n)
    frozen = sum(p.numel() for n, p in m.named_parameters() if "layers.1." not in n) - embeddings.numel()
    assert training_flops_per_token(m, embeddings) == 6 * trained + 4 * frozen


def test_mfu_is_model_flops_over_time_and_peak():
    assert mfu(6e12, 2.0, 1e12, processes=2) == pytest.approx(6e12 / 2 / 2e12)
    assert mfu(6e12, 2.0, None) is None


def test_attention_flops_count_each_causal_pair_once_forward_and_twice_backward():
    layers, width, lengths = 3, 16, [1, 5, 8]
    expected = 0
    for s in lengths:  # a plain count: each query i against the keys j <= i (the diagonal halved, as s^2 / 2 is)
        for i in range(s):
            for j in range(i + 1):
                pair = 0.5 if i == j else 1.0
                forward = pair * (2 * width + 2 * width)  # a score (q . k) and a weighted value (p * v)
                expected += layers * 3 * forward  # the backward pass: twice the forward
    assert attention_flops(layers, width, torch.tensor(lengths)) == pytest.approx(expected)


def test_attention_shape_reads_text_and_vision_language_configs():
    qwen2 = Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    assert attention_shape(qwen2) == (3, 64)
    qwen3_vl = Qwen3VLConfig(text_config={"hidden_size": 64, "num_attention_heads": 8, "head_dim": 16,
                                          "num_hidden_layers": 5})
    assert attention_shape(qwen3_vl) == (5, 128)


def test_peak_is_configured_or_detected_by_name(monkeypatch):
    cpu = torch.device("cpu")
    assert peak_flops(cpu) is None and peak_flops(cpu, 500e12) == 500e12
    gpu = torch.device("cuda", 0)
    for name, expected in [("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989.4e12),
                           ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GH200 480GB", 989.4e12), ("Some GPU", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(gpu) == expected, name


def test_a_training_pass_costs_its_tokens_and_their_attention():
    config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    lengths = torch.tensor([5, 9])
    assert training_flops(1000.0, config, lengths) == pytest.approx(1000.0 * 14 + 6 * 3 * 64 * (25 + 81))


def test_a_trained_vision_towers_flops_match_a_count_of_its_forward():
    """6 x the tower's parameters a patch (its mergers' a merged token) and its non-causal attention, against
    torch's own count of one forward pass (x 3: the backward costs twice the forward), full-attention and
    windowed blocks, two image sizes."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=256, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                           window_size=56),
    )
    tower = Qwen2_5_VLForConditionalGeneration(config).model.visual.float()
    grids = torch.tensor([[1, 4, 4], [1, 8, 8]])  # 16 and 64 patches; windows of 4x4 patches
    pixels = torch.randn(80, 3 * 2 * 14 * 14)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        tower(pixels, grid_thw=grids)
    counted = vision_training_flops(tower, config.vision_config, grids)
    # attention by hand (torch counts no CPU attention kernel): every pair of an image's patches in the full
    # block, 16 a patch in the windowed one; the weights' FLOPs as torch counts them (it leaves out biases)
    width = 64
    pairs = (16**2 + 64**2) + (16 * 16 + 64 * 16)
    assert set(counter.get_flop_counts()["Global"]) == {torch.ops.aten.convolution, torch.ops.aten.addmm}
    assert counted == pytest.approx(3 * counter.get_total_flops() + 12 * width * pairs, rel=0.01)
    parameters = sum(p.numel() for n, p in tower.named_parameters() if "merger" not in n)
    merger = sum(p.numel() for n, p in tower.named_parameters() if "merger" in n)
    assert counted == pytest.approx(6 * (parameters * 80 + merger * 20) + 12 * width * pairs)
    forward = vision_training_flops(tower, config.vision_config, grids, forward_only=True)
    assert forward == pytest.approx(counter.get_total_flops() + 4 * width * pairs, rel=0.01)
    tower.requires_grad_(False)  # a frozen base (LoRA on the tower): 4 x its parameters
    frozen = vision_training_flops(tower, config.vision_config, grids)
    assert frozen == pytest.approx(4 * (parameters * 80 + merger * 20) + 12 * width * pairs)


def test_bandwidth_is_configured_or_detected_by_name(monkeypatch):
    cpu = torch.device("cpu")
    assert peak_bandwidth(cpu) is None and peak_bandwidth(cpu, 2e12) == 2e12
    for name, expected in [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
                           ("NVIDIA H100 NVL", 3.9e12), ("NVIDIA H200", 4.8e12), ("NVIDIA H200 NVL", 4.8e12),
                           ("NVIDIA GH200 480GB", 4.0e12), ("NVIDIA GH200 144G HBM3e", 4.9e12), ("NVIDIA B200", 8.0e12),
                           ("NVIDIA A100-SXM4-80GB", 2.039e12), ("NVIDIA A100 80GB PCIe", 1.935e12),
                           ("NVIDIA A100-SXM4-40GB", 1.555e12), ("NVIDIA A100-PCIE-40GB", 1.555e12),
                           ("NVIDIA L40S", 0.864e12), ("NVIDIA L4", 0.3e12), ("NVIDIA A10G", 0.6e12),
                           ("Some GPU", None)]:
        assert bandwidth_of(name) == expected, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert peak_bandwidth(torch.device("cuda", 0)) == 4.8e12


def test_prefill_flops_are_two_a_parameter_a_new_token_and_four_widths_a_causal_pair():
    """Two sequences, one with 3 tokens cached and 4 new, one with none cached and 2 new; counted pair by pair."""
    parameters, layers, width = 1000, 2, 8
    sequences = [(3, 4), (0, 2)]  # (cached, new)
    expected = 0.0
    for cached, new in sequences:
        expected += 2 * parameters * new  # a multiply and an add a parameter
        for query in range(cached, cached + new):
            for _key in range(query + 1):
                expected += layers * (2 * width + 2 * width)  # the score q . k and the weighted value p * v
    pairs = sum(causal_pairs(cached, new) for cached, new in sequences)
    assert pairs == (4 + 5 + 6 + 7) + (1 + 2)
    flops = prefill_flops(parameters, layers, width, new_tokens=6, attention_pairs=pairs)
    assert flops == expected == 2 * 1000 * 6 + 4 * 2 * 8 * 25


def test_decode_reads_the_weights_once_a_step_and_each_rows_keys_and_values():
    """Three steps of rows holding 10 and 20 tokens, then one row left: a 2-layer cache of 2 key/value heads of
    dimension 4 in bf16 (64 bytes a token)."""
    token_bytes = key_value_bytes(layers=2, key_value_heads=2, head_dim=4, element_bytes=2)
    assert token_bytes == 2 * (2 * 2 * 4) * 2  # keys and values, each layer x heads x dim x 2 bytes
    attended = [[11, 21], [12, 22], [13]]  # each row's keys up to its new token
    key_tokens = sum(sum(step) for step in attended)
    assert decode_bytes(weight_bytes=1_000_000, steps=3, token_bytes=token_bytes, key_tokens=key_tokens) == (
        3 * 1_000_000 + 64 * (32 + 34 + 13))


def test_a_rooflines_share_is_the_work_over_what_the_peak_does_in_the_time():
    assert roofline_share(2.4e12, 1.0, 4.8e12) == pytest.approx(0.5)
    assert roofline_share(1e15, 4.0, 1e15) == pytest.approx(0.25)
    assert roofline_share(1.0, 1.0, None) is None and roofline_share(1.0, 0.0, 1.0) is None
