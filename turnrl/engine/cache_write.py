"""A layer's rotary positions and KV-cache write in one Triton kernel (GPU).

After the q/k/v projection, a layer turns the new tokens' queries and keys by their positions and stores the keys
and values in their cache rows. Compiled by Inductor, that was four kernels a layer (the rotary rows' gather, the
queries' rotation, the keys' rotation stacked with the values, the indexed cache write): at batch 256 on an H100,
10 us of a decode step's layer, most of it launch and tail latency for a few hundred kilobytes. Here one program
takes one token: it reads the token's projected heads once, rotates the queries into a query tensor and writes the
rotated keys and the values straight into the cache.

The arithmetic is the compiled path's (float32, rounded once to the cache's dtype): ``x * cos + rotate_half(x) *
sin`` with the half-split layout of transformers' Llama-family models. Models with per-head query/key norms
(Qwen3) keep the compiled path.
"""

from __future__ import annotations

import torch

from turnrl.engine.attention import check_projection, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rotate_and_write_kernel(
        Projected, Cos, Sin, RopePos, WritePos, Rows, Q, KV, Pages,
        p_sb, p_st, rope_sb, rope_st, write_sb, write_st, table_s,
        q_sb, q_st, q_sh,
        kv_s2, kv_sn, kv_sh, kv_sp, pages_sr,
        t,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
        DENSE_ROWS: tl.constexpr, PAGE: tl.constexpr,
    ):
        seq = tl.program_id(0) // t
        token = tl.program_id(0) % t
        turn = tl.load(RopePos + seq * rope_sb + token * rope_st)
        slot = tl.load(WritePos + seq * write_sb + token * write_st)
        row = seq if DENSE_ROWS else tl.load(Rows + seq)

        half: tl.constexpr = D // 2
        dims = tl.arange(0, D)
        # rotate_half(x)[d] = -x[d + half] for the first half, x[d - half] for the second.
        partner = tl.where(dims < half, dims + half, dims - half)
        sign = tl.where(dims < half, -1.0, 1.0)
        cos = tl.load(Cos + turn * table_s + dims).to(tl.float32)
        sin = tl.load(Sin + turn * table_s + dims).to(tl.float32)
        projected = Projected + seq * p_sb + token * p_st

        q_heads = tl.arange(0, HQ_PAD)[:, None]
        q_in = q_heads < HQ
        q_at = projected + q_heads * D
        q = tl.load(q_at + dims[None, :], mask=q_in, other=0.0).to(tl.float32)
        q_partner = tl.load(q_at + partner[None, :], mask=q_in, other=0.0).to(tl.float32)
        q_rotated = q * cos[None, :] + sign[None, :] * q_partner * sin[None, :]
        tl.store(Q + seq * q_sb + token * q_st + q_heads * q_sh + dims[None, :], q_rotated.to(Q.dtype.element_ty),
                 mask=q_in)

        kv_heads = tl.arange(0, HKV_PAD)[:, None]
        kv_in = kv_heads < HKV
        k_at = projected + (HQ + kv_heads) * D
        k = tl.load(k_at + dims[None, :], mask=kv_in, other=0.0).to(tl.float32)
        k_partner = tl.load(k_at + partner[None, :], mask=kv_in, other=0.0).to(tl.float32)
        k_rotated = k * cos[None, :] + sign[None, :] * k_partner * sin[None, :]
        v = tl.load(projected + (HQ + HKV + kv_heads) * D + dims[None, :], mask=kv_in, other=0.0)
        page = tl.load(Pages + row.to(tl.int64) * pages_sr + slot // PAGE).to(tl.int64)
        cached = KV + page * kv_sn + kv_heads * kv_sh + (slot % PAGE).to(tl.int64) * kv_sp + dims[None, :]
        tl.store(cached, k_rotated.to(KV.dtype.element_ty), mask=kv_in)
        tl.store(cached + kv_s2, v.to(KV.dtype.element_ty), mask=kv_in)


def rotate_and_write(
    projected: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    rope_positions: torch.Tensor,
    write_pos: torch.Tensor,
    rows: torch.Tensor | None,
    kv: torch.Tensor,
    pages: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """The new tokens' rotated queries; their rotated keys and their values written into the cache.

    Args:
        projected: the q/k/v projection of the new tokens, Shape (b, t, (Hq + 2 Hkv) * D): queries, keys, values
            (the token dim may be strided; the rest contiguous).
        cos_table, sin_table: :func:`~turnrl.engine.forward.rotary_table`'s, Shape (length, D), contiguous.
        rope_positions: the table row each token turns by, Shape (b, t).
        write_pos: each token's position in its cache row, Shape (b, t) (the scratch column for padding).
        rows: the cache row of each sequence, Shape (b,); None means rows ``0 .. b-1``.
        kv: one layer's cache pages, Shape (2, N, Hkv, P, D) (:class:`~turnrl.engine.cache.KVCache`).
        pages: each row's pages, Shape (R, C / P + 1) int32 (the last column: the scratch page).
        num_heads: Hq.

    Returns:
        q, Shape (b, Hq, t, D) (a view of a (b, t, Hq, D) tensor), as
        :func:`~turnrl.engine.attention.cached_attention` takes it.
    """
    if triton is None:
        raise RuntimeError("rotate_and_write needs Triton; install a CUDA build of torch, or set "
                           "model.engine.triton=false")
    b, t, _ = projected.shape
    kv_heads, head_dim = kv.shape[2], kv.shape[4]
    check_projection("rotate_and_write", projected, num_heads, kv_heads, head_dim)
    if kv.stride(-1) != 1:
        raise ValueError("rotate_and_write: the cache's last dim must be contiguous")
    cos_table, sin_table = cos_table.contiguous(), sin_table.contiguous()
    q = torch.empty(b, t, num_heads, head_dim, dtype=projected.dtype, device=projected.device)
    dense = rows is None
    _rotate_and_write_kernel[(b * t,)](
        projected, cos_table, sin_table, rope_positions, write_pos, write_pos if dense else rows, q, kv, pages,
        projected.stride(0), projected.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        write_pos.stride(0), write_pos.stride(1), cos_table.stride(0),
        q.stride(0), q.stride(1), q.stride(2),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), pages.stride(0),
        t,
        HQ=num_heads, HKV=kv_heads, D=head_dim, HQ_PAD=triton.next_power_of_2(num_heads),
        HKV_PAD=triton.next_power_of_2(kv_heads), DENSE_ROWS=dense, PAGE=kv.shape[3],
        num_warps=2 if num_heads * head_dim <= 2048 else 4,
    )
    return q.transpose(1, 2)
