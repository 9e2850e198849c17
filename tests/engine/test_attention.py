"""The Triton attention kernel against a plain loop of softmax attention (on a GPU, else Triton's interpreter on a
CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.paging import paged
from turnrl.engine.attention import cached_attention, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

CAPACITY = 128
PAGE = 64

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the kernel runs: a GPU, else Triton's interpreter on CPU tensors."""


def attend(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor | None, positions: torch.Tensor,
           **settings) -> torch.Tensor:
    """:func:`cached_attention` on :data:`DEVICE` over ``kv``'s rows in shuffled pages, its output back on the CPU
    (where the reference runs)."""
    rows = rows.to(DEVICE) if rows is not None else None
    pages, table = paged(kv.to(DEVICE), PAGE)
    out = cached_attention(q.to(DEVICE), pages, table, rows, positions.to(DEVICE), CAPACITY, **settings)
    return out.cpu()


def reference(q: torch.Tensor, kv: torch.Tensor, rows: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v over each query's keys 0 .. position, one query and head at a time, float64."""
    b, heads, t, head_dim = q.shape
    n_rep = heads // kv.shape[2]
    out = torch.zeros(b, t, heads, head_dim, dtype=torch.float64)
    for i in range(b):
        row = i if rows is None else int(rows[i])
        for j in range(t):
            position = int(positions[i, j])
            position = 0 if position >= CAPACITY else position
            for h in range(heads):
                keys = kv[0, row, h // n_rep, : position + 1].double()
                values = kv[1, row, h // n_rep, : position + 1].double()
                scores = keys @ q[i, h, j].double() * head_dim**-0.5
                out[i, j, h] = torch.softmax(scores, 0) @ values
    return out.reshape(b, t, heads * head_dim)


def cache(rows: int, kv_heads: int, head_dim: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, rows, kv_heads, CAPACITY + 1, head_dim, generator=generator).to(dtype)


def queries(b: int, heads: int, t: int, head_dim: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    """Shape (b, Hq, t, D) as the engine's queries are: a transposed view of (b, t, Hq, D)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, heads, head_dim, generator=generator).to(dtype).transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (14, 2, 64), (6, 6, 24), (8, 1, 128)])
def test_prefill_extending_cached_rows_equals_plain_attention(heads, kv_heads, head_dim):
    """Three sequences on rows 4, 0, 2: one fresh, two extending cached tokens, one right-padded."""
    kv = cache(6, kv_heads, head_dim)
    q = queries(3, heads, 5, head_dim)
    rows = torch.tensor([4, 0, 2])
    positions = torch.tensor([0, 70, 3])[:, None] + torch.arange(5)[None]
    positions[2, 3:] = positions[2, 2]  # padding repeats the sequence's last position
    out = attend(q, kv, rows, positions)
    assert out.shape == (3, 5, heads * head_dim)
    torch.testing.assert_close(out.double(), reference(q, kv, rows, positions), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("settings", [{}, dict(block_n=32, num_stages=3), dict(block_m=128, block_n=16)],
                         ids=["defaults", "gpu-prefill-defaults", "tall-query-blocks"])
def test_a_long_prefill_spans_several_query_and_key_blocks(settings):
    kv = cache(2, 2, 32)
    q = queries(2, 4, 100, 32)
    positions = torch.arange(100)[None].repeat(2, 1) + torch.tensor([[0], [20]])
    out = attend(q, kv, None, positions, **settings)
    torch.testing.assert_close(out.double(), reference(q, kv, None, positions), atol=2e-5, rtol=1e-5)


def test_decode_rows_at_the_scratch_position_attend_to_the_first_key_alone():
    kv = cache(4, 2, 64)
    q = queries(4, 14, 1, 64)
    positions = torch.tensor([[5], [CAPACITY], [100], [0]])
    out = attend(q, kv, None, positions)
    torch.testing.assert_close(out.double(), reference(q, kv, None, positions), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].view(14, 64), kv[1, 1, :, 0].repeat_interleave(7, dim=0))


def test_nothing_past_a_sequence_is_read():
    """Every cache position past what the call attends to is NaN: the outputs stay finite and equal."""
    kv = cache(5, 2, 32)
    rows = torch.tensor([3, 1])
    positions = torch.tensor([[40, 41, 42], [7, 8, 8]])
    poisoned = kv.clone()
    for row, last in ((3, 42), (1, 8)):
        poisoned[:, row, :, last + 1 :] = float("nan")
    for row in (0, 2, 4):
        poisoned[:, row] = float("nan")
    q = queries(2, 4, 3, 32)
    out = attend(q, poisoned, rows, positions)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, attend(q, kv, rows, positions))


def test_half_precision_inputs_give_half_precision_outputs_close_to_float64():
    kv = cache(3, 2, 64, torch.float16)
    q = queries(3, 14, 2, 64, torch.float16)
    positions = torch.tensor([[10, 11], [60, 61], [0, 1]])
    out = attend(q, kv, None, positions)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), reference(q, kv, None, positions), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("split", [1, 2, 3, 8])
def test_decode_split_into_key_stretches_equals_plain_attention(split):
    """Rows of very different lengths (one shorter than a block per stretch) and a scratch row, over rows 0..b-1."""
    kv = cache(5, 2, 64)
    q = queries(5, 14, 1, 64)
    positions = torch.tensor([[0], [3], [CAPACITY], [127], [64]])
    out = attend(q, kv, None, positions, split=split)
    torch.testing.assert_close(out.double(), reference(q, kv, None, positions), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [2, 3, 8])
def test_decode_stretches_combined_in_their_own_kernel_equal_the_combining_kernel(split):
    """With counters given, the last stretch of each row and key/value head combines them all: the output of the
    second kernel, to float32 rounding, on the same rows as above; every counter is back at zero after each call,
    so a second call with the same counters gives the same output."""
    kv = cache(5, 2, 64)
    q = queries(5, 14, 1, 64)
    positions = torch.tensor([[0], [3], [CAPACITY], [127], [64]])
    arrivals = torch.zeros(5 * 2, dtype=torch.int32, device=DEVICE)
    separate = attend(q, kv, None, positions, split=split)
    combined = attend(q, kv, None, positions, split=split, arrivals=arrivals)
    assert not arrivals.any()
    torch.testing.assert_close(combined, separate, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(combined.double(), reference(q, kv, None, positions), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(attend(q, kv, None, positions, split=split, arrivals=arrivals), combined, atol=0, rtol=0)
    assert not arrivals.any()


def test_too_few_counters_for_the_stretches_are_refused():
    with pytest.raises(ValueError, match="arrivals must be at least 10 int32 counters"):
        attend(queries(5, 14, 1, 64), cache(5, 2, 64), None, torch.tensor([[1]] * 5), split=2,
               arrivals=torch.zeros(9, dtype=torch.int32, device=DEVICE))


def test_a_key_block_that_would_cross_a_page_is_refused():
    pages, table = paged(cache(1, 2, 32), 32)
    with pytest.raises(ValueError, match="key blocks of 64 cross pages of 32 positions"):
        cached_attention(queries(1, 4, 1, 32), pages, table, None, torch.tensor([[3]]), CAPACITY, block_n=64)
