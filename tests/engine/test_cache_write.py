"""The rotary-and-cache-write kernel against the compiled path's torch definition (Triton's interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.paging import paged, unpaged
from turnrl.engine.attention import cached_attention, rotate_write_attend, triton_available
from turnrl.engine.cache_write import rotate_and_write
from turnrl.engine.forward import attention_inputs, qkv_projection
from turnrl.engine.weights import DecoderShape

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Where the kernel runs: a GPU, else Triton's interpreter on CPU tensors."""

HALF = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
"""The engine's half precision: bf16 on a GPU. Triton's interpreter (3.8) multiplies bf16 tiles into garbage (its
``tl.dot``; two such outputs would still compare equal), so on a CPU the same cases run in float16."""


def reference(x, rope, positions, write_pos, rows, kv, weights, shape):
    """:func:`attention_inputs` and the indexed cache write of :func:`~turnrl.engine.forward.decoder_forward`."""
    b, t, _ = x.shape
    q, new_kv = attention_inputs(x, positions, *rope, weights["norm"], [weights["qkv"]], [weights["bias"]], None,
                                 None, shape)
    write_rows = (torch.arange(b, device=DEVICE) if rows is None else rows).unsqueeze(1).expand(b, t)
    kv[:, write_rows, :, write_pos] = new_kv
    return q


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 4, 16), (8, 2, 128)])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("indexed_rows", [False, True])
def test_rotated_queries_and_cache_equal_the_torch_path(heads, kv_heads, head_dim, t, indexed_rows):
    torch.manual_seed(0)
    hidden, b, capacity, cache_rows = 48, 3, 32, 5
    shape = DecoderShape(num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=10,
                         rms_eps=1e-6)
    width = (heads + 2 * kv_heads) * head_dim
    weights = {"norm": torch.rand(hidden) + 0.5, "qkv": torch.randn(width, hidden) * 0.1, "bias": torch.randn(width)}
    angles = torch.arange(capacity + 1.0)[:, None] * torch.rand(head_dim // 2)
    rope = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    x = torch.randn(b, t, hidden)
    rows = torch.tensor([4, 0, 2]) if indexed_rows else None
    starts = torch.tensor([0, 7, 20])
    positions = starts[:, None] + torch.arange(t)
    write_pos = positions.clone()
    write_pos[2, t - 1] = capacity  # a padding token: the scratch column
    kv = torch.randn(2, cache_rows, kv_heads, capacity + 1, head_dim)
    weights = {name: value.to(DEVICE) for name, value in weights.items()}
    rope = (rope[0].to(DEVICE), rope[1].to(DEVICE))
    x, positions, write_pos, kv = x.to(DEVICE), positions.to(DEVICE), write_pos.to(DEVICE), kv.to(DEVICE)
    rows = rows.to(DEVICE) if rows is not None else None
    expected_kv = kv.clone()
    expected_q = reference(x, rope, positions, write_pos, rows, expected_kv, weights, shape)

    _, projected = qkv_projection(x, None, weights["norm"], [weights["qkv"]], [weights["bias"]], shape.rms_eps)
    pages, table = paged(kv, page=16)
    q = rotate_and_write(projected, *rope, positions, write_pos, rows, pages, table, heads)

    assert q.shape == (b, heads, t, head_dim)
    torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
    written = unpaged(pages, table)
    torch.testing.assert_close(written[..., :capacity, :], expected_kv[..., :capacity, :], atol=1e-5, rtol=1e-5)
    # The padding token's key and value went to the scratch page, not into a row.
    padding_row = 2 if rows is None else int(rows[2])
    torch.testing.assert_close(pages[:, 0, :, 0], expected_kv[:, padding_row, :, capacity], atol=1e-5, rtol=1e-5)


def test_half_precision_rounds_once_from_float32():
    """bf16 in and out: within one bf16 rounding of the float32 result (eager bf16 rounds after each operation)."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim, capacity = 2, 1, 16, 8
    projected = torch.randn(2, 1, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    angles = torch.arange(capacity + 1.0, device=DEVICE)[:, None] * torch.rand(head_dim // 2, device=DEVICE)
    rope = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    positions = torch.tensor([[3], [5]], device=DEVICE)
    exact_kv, table = paged(torch.zeros(2, 2, kv_heads, capacity + 1, head_dim, device=DEVICE), page=8)
    exact_q = rotate_and_write(projected, *rope, positions, positions, None, exact_kv, table, heads)
    half_kv = torch.zeros_like(exact_kv, dtype=torch.bfloat16)
    half_q = rotate_and_write(projected.bfloat16(), rope[0].bfloat16(), rope[1].bfloat16(), positions, positions,
                              None, half_kv, table, heads)
    assert half_q.dtype == torch.bfloat16
    torch.testing.assert_close(half_q.float(), exact_q, atol=0.03, rtol=0.02)
    torch.testing.assert_close(half_kv.float(), exact_kv, atol=0.03, rtol=0.02)


def test_a_projection_of_another_width_is_refused():
    with pytest.raises(ValueError, match="not 2 query and 1 key/value heads of 16"):
        rotate_and_write(torch.zeros(1, 1, 70), torch.zeros(4, 16), torch.zeros(4, 16), torch.zeros(1, 1).long(),
                         torch.zeros(1, 1).long(), None, torch.zeros(2, 1, 1, 4, 16), torch.zeros(1, 2).int(),
                         2)  # refused before a launch


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "split", "indexed_rows", "dtype"), [
    (14, 2, 64, 1, False, HALF), (14, 2, 64, 2, True, torch.float32), (4, 4, 16, 3, True, torch.float32),
    (8, 2, 128, 3, False, HALF),
])
def test_decode_attention_with_the_write_inside_equals_write_then_attend(heads, kv_heads, head_dim, split,
                                                                         indexed_rows, dtype):
    """Rows of different lengths (one at position 0, one past a stretch's first block) and a padding row at the
    scratch column: same output and same cache, bit for bit, as the two kernels one after the other."""
    torch.manual_seed(2)
    b, capacity, cache_rows = 4, 192, 6
    width = (heads + 2 * kv_heads) * head_dim
    angles = torch.arange(capacity + 1.0)[:, None] * torch.rand(head_dim // 2)
    rope = tuple(table.to(DEVICE, dtype) for table in (torch.cat((angles, angles), -1).cos(),
                                                       torch.cat((angles, angles), -1).sin()))
    projected = torch.randn(b, 1, width, device=DEVICE).to(dtype)
    positions = torch.tensor([[0], [70], [capacity], [191]], device=DEVICE)
    rows = torch.tensor([5, 0, 3, 1], device=DEVICE) if indexed_rows else None
    kv, table = paged(torch.randn(2, cache_rows, kv_heads, capacity + 1, head_dim, device=DEVICE).to(dtype), page=64)
    expected_kv = kv.clone()
    q = rotate_and_write(projected, *rope, positions, positions, rows, expected_kv, table, heads)
    expected = cached_attention(q, expected_kv, table, rows, positions, capacity, split=split)

    out = rotate_write_attend(projected, *rope, positions, kv, table, rows, positions, capacity, heads, split=split)

    assert out.shape == (b, 1, heads * head_dim) and out.dtype == dtype
    assert torch.equal(kv, expected_kv)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    # The stretches combined by the last of them (the engine's way), the key and value written again in place.
    arrivals = torch.zeros(b * kv_heads, dtype=torch.int32, device=DEVICE)
    combined = rotate_write_attend(projected, *rope, positions, kv, table, rows, positions, capacity, heads,
                                   split=split, arrivals=arrivals)
    assert torch.equal(kv, expected_kv) and not arrivals.any()
    torch.testing.assert_close(combined, expected, **({} if split > 1 else dict(atol=0, rtol=0)))


def test_decode_attention_with_the_write_inside_refuses_a_prefill():
    with pytest.raises(ValueError, match="one token per sequence, not 2"):
        rotate_write_attend(torch.zeros(1, 2, 64), torch.zeros(4, 16), torch.zeros(4, 16), torch.zeros(1, 2).long(),
                            torch.zeros(2, 1, 1, 4, 16), torch.zeros(1, 2).int(), None, torch.zeros(1, 2).long(), 3,
                            2)
