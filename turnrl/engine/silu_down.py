"""A decode step's MLP output in one Triton kernel: SwiGLU's ``silu(gate) * up``, then the down projection (GPU).

At a decode step's few rows (64 in the VisGym rollout) the down projection is a weight read: 45 MB a layer at
the 3B shape against 2.8 MB of gate and up. cuBLAS splits its inner dim and adds the partial sums in a kernel of
its own, and the SwiGLU product before it is a third kernel: on an H200 the three took 14.9 + 1.9 + 2.6 us a layer
of the rollout's decode step (a profile of ``benchmarks/vlm_rollout.py``), each with its gap in the CUDA graph.
Here one kernel does all of it: each program computes ``silu(gate) * up`` for its stretch of the inner dim as it
reads it (every program of a stretch again; they are in L2) and multiplies it by its tile of the weight; the last
program of a tile to finish adds the stretches' float32 partial sums, always in the same order (so a result does
not depend on which program finished last), and writes the output.

The product is rounded to the weight's dtype before the matrix product, as the compiled path rounds it (silu and
the product in float32, rounded once). Hand-written because no library kernel fuses an elementwise prologue into
a small-batch GEMM with a deterministic split-K; Inductor's GEMM templates lost to cuBLAS at these shapes
(docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from turnrl.engine.attention import multiprocessors, triton

MAX_ROWS = 64
"""Decode batches of at most this many rows take the kernel (one tile of rows); larger ones keep cuBLAS."""

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _silu_down_kernel(
        GateUp, W, Out, Partial, Arrivals,
        rows, hidden, inner, split_blocks,
        gu_s, w_s, out_s,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """One program: every row, BLOCK_N outputs, over one stretch of ``split_blocks`` blocks of the inner dim."""
        tile = tl.program_id(0)
        split = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = m < rows
        in_cols = n < hidden
        begin = split * split_blocks * BLOCK_K
        end = tl.minimum(inner, begin + split_blocks * BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(begin, end, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            in_k = k < end
            at = GateUp + m[:, None] * gu_s + k[None, :]
            gate = tl.load(at, mask=in_rows[:, None] & in_k[None, :], other=0.0).to(tl.float32)
            up = tl.load(at + inner, mask=in_rows[:, None] & in_k[None, :], other=0.0).to(tl.float32)
            product = (gate * tl.sigmoid(gate) * up).to(W.dtype.element_ty)
            w = tl.load(W + n[:, None] * w_s + k[None, :], mask=in_cols[:, None] & in_k[None, :], other=0.0)
            acc = tl.dot(product, tl.trans(w), acc)
        out_at = Out + m[:, None] * out_s + n[None, :]
        in_out = in_rows[:, None] & in_cols[None, :]
        if SPLIT:
            stride = BLOCK_M * hidden
            tl.store(Partial + split * stride + m[:, None] * hidden + n[None, :], acc, mask=in_out)
            # Every thread's stores happen before the arrival is counted (the barrier); the count releases them
            # at the GPU's scope, so the program that counts last reads every stretch's sums.
            tl.debug_barrier()
            arrival = Arrivals + tile
            if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for other in range(0, tl.num_programs(1)):
                    total += tl.load(Partial + other * stride + m[:, None] * hidden + n[None, :], mask=in_out,
                                     other=0.0, cache_modifier=".cg")
                tl.store(out_at, total.to(Out.dtype.element_ty), mask=in_out)
                tl.atomic_xchg(arrival, 0)  # counted from 0 again by the next call
        else:
            tl.store(out_at, acc.to(Out.dtype.element_ty), mask=in_out)


def default_split(hidden: int, block_n: int, device: torch.device) -> int:
    """Stretches of the inner dim: about one program a multiprocessor, at most 8."""
    tiles = triton.cdiv(hidden, block_n)
    return max(1, min(8, round(multiprocessors(device) / tiles)))


def silu_down(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    arrivals: torch.Tensor,
    split: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, down)`` where ``gate, up = gate_up.chunk(2, -1)``.

    Args:
        gate_up: Shape (b, 2I), at most :data:`MAX_ROWS` rows, the last dim contiguous.
        down: the down projection's weight, Shape (H, I), contiguous.
        arrivals: int32 zeros, at least H / ``block_n`` of them (the engine's cache holds them); each call leaves
            them zero. Calls that share them must not run at the same time (one stream).
        split, block_n, block_k, num_warps, num_stages: the stretches of the inner dim (None:
            :func:`default_split`) and the kernel's tiles and launch settings (benchmarks sweep them).

    Returns:
        Shape (b, H), in ``down``'s dtype.
    """
    if triton is None:
        raise RuntimeError("silu_down needs Triton; install a CUDA build of torch")
    rows, width = gate_up.shape
    hidden, inner = down.shape
    if width != 2 * inner:
        raise ValueError(f"silu_down: gate and up of width {width} do not match a down projection of {inner} inputs")
    if rows > MAX_ROWS:
        raise ValueError(f"silu_down takes at most {MAX_ROWS} rows, not {rows}")
    if gate_up.stride(1) != 1 or not down.is_contiguous():
        raise ValueError("silu_down: the gate and up rows and the down weight must be contiguous")
    tiles = triton.cdiv(hidden, block_n)
    splits = split or default_split(hidden, block_n, gate_up.device)
    split_blocks = triton.cdiv(triton.cdiv(inner, block_k), splits)
    splits = triton.cdiv(triton.cdiv(inner, block_k), split_blocks)  # no stretch left empty
    if splits > 1 and (arrivals.dtype != torch.int32 or arrivals.numel() < tiles):
        raise ValueError(f"silu_down: arrivals must be at least {tiles} int32 counters, not {arrivals.numel()} of "
                         f"{arrivals.dtype}")
    block_m = max(16, triton.next_power_of_2(rows))
    out = torch.empty(rows, hidden, dtype=down.dtype, device=down.device)
    partial = torch.empty(splits, block_m, hidden, dtype=torch.float32, device=down.device) if splits > 1 else out
    _silu_down_kernel[(tiles, splits)](
        gate_up, down, out, partial, arrivals,
        rows, hidden, inner, split_blocks,
        gate_up.stride(0), down.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=splits > 1,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
