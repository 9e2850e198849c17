"""The SwiGLU product and down projection in one Triton kernel against torch's (on a GPU, else Triton's interpreter
on a CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turnrl.engine.attention import triton_available
from turnrl.engine.silu_down import MAX_ROWS, silu_down

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


BF16_ON_CPU = pytest.mark.skipif(DEVICE.type == "cpu", reason="Triton's interpreter (Triton 3.8) multiplies bf16 "
                                 "tiles into garbage (tl.dot); the GPU runs this case")


def plain(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float32 rounded once to the weight's dtype (as the compiled path rounds it), then the
    projection in float64."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    product = (F.silu(gate) * up).to(down.dtype)
    return product.double() @ down.double().T


@pytest.mark.parametrize(("rows", "hidden", "inner", "split", "block_n"), [
    (1, 64, 96, 1, 32), (5, 96, 160, 2, 32), (7, 64, 200, 3, 16), (MAX_ROWS, 48, 128, 4, 32), (3, 32, 64, None, 16),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_ON_CPU)],
                         ids=["float32", "float16", "bf16"])
def test_the_kernel_equals_silu_then_the_projection(rows, hidden, inner, split, block_n, dtype):
    """Hidden sizes that end in part of a tile, inner sizes in part of a block, stretches of unequal length; the
    counters are zero after each call, and a second call gives the same bits (the stretches are added in order)."""
    generator = torch.Generator().manual_seed(rows + hidden)
    gate_up = torch.randn(rows, 2 * inner, generator=generator).to(DEVICE, dtype)
    down = (torch.randn(hidden, inner, generator=generator) / inner**0.5).to(DEVICE, dtype)
    arrivals = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    out = silu_down(gate_up, down, arrivals, split=split, block_n=block_n, block_k=32)
    assert out.shape == (rows, hidden) and out.dtype == dtype
    assert not arrivals.any()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # float16's and bf16's own rounding of the output (the reference stays in float64).
    torch.testing.assert_close(out.cpu().double(), plain(gate_up.cpu(), down.cpu()), **tolerance)
    again = silu_down(gate_up, down, arrivals, split=split, block_n=block_n, block_k=32)
    assert torch.equal(again, out) and not arrivals.any()


def test_a_view_of_wider_rows_is_read_in_place():
    """The decode step hands the gate and up rows as a view (b, 2I) of its (b, 1, 2I) projection."""
    gate_up = torch.randn(4, 1, 128).to(DEVICE)
    down = torch.randn(32, 64).to(DEVICE)
    arrivals = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    out = silu_down(gate_up.view(4, 128), down, arrivals, split=2, block_n=16, block_k=32)
    torch.testing.assert_close(out.cpu().double(), plain(gate_up.view(4, 128).cpu(), down.cpu()), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize(("gate_up", "down", "arrivals", "message"), [
    ((4, 100), (32, 64), 8, "width 100 do not match a down projection of 64 inputs"),
    ((MAX_ROWS + 1, 128), (32, 64), 8, f"at most {MAX_ROWS} rows, not {MAX_ROWS + 1}"),
    ((4, 128), (64, 64), 1, "arrivals must be at least 4 int32 counters, not 1"),
])
def test_bad_shapes_are_refused_before_the_launch(gate_up, down, arrivals, message):
    with pytest.raises(ValueError, match=message):
        silu_down(torch.zeros(gate_up, device=DEVICE), torch.zeros(down, device=DEVICE),
                  torch.zeros(arrivals, dtype=torch.int32, device=DEVICE), split=2, block_n=16, block_k=32)
