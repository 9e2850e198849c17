"""The decode GEMM benchmark's hand-tiled Triton GEMM computes ``F.linear`` (Triton's interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.decode_gemms import Tiling, small_batch_linear, tilings
from turnrl.engine.attention import triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter runs on a CPU)")


@pytest.mark.parametrize(("split", "with_bias"), [(1, True), (2, False), (4, True)])
def test_the_tiled_gemm_is_f_linear_whatever_the_split(split, with_bias):
    """Rows fewer than a tile, output rows not a whole number of tiles, the inner dim split into stretches whose
    float32 partial sums are added, the bias once: the product as ``F.linear`` computes it in float32. In float16:
    Triton's interpreter has no bf16 (numpy has none), which the GPU runs."""
    generator = torch.Generator().manual_seed(split)
    x = torch.randn(5, 256, generator=generator).half()
    weight = torch.randn(80, 256, generator=generator).half()
    bias = torch.randn(80, generator=generator).half() if with_bias else None
    got = small_batch_linear(x, weight, bias, Tiling(block_n=32, block_k=32, split=split, stages=3, warps=4))
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.shape == (5, 80) and got.dtype == torch.float16
    torch.testing.assert_close(got.float(), expected, rtol=2**-10, atol=2**-6)


def test_a_tiling_that_does_not_split_the_inner_dim_into_whole_blocks_is_refused():
    x, weight = torch.zeros(4, 96).half(), torch.zeros(32, 96).half()
    with pytest.raises(ValueError, match="does not tile"):
        small_batch_linear(x, weight, None, Tiling(block_n=32, block_k=64, split=1, stages=3, warps=4))


def test_only_the_narrower_projections_are_swept_with_split_k():
    assert {t.split for t in tilings(22016)} == {1}
    assert {t.split for t in tilings(2048)} == {1, 2, 4, 8}
