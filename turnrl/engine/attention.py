"""Attention over the KV cache's rows in one Triton kernel, for prefill and decode alike (GPU).

Notation: b sequences in the call, t new tokens per sequence (right-padded), Hq query heads, Hkv key/value heads
(n_rep = Hq / Hkv query heads share one), D head dim, R cache rows, C row capacity.

Each query attends to the keys of its row at positions up to its own, and reads nothing past them: a row is read
only as far as its sequence goes, not up to the longest sequence of the batch (which the batched-matmul decode of
:mod:`turnrl.engine.forward` must, and which made episodes that drift apart in length slower than rounds of
turns), and no mask is built. One program handles a block of a sequence's query rows for one key/value head: the
rows are (token, query head of that key/value head) pairs, so a decode step's n_rep heads of a key/value head
share every key and value read (grouped-query attention without repeating keys), and a prefill's blocks stop at
the last position they hold (causal). Softmax in float32, online (flash attention's running max and sum).

Needs Triton (CUDA builds of torch ship it). On a CPU the engine runs :mod:`turnrl.engine.forward`'s torch
attention; with ``TRITON_INTERPRET=1`` (set before Triton is imported) the kernel runs on CPU tensors in Triton's
interpreter, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without Triton: the engine uses torch attention
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _cached_attention_kernel(
        Q, KV, Rows, Pos, Out,
        scale_log2,
        q_sb, q_sh, q_st,
        kv_s2, kv_sr, kv_sh, kv_sp,
        pos_sb, pos_st,
        o_sb, o_st, o_sh,
        t, scratch,
        N_REP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DENSE_ROWS: tl.constexpr, PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        query_rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        token = query_rows // N_REP
        head = kv_head * N_REP + query_rows % N_REP
        real = token < t
        dims = tl.arange(0, D_PAD)
        in_dims = dims < D

        pos = tl.load(Pos + seq * pos_sb + token * pos_st, mask=real, other=0)
        # A row not running in a decode bucket sits at the scratch position: it attends to key 0 alone (its
        # output is discarded) instead of reading the whole row.
        pos = tl.where(pos >= scratch, 0, pos)
        q = tl.load(Q + seq * q_sb + head[:, None] * q_sh + token[:, None] * q_st + dims[None, :],
                    mask=real[:, None] & in_dims[None, :], other=0.0)

        row = seq if DENSE_ROWS else tl.load(Rows + seq)
        keys = KV + row.to(tl.int64) * kv_sr + kv_head * kv_sh
        values = keys + kv_s2
        end = tl.max(pos, axis=0) + 1

        running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
        for start in range(0, end, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            in_row = key_pos < end
            k = tl.load(keys + key_pos[None, :] * kv_sp + dims[:, None], mask=in_row[None, :] & in_dims[:, None],
                        other=0.0)
            # Scores in log2 units: exp2 is the hardware's exponential.
            scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2
            scores = tl.where(key_pos[None, :] <= pos[:, None], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.math.exp2(scores - new_max[:, None])
            correction = tl.math.exp2(running_max - new_max)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            v = tl.load(values + key_pos[:, None] * kv_sp + dims[None, :], mask=in_row[:, None] & in_dims[None, :],
                        other=0.0)
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            running_max = new_max

        out = acc / running_sum[:, None]
        tl.store(Out + seq * o_sb + token[:, None] * o_st + head[:, None] * o_sh + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=real[:, None] & in_dims[None, :])


def _next_power_of_2(value: int) -> int:
    return 1 << (max(1, value) - 1).bit_length()


def cached_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: torch.Tensor | None,
    positions: torch.Tensor,
    scratch: int,
) -> torch.Tensor:
    """Attention of new tokens over their rows' cached keys and values (their own already written).

    Args:
        q: the new tokens' queries, Shape (b, Hq, t, D), any strides with the head dim contiguous.
        kv: one layer's cache, Shape (2, R, Hkv, C + 1, D): keys then values (:class:`~turnrl.engine.forward.KVCache`).
        rows: the cache row of each sequence, Shape (b,); None means rows ``0 .. b-1``.
        positions: each query's position, Shape (b, t); it attends to key positions ``0 .. position``. A query
            at ``scratch`` (or beyond) is not a running sequence's: it attends to position 0 alone.
        scratch: the cache's scratch column (its capacity C).

    Returns:
        Shape (b, t, Hq * D), in q's dtype.
    """
    if triton is None:
        raise RuntimeError("cached_attention needs Triton; install a CUDA build of torch, or use torch attention "
                           "(model.engine.attention=torch)")
    b, heads, t, head_dim = q.shape
    kv_heads = kv.shape[2]
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("cached_attention: the head dim of q and kv must be contiguous")
    n_rep = heads // kv_heads
    out = torch.empty(b, t, heads, head_dim, dtype=q.dtype, device=q.device)
    decode = t == 1
    block_m = max(16, _next_power_of_2(n_rep)) if decode else 64
    block_n = 64
    grid = (b, kv_heads, triton.cdiv(t * n_rep, block_m))
    dense = rows is None
    _cached_attention_kernel[grid](
        q, kv, positions if dense else rows, positions, out,
        head_dim**-0.5 * 1.4426950408889634,  # log2(e): softmax through exp2
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        t, scratch,
        N_REP=n_rep, D=head_dim, D_PAD=max(16, _next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, DENSE_ROWS=dense,
        # float32 stays float32 (tl.dot would take TF32: a float32 engine is expected to match transformers).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    return out.view(b, t, heads * head_dim)
