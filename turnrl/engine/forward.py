"""The decoder's forward pass over a KV cache of rows (one row per cached sequence).

Notation: b sequences in the call, t new tokens per sequence (right-padded),
L key positions attended (a bucket at least the longest sequence), Hq query
heads, Hkv key/value heads, D head dim.

Each row of the cache holds one sequence's keys and values at their positions
(in pages: :mod:`turnrl.engine.cache`); a call writes the new tokens' keys and
values at ``write_pos`` and attends over the row's first L positions, masked to
the positions at or before each query's. Padding tokens write to the scratch
position (``capacity``, in the scratch page) so that they never overwrite a
cached token.

A layer is two pure functions of tensors (:func:`attention_inputs` before the
cache write, :func:`decode_layer_out` or :func:`layer_out` after attention),
the same for every layer with the weights passed as arguments: on a GPU they
are compiled once (:class:`DecoderKernels`) and fuse a decode step's
elementwise work (norms, rotary, biases, softmax and mask, SwiGLU, residuals)
into a few kernels around the GEMMs. With the Triton kernels (and no
per-head query/key norms) a layer is :func:`qkv_projection`, then
:func:`~turnrl.engine.cache_write.rotate_and_write` (rotary and cache write
in one kernel), the attention kernel and :func:`pending_layer_out`, whose MLP
output the next layer's projection adds; a decode step's rotary and cache write run inside the attention kernel
(:func:`~turnrl.engine.attention.rotate_write_attend`). A Qwen3-VL prefill adds its images' deepstack features to
the first layers' outputs (:class:`Deepstack`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.experimental._config
import torch.nn.functional as F

from turnrl.engine.attention import cached_attention, rotate_write_attend, supported_head_dim
from turnrl.engine.cache import KVCache
from turnrl.engine.cache_write import rotate_and_write
from turnrl.engine.weights import DecoderShape, DecoderWeights, WeightRef

KEY_ALIGN = 64
"""Capacities and attended key lengths are multiples of this: the attention matmuls' rows then stay aligned for
the fast GEMM kernels (an odd key length made cuBLAS fall back to kernels several times slower on an H100)."""


def round_up(value: int, multiple: int = KEY_ALIGN) -> int:
    return -(-value // multiple) * multiple


def power_of_two_at_least(value: int, smallest: int = 1) -> int:
    return max(smallest, 1 << (value - 1).bit_length())


def rotary_table(weights: DecoderWeights, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position below ``length`` from the model's own rotary module, each Shape (length, D)."""
    positions = torch.arange(length, device=device).unsqueeze(0)
    if weights.family.rotary.mrope:
        # An M-RoPE module takes one row of positions per axis, Shape (3, batch, length) (some transformers
        # versions also take (batch, length), others do not).
        positions = positions.expand(3, 1, length)
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = weights.rotary(probe, positions)
    # An M-RoPE module may return one table per axis, Shape (3, 1, length, D): with equal positions on the three
    # axes they are equal.
    cos, sin = (table.reshape(-1, length, table.shape[-1])[0].to(weights.dtype) for table in (cos, sin))
    return cos, sin


def mrope_rows(table: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Rows of a rotary table for 3D positions: each dim from the row of its axis' position.

    Args:
        table: :func:`rotary_table`'s cos or sin, Shape (length, D). positions: Shape (n, 3). axes: each dim's axis,
            Shape (D,).

    Returns:
        Shape (n, D).
    """
    rows = table[positions]  # (n, 3, D)
    return rows.gather(1, axes.view(1, 1, -1).expand(len(positions), 1, -1)).squeeze(1)


@dataclass
class Deepstack:
    """Features added to a prefill's residual stream at its image tokens after each of the first layers (Qwen3-VL's
    deepstack: the vision tower's intermediate features, fed to the decoder's early layers).

    Notation: n image tokens in the call.
    """

    slots: tuple[torch.Tensor, torch.Tensor]
    """Each image token's sequence and token index in the call, each Shape (n,)."""
    features: list[torch.Tensor]
    """``features[l]`` is added to layer l's output, each Shape (n, hidden) in the compute dtype."""


