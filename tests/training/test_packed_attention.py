"""The trainer's packed attention on cuDNN's path: each sequence at a bucketed length, read in place from its
row, against each sequence attended alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from transformers import AutoModelForCausalLM

from tests.training.test_packing import padded_batch
from turnrl.config import ConfigError, ModelConfig
from turnrl.training.model_passes import token_logprobs
from turnrl.training.packed_attention import (
    ATTENTION,
    CUDNN_ATTENTION,
    CUDNN_BACKENDS,
    CUDNN_BUCKET,
    bucketed,
    implementation,
    packed_kernel,
    packed_sdpa,
    packs,
    run_attention,
)

HEADS, KV_HEADS, DIM = 4, 2, 8


class Attention(torch.nn.Module):
    """What transformers' SDPA reads of an attention module: causal, its query heads a key/value head."""

    is_causal = True

    def __init__(self, groups: int = HEADS // KV_HEADS):
        super().__init__()
        self.num_key_value_groups = groups


def projections(t: int, dtype=torch.float64, seed=0, heads=HEADS, kv_heads=KV_HEADS, dim=DIM
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed row's queries, keys and values as a decoder's projections leave them: (1, t, heads, d) viewed as
    (1, heads, t, d)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, t, n, dim, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
                 for n in (heads, kv_heads, kv_heads))


def alone(q, k, v, bounds):
    """Each sequence attended on its own, causally, by SDPA's plain (math) kernel; Shape (1, t, heads, d)."""
    parts = []
    for start, end in bounds:
        parts.append(F.scaled_dot_product_attention(
            q[:, :, start:end], k[:, :, start:end].repeat_interleave(HEADS // KV_HEADS, 1),
            v[:, :, start:end].repeat_interleave(HEADS // KV_HEADS, 1), is_causal=True))
    return torch.cat(parts, dim=2).transpose(1, 2)


def test_bucketed_reads_the_rows_next_tokens_in_place_and_pads_only_at_the_rows_end():
    q = projections(300)[0]
    inside = bucketed(q, 10, 110)  # 100 tokens -> 128, all inside the row
    assert inside.shape == (1, HEADS, 128, DIM)
    assert inside.data_ptr() == q[:, :, 10].data_ptr()  # a view: nothing copied
    assert torch.equal(inside, q[:, :, 10:138])
    tail = bucketed(q, 200, 300)  # 100 tokens -> 128, past the row's end
    assert tail.shape == (1, HEADS, 128, DIM)
    assert torch.equal(tail[:, :, :100], q[:, :, 200:300]) and not tail[:, :, 100:].any()
    exact = bucketed(q, 0, CUDNN_BUCKET)
    assert exact.shape[2] == CUDNN_BUCKET


def test_bucketed_lays_out_every_sequence_alike_whatever_the_rows_length_and_its_start():
    """cuDNN plans each layout apart: a view of a longer row, at another start, or a padded copy all have the
    strides of one layout, so a run plans one shape per bucket."""
    layouts = {bucketed(projections(t)[0], start, start + 100).stride()
               for t, start in ((300, 0), (300, 57), (1000, 400), (150, 50))}
    heads_outer = projections(300)[0].contiguous()  # its head stride is the row's length: copied
    copied = bucketed(heads_outer, 57, 157)
    layouts.add(copied.stride())
    assert len(layouts) == 1
    assert torch.equal(copied[:, :, :100], heads_outer[:, :, 57:157]) and not copied[:, :, 100:].any()


@pytest.mark.parametrize("lengths", [(100, 200, 60), (128, 1, 255), (300,)])
def test_bucketed_attention_and_its_gradients_equal_each_sequence_alone(lengths):
    """The in-place reads and the end's padding change nothing a sequence computes, nor any gradient: the
    tokens after a sequence feed only queries whose outputs are dropped."""
    t = sum(lengths)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    bounds = [(end - n, end) for n, end in zip(lengths, ends)]
    inputs = projections(t)
    weights = torch.randn(1, t, HEADS, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for attend in (lambda q, k, v: alone(q, k, v, bounds),
                   lambda q, k, v: packed_sdpa(Attention(), q, k, v, None, sequence_bounds=bounds,
                                               backends=(SDPBackend.MATH,))[0]):
        for x in inputs:
            x.grad = None
        out = attend(*inputs)
        (out * weights).sum().backward()
        results.append((out.detach(), [x.grad.clone() for x in inputs]))
    (expected, expected_grads), (got, grads) = results
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    for name, grad, expected_grad in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=1e-12, msg=name)


def test_a_model_on_the_cudnn_attention_scores_packed_rows_as_the_flash_one(tiny_model_dir):
    """The whole path in a model (on a CPU cuDNN refuses the shapes and SDPA's CPU flash kernel takes them):
    packed rows at bucketed lengths score and train as the trainer's attention does at their own lengths."""
    results = []
    for name in (ATTENTION, CUDNN_ATTENTION):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=name)
        assert packs(model.config)
        logprobs, entropy = token_logprobs(model, *padded_batch(model.config.vocab_size, lengths=(140, 5, 9, 300)),
                                           with_entropy=True, packed=True)
        (logprobs.sum() + 0.3 * entropy.sum()).backward()
        results.append((logprobs.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (flash, flash_grads), (cudnn, cudnn_grads) = results
    torch.testing.assert_close(cudnn, flash, atol=1e-5, rtol=1e-5)
    for name, grad in flash_grads.items():
        torch.testing.assert_close(cudnn_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_unpacked_rows_on_the_cudnn_attention_attend_as_plain_sdpa(tiny_model_dir):
    """Without sequence bounds (rows padded, a mask) the cuDNN name is transformers' sdpa, mask and all."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation=CUDNN_ATTENTION)
    inputs = padded_batch(model.config.vocab_size, seed=5)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, *inputs)[0], token_logprobs(plain, *inputs)[0])


def test_the_model_setting_names_the_attention_a_run_loads():
    cpu = torch.device("cpu")
    assert implementation("sdpa", packed_kernel("auto", cpu)) == ATTENTION
    assert implementation("sdpa", packed_kernel("flash", cpu)) == ATTENTION
    assert implementation("sdpa", "cudnn") == CUDNN_ATTENTION
    assert implementation("eager", "cudnn") == "eager"
    assert run_attention(ModelConfig(), cpu) == ATTENTION
    assert run_attention(ModelConfig(attention="eager"), cpu) == "eager"
    with pytest.raises(ValueError, match="model.packed_attention=auto or flash"):
        packed_kernel("cudnn", cpu)
    with pytest.raises(ConfigError, match="model.packed_attention"):
        ModelConfig(packed_attention="triton").validate()
    assert CUDNN_BACKENDS[0] is SDPBackend.CUDNN_ATTENTION


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cudnn_attention_on_a_gpu_equals_flash_at_bf16_rounding():
    """On a GPU: cuDNN's kernel alone at bucketed lengths against flash's at the sequences' own, bf16, at the
    3B decoder's heads."""
    device = torch.device("cuda")
    lengths = (300, 1000, 700)
    t = sum(lengths)
    ends = torch.tensor(lengths).cumsum(0).tolist()
    bounds = [(end - n, end) for n, end in zip(lengths, ends)]
    inputs = [x.detach().to(device, torch.bfloat16).requires_grad_()
              for x in projections(t, torch.float32, heads=16, kv_heads=2, dim=128)]
    results = []
    for backends in ((), (SDPBackend.CUDNN_ATTENTION,)):
        for x in inputs:
            x.grad = None
        out = packed_sdpa(Attention(groups=8), *inputs, None, sequence_bounds=bounds, backends=backends)[0]
        out.float().square().sum().backward()
        results.append((out.detach().float(), [x.grad.float() for x in inputs]))
    (flash, flash_grads), (cudnn, cudnn_grads) = results
    assert relative_error(cudnn, flash) < 1e-2
    for grad, expected in zip(cudnn_grads, flash_grads):
        assert torch.isfinite(grad).all() and relative_error(grad, expected) < 2e-2


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()
