"""The packed-attention benchmark's packs and passes: every variant attends each sequence as it is alone."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn.attention import SDPBackend

import benchmarks.packed_attention as bench


def test_packs_hold_the_lengths_in_order_up_to_the_pack_size():
    assert bench.packs_of([70, 90, 50, 100, 300], 200) == [[70, 90], [50, 100], [300]]
    assert bench.causal_flops([2], heads=1, dim=1) == 4 * 3


def test_every_variant_gives_each_sequences_attention_and_gradient(monkeypatch):
    """On a CPU, SDPA's math kernel stands in for each variant's GPU kernel: the padded and in-place variants
    then differ from the exact one only in what they read past each sequence, which must change nothing."""
    monkeypatch.setattr(bench, "BACKENDS", {name: SDPBackend.MATH for name in bench.BACKENDS})
    torch.manual_seed(0)
    packs = bench.inputs(bench.packs_of([70, 90, 50, 100], 200), heads=4, kv_heads=2, dim=16,
                         device=torch.device("cpu"))
    packs = [tuple(x.detach().float().requires_grad_() for x in pack[:3]) + (pack[3],) for pack in packs]
    results = {}
    for backend in bench.BACKENDS:
        for pack in packs:
            for x in pack[:3]:
                x.grad = None
        outs = bench.one_pass(packs, backend, bucket=32, backward=True)
        results[backend] = (outs, [pack[1].grad.clone() for pack in packs])
    for backend, (outs, key_grads) in results.items():
        for out, expected in zip(outs, results["flash"][0]):
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=backend)
        for grad, expected in zip(key_grads, results["flash"][1]):
            torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5, msg=backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_the_benchmark_says_it_needs_one(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["packed_attention.py"])
    with pytest.raises(SystemExit, match="CUDA GPU"):
        bench.main()