def add_at(x: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    """``x`` with ``features`` added at ``slots`` (as transformers' Qwen3-VL adds them: the sum written back).

    Args:
        x: Shape (b, t, hidden). slots: sequence and token indices, each Shape (n,). features: Shape (n, hidden).
    """
    return x.index_put(slots, x[slots] + features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32 (as transformers' Llama-family norms)."""
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (half-split layout). x Shape (b, t, H, D); cos, sin Shape (b, t, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor] | None
                 ) -> torch.Tensor:
    """Linear layers of the same input, outputs concatenated: one GEMM for a fused weight, else one each."""
    outputs = [F.linear(x, w, b) for w, b in zip(weights, biases if biases is not None else [None] * len(weights))]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def attention_inputs(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    input_norm: torch.Tensor,
    qkv: Sequence[torch.Tensor],
    qkv_bias: Sequence[torch.Tensor] | None,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    shape: DecoderShape,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's queries, and the keys and values to cache, of the new tokens.

    Args:
        x: the residual stream, Shape (b, t, hidden).
        positions: Shape (b, t). cos_table, sin_table: :func:`rotary_table`, Shape (length, D).

    Returns:
        q Shape (b, Hq, t, D); kv Shape (b, t, 2, Hkv, D), keys (rotated) then values, as the cache takes them.
    """
    b, t, _ = x.shape
    heads, kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    projected = linear_group(rms_norm(x, input_norm, shape.rms_eps), qkv, qkv_bias)
    q, k, v = projected.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(b, t, heads, head_dim)
    k = k.view(b, t, kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q = rms_norm(q, q_norm, shape.rms_eps)
        k = rms_norm(k, k_norm, shape.rms_eps)
    cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)  # (b, t, 1, D)
    q = rotate(q, cos, sin).transpose(1, 2)
    kv = torch.stack((rotate(k, cos, sin), v.view(b, t, kv_heads, head_dim)), dim=2)
    return q, kv


def qkv_projection(x: torch.Tensor, mlp_out: torch.Tensor | None, input_norm: torch.Tensor,
                   qkv: Sequence[torch.Tensor], qkv_bias: Sequence[torch.Tensor] | None, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream with the last layer's MLP output added (:func:`pending_layer_out`), and the q/k/v
    projection of it normed: what :func:`~turnrl.engine.cache_write.rotate_and_write` takes (the rest of
    :func:`attention_inputs`, in one kernel).

    Args:
        x, mlp_out: Shape (b, t, hidden); ``mlp_out`` None before the first layer.

    Returns:
        x Shape (b, t, hidden); the projection Shape (b, t, (Hq + 2 Hkv) * D).
    """
    if mlp_out is not None:
        x = x + mlp_out
    return x, linear_group(rms_norm(x, input_norm, eps), qkv, qkv_bias)


def layer_out(
    x: torch.Tensor,
    attended: torch.Tensor,
    o: torch.Tensor,
    o_bias: torch.Tensor | None,
    post_norm: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    down: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The residual stream after a layer: the attention output's projection, then the SwiGLU MLP.

    Args:
        x: the residual stream, Shape (b, t, hidden). attended: the attention output, Shape (b, t, Hq * D).
    """
    x, mlp_out = pending_layer_out(x, attended, o, o_bias, post_norm, gate_up, down, eps)
    return x + mlp_out


def pending_layer_out(
    x: torch.Tensor,
    attended: torch.Tensor,
    o: torch.Tensor,
    o_bias: torch.Tensor | None,
    post_norm: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    down: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`layer_out` with the MLP's output returned, not added: the next layer's :func:`qkv_projection` adds
    it in its norm's kernel, which saves a pass over the residual stream a layer. Shapes as :func:`layer_out`."""
    x = x + F.linear(attended, o, o_bias)
    gate, up = linear_group(rms_norm(x, post_norm, eps), gate_up, None).chunk(2, dim=-1)
    return x, F.linear(F.silu(gate) * up, down)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """Attention of one new token per sequence over its cached keys, as two batched matmuls and a float32 softmax.

    This reads each key and value once; the fused SDPA kernels tile the queries in blocks of 64 or more, and
    with a handful of queries per key/value head they ran several times slower (on an H100, a third of the
    decode step). Grouped-query attention without repeating keys: the query heads of a key/value head are
    that head's queries.

    Args:
        q: Shape (b, Hq, 1, D). keys, values: Shape (b, Hkv, L, D). positions: the new tokens', Shape (b,);
            a query attends to the key positions at or before its own.

    Returns:
        Shape (b, 1, Hq * D).
    """
    b, heads, _, head_dim = q.shape
    kv_heads, key_len = keys.shape[1], keys.shape[2]
    grouped = q.reshape(b, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * head_dim**-0.5
    mask = torch.arange(key_len, device=q.device) <= positions.view(b, 1, 1, 1)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs.to(values.dtype), values).reshape(b, 1, heads * head_dim)


def decode_layer_out(
    x: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    o: torch.Tensor,
    o_bias: torch.Tensor | None,
    post_norm: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    down: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """A decode step's layer after the cache write: :func:`decode_attention` then :func:`layer_out`.

    Shapes: x (b, 1, hidden); the rest as :func:`decode_attention`.
    """
    return layer_out(x, decode_attention(q, keys, values, positions), o, o_bias, post_norm, gate_up, down, eps)


def final_logits(x: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float) -> torch.Tensor:
    """Logits in the compute dtype (the sampler reads them in float32), Shape (..., vocab)."""
    return F.linear(rms_norm(x, norm, eps), lm_head)


@dataclass(frozen=True)
class DecoderKernels:
    """The functions a decode step runs: these plain ones, or the same compiled (:func:`compiled_kernels`)."""

    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor]] = attention_inputs
    qkv_projection: Callable[..., tuple[torch.Tensor, torch.Tensor]] = qkv_projection
    """Before :func:`~turnrl.engine.cache_write.rotate_and_write` (which replaces the rest of attention_inputs)."""
    pending_layer_out: Callable[..., tuple[torch.Tensor, torch.Tensor]] = pending_layer_out
    decode_layer_out: Callable[..., torch.Tensor] = decode_layer_out
    layer_out: Callable[..., torch.Tensor] = layer_out
    """After :func:`~turnrl.engine.attention.cached_attention` (which replaces :func:`decode_attention`)."""
    final_logits: Callable[..., torch.Tensor] = final_logits

    @property
    def compiled(self) -> bool:
        return isinstance(self.attention_inputs, DynamicCompiled)


EAGER = DecoderKernels()


class DynamicCompiled:
    """``torch.compile(fn)`` with the batch (and key-length) dims of its tensor arguments dynamic from the start.

    Those dims are the only ones that vary between calls, so the first call compiles the one graph that every
    bucket and layer reuses (a batch of 1 compiles once more: dynamo specializes sizes of 1). Marking them,
    rather than ``dynamic=True``, keeps the model's constants (heads, head dim) static; and sizes are not
    "duck-shaped" (a batch of 64 must not become the same symbol as a head dim of 64, which recompiles at the
    next batch).
    """

    def __init__(self, fn: Callable[..., Any], dynamic_dims: dict[int, tuple[int, ...]]) -> None:
        self.compiled = torch.compile(fn)
        self.dynamic_dims = dynamic_dims
        """Positional argument index -> its dims that vary."""
        self._compiled_classes: set[tuple[bool | None, ...]] = set()
        """The shape classes (which varying dims are 1) compiled so far."""

    def __call__(self, *args: Any) -> Any:
        # A graph serves every call whose varying dims are 1 where its first call's were (dynamo specializes 1s):
        # the dims are marked only for the first call of each such class. Marking costs about 0.1 ms a tensor,
        # which a prefill's 48 calls (two per layer) paid on every call.
        # An argument that may be None (dynamo specializes on it) is a class of its own.
        shape_class = tuple(None if args[index] is None else args[index].shape[dim] == 1
                            for index, dims in self.dynamic_dims.items() for dim in dims)
        if shape_class in self._compiled_classes:
            return self.compiled(*args)
        for index, dims in self.dynamic_dims.items():
            for dim in dims:
                if args[index] is not None:
                    torch._dynamo.maybe_mark_dynamic(args[index], dim)
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            result = self.compiled(*args)
        self._compiled_classes.add(shape_class)
        return result


def compiled_kernels() -> DecoderKernels:
    """:data:`EAGER`'s functions through :class:`DynamicCompiled`: compiled on the first call of each (a CUDA
    graph's warm-up makes it before capture), once for all layers and (batch, key-length) buckets, and once more
    for prefill calls (t > 1, any t: a prefill's elementwise work, eager, took half of its time on an H100)."""
    return DecoderKernels(
        attention_inputs=DynamicCompiled(attention_inputs, {0: (0, 1), 1: (0, 1)}),
        qkv_projection=DynamicCompiled(qkv_projection, {0: (0, 1), 1: (0, 1)}),
        pending_layer_out=DynamicCompiled(pending_layer_out, {0: (0, 1), 1: (0, 1)}),
        decode_layer_out=DynamicCompiled(decode_layer_out, {0: (0,), 1: (0,), 2: (0, 2), 3: (0, 2), 4: (0,)}),
        layer_out=DynamicCompiled(layer_out, {0: (0, 1), 1: (0, 1)}),
        final_logits=DynamicCompiled(final_logits, {0: (0,)}),
    )


def _values(refs: Sequence[WeightRef] | None) -> list[torch.Tensor] | None:
    return None if refs is None else [ref.value for ref in refs]


def decoder_forward(
    weights: DecoderWeights,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor | None,
    rows: torch.Tensor | None,
    key_len: int,
    kernels: DecoderKernels = EAGER,
    triton_attention: bool = False,
    rope_positions: torch.Tensor | None = None,
    embeddings: torch.Tensor | None = None,
    deepstack: Deepstack | None = None,
) -> torch.Tensor:
    """Final hidden states of the new tokens, writing their keys and values into the cache.

    Args:
        rope: :func:`rotary_table`'s cos and sin.
        tokens: Shape (b, t).
        positions: each token's position in its sequence, Shape (b, t); a padding token's is any valid one.
        write_pos: where each token's key and value go in its row, Shape (b, t); ``cache.capacity`` for padding.
            None: at ``positions`` (a decode step: rows not running are at ``cache.capacity`` there).
        rows: the cache row of each sequence, Shape (b,); None means rows ``0 .. b-1``.
        key_len: L, the key positions attended; at least every sequence's length after this call.
        kernels: the layer functions (eager or compiled).
        triton_attention: attend with :func:`~turnrl.engine.attention.cached_attention` (each row read only up to
            its own length; ``key_len`` is then unused), else with torch's batched matmuls (decode) or SDPA over a
            mask (prefill), up to ``key_len``.
        rope_positions: the rows of ``rope`` each token turns by, Shape (b, t); None: ``positions`` (a VLM's
            tokens turn by their M-RoPE positions, not by their index).
        embeddings: the new tokens' input embeddings, Shape (b, t, hidden) (a VLM's images in them); None: the
            tokens' own.
        deepstack: features added to the first layers' outputs at the image tokens (a Qwen3-VL prefill), or None.

    Returns:
        Shape (b, t, hidden), before the final norm (:func:`final_logits` applies it).
    """
    shape = weights.shape
    b, t = tokens.shape
    decode = t == 1
    at_positions = write_pos is None
    write_pos = positions if write_pos is None else write_pos
    if not decode and not triton_attention:
        # Grouped-query attention without repeating keys: the n_rep query heads of a key/value head become
        # n_rep * t queries of that head.
        n_rep = shape.num_heads // shape.num_kv_heads
        mask = torch.arange(key_len, device=tokens.device).view(1, 1, key_len) <= positions.unsqueeze(-1)
        mask = mask.unsqueeze(1).expand(b, n_rep, t, key_len).reshape(b, 1, n_rep * t, key_len)

    x = F.embedding(tokens, weights.embed.value) if embeddings is None else embeddings
    turns = positions if rope_positions is None else rope_positions
    # With the Triton kernels, one kernel rotates and writes the cache (per-head q/k norms keep the compiled path).
    fused_write = triton_attention and not weights.family.qk_norm and supported_head_dim(shape.head_dim)
    if not fused_write:
        write_rows = (torch.arange(b, device=tokens.device) if rows is None else rows).unsqueeze(1).expand(b, t)
    mlp_out = None  # the fused path's last MLP output, not yet added to x
    for index, (layer, kv_cache) in enumerate(zip(weights.layers, cache.kv)):
        o_bias = layer.o_bias.value if layer.o_bias is not None else None
        gate_up = _values(layer.gate_up) or []
        after_attention = (layer.o.value, o_bias, layer.post_norm.value, gate_up, layer.down.value, shape.rms_eps)
        if fused_write:
            x, projected = kernels.qkv_projection(x, mlp_out, layer.input_norm.value, _values(layer.qkv),
                                                  _values(layer.qkv_bias), shape.rms_eps)
            if at_positions and decode:  # one kernel rotates, writes and attends
                attended = rotate_write_attend(projected, rope[0], rope[1], turns, kv_cache, cache.table, rows,
                                               positions, cache.capacity, shape.num_heads, arrivals=cache.arrivals)
            else:
                q = rotate_and_write(projected, rope[0], rope[1], turns, write_pos, rows, kv_cache, cache.table,
                                     shape.num_heads)
                attended = cached_attention(q, kv_cache, cache.table, rows, positions, cache.capacity,
                                            arrivals=cache.arrivals)
            x, mlp_out = kernels.pending_layer_out(x, attended, *after_attention)
        else:
            q, kv = kernels.attention_inputs(
                x, turns, rope[0], rope[1], layer.input_norm.value, _values(layer.qkv), _values(layer.qkv_bias),
                layer.q_norm.value if layer.q_norm is not None else None,
                layer.k_norm.value if layer.k_norm is not None else None, shape,
            )
            cache.write(kv_cache, write_rows, write_pos, kv)  # one indexed write for keys and values
            if triton_attention:
                attended = cached_attention(q, kv_cache, cache.table, rows, positions, cache.capacity,
                                            arrivals=cache.arrivals)
                x = kernels.layer_out(x, attended, *after_attention)
            else:
                cached = cache.gather(kv_cache, write_rows[:, 0], key_len)
                keys, values = cached[0], cached[1]
                if decode:
                    x = kernels.decode_layer_out(x, q, keys, values, positions[:, 0], *after_attention)
                else:
                    grouped = q.reshape(b, shape.num_kv_heads, n_rep * t, shape.head_dim)
                    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
                    attended = out.reshape(b, shape.num_heads, t, shape.head_dim).transpose(1, 2).reshape(b, t, -1)
                    x = kernels.layer_out(x, attended, *after_attention)
        if deepstack is not None and index < len(deepstack.features):
            # Added to the layer's whole output (the fused path's pending MLP output first), as transformers does.
            x = add_at(x if mlp_out is None else x + mlp_out, deepstack.slots, deepstack.features[index])
            mlp_out = None
    return x if mlp_out is None else x + mlp_out
