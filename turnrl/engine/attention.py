"""Attention over the KV cache's rows in one Triton kernel, for prefill and decode alike (GPU).

Notation: b sequences in the call, t new tokens per sequence (right-padded), Hq query heads, Hkv key/value heads
(n_rep = Hq / Hkv query heads share one), D head dim, R cache rows, C row capacity, N cache pages of P positions.

The cache is paged (:class:`~turnrl.engine.cache.KVCache`): a row's position p is in page ``pages[row, p // P]``
at offset ``p % P``; a key block never crosses a page (P is a multiple of the block), so a block costs one table
read. Each query attends to the keys of its row at positions up to its own, and reads nothing past them: a row is read
only as far as its sequence goes, not up to the longest sequence of the batch (as the batched-matmul decode of
:mod:`turnrl.engine.forward` must), and no mask is built. One program handles a block of a sequence's query rows
for one key/value head: the rows are (token, query head of that key/value head) pairs, so a decode step's n_rep
heads of a key/value head share every key and value read (grouped-query attention without repeating keys), and a
prefill's blocks stop at the last position they hold (causal). Softmax in float32, online (flash attention's
running max and sum). A decode batch too small to fill the GPU splits each row's keys into stretches, each a
program, whose partial results are combined (flash-decoding): by the last of a row's stretches to finish, where
the caller gives the counters that say which is last (the engine's cache holds them), else by a second kernel.
On an H200 at the 3B's decode of 64 rows (2,048 keys each, three stretches) one kernel took 40.5 us a layer where
the two took 41.9 (``benchmarks/attention.py --combine-in-kernel``).

Needs Triton (CUDA builds of torch ship it). On a CPU the engine runs :mod:`turnrl.engine.forward`'s torch
attention; with ``TRITON_INTERPRET=1`` (set before Triton is imported) the kernel runs on CPU tensors in Triton's
interpreter, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools

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
        Q, KV, Pages, Rows, Pos, Out, Partial, PartialMax, PartialSum, Arrivals, Cos, Sin, RopePos,
        scale_log2,
        q_sb, q_sh, q_st,
        kv_s2, kv_sn, kv_sh, kv_sp, pages_sr,
        pos_sb, pos_st,
        o_sb, o_st, o_sh,
        rope_sb, table_s,
        t, scratch, m_blocks, splits,
        N_REP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DENSE_ROWS: tl.constexpr, PRECISION: tl.constexpr,
        SPLIT: tl.constexpr, ROTATE: tl.constexpr, PAGE: tl.constexpr, COMBINE: tl.constexpr,
    ):
        """With ROTATE (decode), Q is the q/k/v projection, Shape (b, (Hq + 2 Hkv) * D): the program rotates its
        queries, and the program whose stretch holds the new token writes its rotated key and its value into the
        cache before reading it (:func:`rotate_write_attend`). With SPLIT and COMBINE, the last of a (sequence,
        key/value head)'s stretches to finish combines them all into the output (``Arrivals`` counts them)."""
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        m_block = tl.program_id(2) % m_blocks
        split = tl.program_id(2) // m_blocks
        query_rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        token = query_rows // N_REP
        head = kv_head * N_REP + query_rows % N_REP
        real = token < t
        dims = tl.arange(0, D_PAD)
        in_dims = dims < D

        pos = tl.load(Pos + seq * pos_sb + token * pos_st, mask=real, other=0)
        # A row not running in a decode bucket sits at the scratch position: it attends to key 0 alone (its
        # output is discarded) instead of reading the whole row.
        slot = pos  # where a new token's key goes (ROTATE): the scratch column for a padding row
        pos = tl.where(pos >= scratch, 0, pos)
        q_at = Q + seq * q_sb + head[:, None] * q_sh + token[:, None] * q_st
        q = tl.load(q_at + dims[None, :], mask=real[:, None] & in_dims[None, :], other=0.0)
        if ROTATE:
            # As rotate_and_write: x * cos + rotate_half(x) * sin in float32, rounded once (D is a power of two).
            half: tl.constexpr = D // 2
            partner = tl.where(dims < half, dims + half, dims - half)
            sign = tl.where(dims < half, -1.0, 1.0)
            turn = tl.load(RopePos + seq * rope_sb)
            cos = tl.load(Cos + turn * table_s + dims).to(tl.float32)
            sin = tl.load(Sin + turn * table_s + dims).to(tl.float32)
            q_partner = tl.load(q_at + partner[None, :], mask=real[:, None], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * q_partner * sin[None, :]).to(Q.dtype.element_ty)

        row = seq if DENSE_ROWS else tl.load(Rows + seq)
        table = Pages + row.to(tl.int64) * pages_sr
        head_keys = KV + kv_head * kv_sh
        end = tl.max(pos, axis=0) + 1
        # With SPLIT (decode), this program takes one of ``splits`` stretches of the keys, whole blocks each.
        stretch = tl.cdiv(tl.cdiv(end, splits), BLOCK_N) * BLOCK_N
        begin = split * stretch
        stop = tl.minimum(end, begin + stretch)
        if ROTATE:
            if (end - 1 >= begin) & (end - 1 < stop):  # the stretch that reads the new token writes it
                k_at = Q + seq * q_sb + (N_REP * tl.num_programs(1) + kv_head) * D
                k = tl.load(k_at + dims).to(tl.float32)
                k_partner = tl.load(k_at + partner).to(tl.float32)
                v = tl.load(k_at + tl.num_programs(1) * D + dims)
                write_at = tl.max(slot, axis=0)
                write_page = tl.load(table + write_at // PAGE).to(tl.int64)
                cached = head_keys + write_page * kv_sn + (write_at % PAGE).to(tl.int64) * kv_sp + dims
                tl.store(cached, (k * cos + sign * k_partner * sin).to(KV.dtype.element_ty))
                tl.store(cached + kv_s2, v.to(KV.dtype.element_ty))
            # The stores are read below by other threads of this program: a barrier makes them visible.
            tl.debug_barrier()

        running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
        for start in range(begin, stop, BLOCK_N):
            key_pos = start + tl.arange(0, BLOCK_N)
            in_row = key_pos < stop
            keys = head_keys + tl.load(table + start // PAGE).to(tl.int64) * kv_sn
            offsets = (start % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
            k = tl.load(keys + offsets[None, :] * kv_sp + dims[:, None], mask=in_row[None, :] & in_dims[:, None],
                        other=0.0)
            # Scores in log2 units: exp2 is the hardware's exponential.
            scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2
            scores = tl.where(key_pos[None, :] <= pos[:, None], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            probs = tl.math.exp2(scores - new_max[:, None])
            correction = tl.math.exp2(running_max - new_max)
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            v = tl.load(keys + kv_s2 + offsets[:, None] * kv_sp + dims[None, :],
                        mask=in_row[:, None] & in_dims[None, :], other=0.0)
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
            running_max = new_max

        if SPLIT:  # t = 1: rows are heads; the stretch's unnormalized output, its max and sum
            part = (seq * N_REP * tl.num_programs(1) + head) * splits + split
            tl.store(Partial + part[:, None] * D_PAD + dims[None, :], acc, mask=real[:, None])
            tl.store(PartialMax + part, running_max, mask=real)
            tl.store(PartialSum + part, running_sum, mask=real)
            if COMBINE:
                # Every thread's stores above happen before the arrival is counted (the barrier), and the count is a
                # release at the GPU's scope: whoever counts last sees every stretch's partial results.
                tl.debug_barrier()
                arrival = Arrivals + seq * tl.num_programs(1) + kv_head
                if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == splits - 1:
                    first = (seq * N_REP * tl.num_programs(1) + head) * splits
                    top = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
                    for other in range(0, splits):
                        top = tl.maximum(top, tl.load(PartialMax + first + other, mask=real, other=float("-inf"),
                                                      cache_modifier=".cg"))
                    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
                    combined = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
                    for other in range(0, splits):
                        maximum = tl.load(PartialMax + first + other, mask=real, other=float("-inf"),
                                          cache_modifier=".cg")
                        # An empty stretch (a row shorter than the others of its bucket) has max -inf: weight 0.
                        weight = tl.where(maximum == float("-inf"), 0.0, tl.math.exp2(maximum - top))
                        total += weight * tl.load(PartialSum + first + other, mask=real, other=0.0,
                                                  cache_modifier=".cg")
                        stretch_out = Partial + (first + other)[:, None] * D_PAD + dims[None, :]
                        combined += weight[:, None] * tl.load(stretch_out, mask=real[:, None], other=0.0,
                                                              cache_modifier=".cg")
                    out = combined / tl.where(real, total, 1.0)[:, None]
                    tl.store(Out + seq * o_sb + token[:, None] * o_st + head[:, None] * o_sh + dims[None, :],
                             out.to(Out.dtype.element_ty), mask=real[:, None] & in_dims[None, :])
                    tl.atomic_xchg(arrival, 0)  # counted from 0 again by the next call
        else:
            out = acc / running_sum[:, None]
            tl.store(Out + seq * o_sb + token[:, None] * o_st + head[:, None] * o_sh + dims[None, :],
                     out.to(Out.dtype.element_ty), mask=real[:, None] & in_dims[None, :])

    @triton.jit
    def _combine_splits_kernel(
        Partial, PartialMax, PartialSum, Out,
        o_sb, o_sh, heads, splits,
        D: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        """One (sequence, head)'s output from its key stretches: softmax-weighted by each stretch's max."""
        seq = tl.program_id(0)
        head = tl.program_id(1)
        index = tl.arange(0, SPLITS_PAD)
        present = index < splits
        part = (seq * heads + head) * splits + index
        maxima = tl.load(PartialMax + part, mask=present, other=float("-inf"))
        top = tl.max(maxima, axis=0)
        # An empty stretch (a row shorter than the others of its bucket) has max -inf: weight 0.
        weights = tl.where(maxima == float("-inf"), 0.0, tl.math.exp2(maxima - top))
        total = tl.sum(tl.load(PartialSum + part, mask=present, other=0.0) * weights, axis=0)
        dims = tl.arange(0, D_PAD)
        acc = tl.load(Partial + part[:, None] * D_PAD + dims[None, :], mask=present[:, None], other=0.0)
        out = tl.sum(acc * weights[:, None], axis=0) / total
        tl.store(Out + seq * o_sb + head * o_sh + dims, out.to(Out.dtype.element_ty), mask=dims < D)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (8 stands in for a CPU, where the kernels run in the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def decode_splits(b: int, kv_heads: int, device: torch.device) -> int:
    """Key stretches per (sequence, key/value head) in a decode step: 1 when the b * Hkv programs fill the GPU
    (at batch 256 on an H100 a split only added the combining work), else enough for about two programs per
    multiprocessor, at most 8."""
    programs, available = b * kv_heads, multiprocessors(device)
    return 1 if programs >= available else min(8, triton.cdiv(2 * available, programs))


def cached_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    pages: torch.Tensor,
    rows: torch.Tensor | None,
    positions: torch.Tensor,
    scratch: int,
    split: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    block_m: int | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens over their rows' cached keys and values (their own already written).

    Args:
        q: the new tokens' queries, Shape (b, Hq, t, D), any strides with the head dim contiguous.
        kv: one layer's cache pages, Shape (2, N, Hkv, P, D): keys then values (:class:`~turnrl.engine.cache.KVCache`).
        pages: each row's pages, Shape (R, C / P + 1) int32 (the last column: the scratch page).
        rows: the cache row of each sequence, Shape (b,); None means rows ``0 .. b-1``.
        positions: each query's position, Shape (b, t); it attends to key positions ``0 .. position``. A query
            at ``scratch`` (or beyond) is not a running sequence's: it attends to position 0 alone.
        scratch: the cache's scratch position (its capacity C).
        split: a decode call's key stretches per sequence and key/value head (None: :func:`decode_splits`);
            a prefill call is never split.
        block_n, num_warps, num_stages, block_m: the kernel's key block, launch settings and query block (None:
            the defaults for a decode or a prefill call; benchmarks sweep them).
        arrivals: int32 zeros, at least b * Hkv of them (:attr:`~turnrl.engine.cache.KVCache.arrivals`), with
            which a split call's stretches combine themselves; each call leaves them zero. None: a second kernel
            combines them. Calls that share it must not run at the same time (one stream).

    Returns:
        Shape (b, t, Hq * D), in q's dtype.
    """
    b, heads, t, head_dim = q.shape
    if q.stride(-1) != 1:
        raise ValueError("cached_attention: the head dim of q must be contiguous")
    return _attend(q, (q.stride(0), q.stride(1), q.stride(2)), heads, t, head_dim, kv, pages, rows, positions,
                   scratch, None, split, block_n, num_warps, num_stages, block_m, arrivals)


def supported_head_dim(head_dim: int) -> bool:
    """Head dims the rotating kernels take: powers of two of 16 or more (a rotary half is a whole block)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def check_projection(caller: str, projected: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int) -> None:
    """Refuse a q/k/v projection, Shape (b, t, width), that a rotating kernel cannot read, before it launches."""
    width = projected.shape[-1]
    if width != (num_heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"{caller}: a projection of width {width} is not {num_heads} query and "
                         f"{kv_heads} key/value heads of {head_dim}")
    if not supported_head_dim(head_dim):
        raise ValueError(f"{caller} takes power-of-two head dims of 16 or more, not {head_dim}")
    if projected.stride(2) != 1:
        raise ValueError(f"{caller}: the projection's last dim must be contiguous")


def rotate_write_attend(
    projected: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    rope_positions: torch.Tensor,
    kv: torch.Tensor,
    pages: torch.Tensor,
    rows: torch.Tensor | None,
    positions: torch.Tensor,
    scratch: int,
    num_heads: int,
    split: int | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode step's attention from the q/k/v projection: :func:`~turnrl.engine.cache_write.rotate_and_write`
    and :func:`cached_attention` in one kernel.

    Each program rotates the queries of its key/value head; the one whose key stretch holds the new token also
    rotates its key and writes key and value at the token's position (the scratch column for a padding row),
    then reads them with the rest. At batch 256 on an H100 the separate rotary kernel was 3 us of a layer's
    decode, most of it launch and tail latency.

    Args:
        projected: Shape (b, 1, (Hq + 2 Hkv) * D): queries, keys, values (the last dim contiguous).
        cos_table, sin_table: :func:`~turnrl.engine.forward.rotary_table`'s, Shape (length, D).
        rope_positions: the table row each token turns by, Shape (b, 1).
        kv, pages, rows, scratch, split, arrivals: as :func:`cached_attention`.
        positions: each token's position, Shape (b, 1): it is written there and attends to ``0 .. position``.
        num_heads: Hq.

    Returns:
        Shape (b, 1, Hq * D).
    """
    t = projected.shape[1]
    kv_heads, head_dim = kv.shape[2], kv.shape[4]
    if t != 1:
        raise ValueError(f"rotate_write_attend decodes one token per sequence, not {t}")
    check_projection("rotate_write_attend", projected, num_heads, kv_heads, head_dim)
    rotary = (cos_table.contiguous(), sin_table.contiguous(), rope_positions)
    return _attend(projected, (projected.stride(0), head_dim, 0), num_heads, 1, head_dim, kv, pages, rows,
                   positions, scratch, rotary, split, arrivals=arrivals)


def _attend(
    q: torch.Tensor,
    q_strides: tuple[int, int, int],
    heads: int,
    t: int,
    head_dim: int,
    kv: torch.Tensor,
    pages: torch.Tensor,
    rows: torch.Tensor | None,
    positions: torch.Tensor,
    scratch: int,
    rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    split: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    block_m: int | None = None,
    arrivals: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's launch: queries at ``q`` with strides (sequence, head, token) in elements; ``rotary`` the
    cos and sin tables and the rope positions when ``q`` is an unrotated projection (:func:`rotate_write_attend`)."""
    if triton is None:
        raise RuntimeError("cached_attention needs Triton; install a CUDA build of torch, or use torch attention "
                           "(model.engine.triton=false)")
    b = q.shape[0]
    kv_heads = kv.shape[2]
    if kv.stride(-1) != 1:
        raise ValueError("cached_attention: the head dim of the cache must be contiguous")
    n_rep = heads // kv_heads
    out = torch.empty(b, t, heads, head_dim, dtype=q.dtype, device=q.device)
    decode = t == 1
    # Settings measured on an H100 (docs/benchmarks.md): a decode step streams its keys in blocks of 64; a
    # prefill's small query blocks do best with key blocks of 32 and one more stage (in the interpreter, on a
    # CPU, fewer blocks run faster).
    gpu_prefill = not decode and q.device.type == "cuda"
    block_m = block_m or (max(16, triton.next_power_of_2(n_rep)) if decode else 64)
    block_n = block_n or (32 if gpu_prefill else 64)
    num_stages = num_stages or (3 if gpu_prefill else 2)
    page = kv.shape[3]
    if page % block_n:
        raise ValueError(f"cached_attention: key blocks of {block_n} cross pages of {page} positions")
    m_blocks = triton.cdiv(t * n_rep, block_m)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    splits = 1 if not decode else decode_splits(b, kv_heads, q.device) if split is None else split
    if splits > 1:
        partial = torch.empty(b * heads * splits, d_pad, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(b * heads * splits, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial = partial_max = partial_sum = out  # unused
    counters = arrivals if splits > 1 else None  # None: a second kernel combines the stretches, if any
    if counters is not None and (counters.dtype != torch.int32 or counters.numel() < b * kv_heads):
        raise ValueError(f"cached_attention: arrivals must be at least {b * kv_heads} int32 counters (the batch "
                         f"times the key/value heads), not {counters.numel()} of {counters.dtype}")
    cos, sin, rope_positions = rotary if rotary is not None else (out, out, positions)  # unused without rotary
    dense = rows is None
    _cached_attention_kernel[(b, kv_heads, m_blocks * splits)](
        q, kv, pages, positions if dense else rows, positions, out, partial, partial_max, partial_sum,
        counters if counters is not None else out, cos, sin, rope_positions,
        head_dim**-0.5 * 1.4426950408889634,  # log2(e): softmax through exp2
        *q_strides,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), pages.stride(0),
        positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        rope_positions.stride(0), cos.stride(0),
        t, scratch, m_blocks, splits,
        N_REP=n_rep, D=head_dim, D_PAD=d_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, DENSE_ROWS=dense,
        # float32 stays float32 (tl.dot would take TF32: a float32 engine is expected to match transformers).
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLIT=splits > 1, ROTATE=rotary is not None, PAGE=page, COMBINE=counters is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1 and counters is None:
        _combine_splits_kernel[(b, heads)](
            partial, partial_max, partial_sum, out, out.stride(0), out.stride(2), heads, splits,
            D=head_dim, D_PAD=d_pad, SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out.view(b, t, heads * head_dim)
