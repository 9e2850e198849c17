"""The decoder's forward pass over a KV cache of rows (one row per cached sequence).

Notation: b sequences in the call, t new tokens per sequence (right-padded),
L key positions attended (a bucket at least the longest sequence), Hq query
heads, Hkv key/value heads, D head dim.

Each row of the cache holds one sequence's keys and values at their positions;
a call writes the new tokens' keys and values at ``write_pos`` and attends
over the row's first L positions, masked to the positions at or before each
query's. Padding tokens write to the scratch column (the row's last) so that
they never overwrite a cached token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turnrl.engine.weights import DecoderShape, DecoderWeights, WeightRef


class KVCache:
    """Keys and values of every layer, each Shape (rows, Hkv, capacity + 1, D); column ``capacity`` is scratch.

    The capacity (positions per row) starts small and grows, by doubling up to ``max_len``, when a longer
    sequence arrives: short-context runs do not pay for the longest context they might see.
    """

    def __init__(self, shape: DecoderShape, rows: int, max_len: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 512) -> None:
        self.shape, self.rows, self.max_len, self.dtype, self.device = shape, rows, max_len, dtype, device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.grow(min(capacity, max_len))

    def grow(self, needed: int) -> bool:
        """Make room for ``needed`` positions per row (keeping what is cached); True if the tensors changed."""
        if needed <= self.capacity:
            return False
        capacity = max(needed, 1)
        capacity = min(self.max_len, 2 ** (capacity - 1).bit_length())
        size = (self.rows, self.shape.num_kv_heads, capacity + 1, self.shape.head_dim)
        old = self.capacity
        # Zeros, not empty: a padding query may attend to never-written positions, which must be finite.
        keys = [torch.zeros(size, dtype=self.dtype, device=self.device) for _ in range(self.shape.num_layers)]
        values = [torch.zeros(size, dtype=self.dtype, device=self.device) for _ in range(self.shape.num_layers)]
        for new, previous in zip(keys + values, self.keys + self.values):
            new[:, :, :old].copy_(previous[:, :, :old])
        self.keys, self.values, self.capacity = keys, values, capacity
        return True

    @staticmethod
    def bytes_per_token(shape: DecoderShape, dtype: torch.dtype) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element


def rotary_table(weights: DecoderWeights, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position below ``length`` from the model's own rotary module, each Shape (length, D)."""
    positions = torch.arange(length, device=device).unsqueeze(0)
    probe = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = weights.rotary(probe, positions)
    return cos[0].to(weights.dtype), sin[0].to(weights.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32 (as transformers' Llama-family norms)."""
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions (half-split layout). x Shape (b, H, t, D); cos, sin Shape (b, 1, t, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of a few queries per head over a long cache, as two batched matmuls and a float32 softmax.

    For one new token per sequence this reads each key and value once; the fused SDPA kernels tile the
    queries in blocks of 64 or more, and with a handful of queries per head they ran several times slower
    (on an H100, a third of the decode step).

    Args:
        q: Shape (b, Hkv, n, D). keys, values: Shape (b, Hkv, L, D). mask: Shape (b, 1, n, L), True to attend.

    Returns:
        Shape (b, Hkv, n, D).
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs.to(values.dtype), values)


def _linear(x: torch.Tensor, weight: WeightRef, bias: WeightRef | None = None) -> torch.Tensor:
    return F.linear(x, weight.value, bias.value if bias is not None else None)


def decoder_forward(
    weights: DecoderWeights,
    cache: KVCache,
    rope: tuple[torch.Tensor, torch.Tensor],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    write_pos: torch.Tensor,
    rows: torch.Tensor | None,
    key_len: int,
) -> torch.Tensor:
    """Final hidden states of the new tokens, writing their keys and values into the cache.

    Args:
        rope: :func:`rotary_table`'s cos and sin.
        tokens: Shape (b, t).
        positions: each token's position in its sequence, Shape (b, t); a padding token's is any valid one.
        write_pos: where each token's key and value go in its row, Shape (b, t); ``cache.capacity`` for padding.
        rows: the cache row of each sequence, Shape (b,); None means rows ``0 .. b-1`` (read without a copy).
        key_len: L, the key positions attended; at least every sequence's length after this call.

    Returns:
        Shape (b, t, hidden), after the final norm.
    """
    shape = weights.shape
    b, t = tokens.shape
    n_rep = shape.num_heads // shape.num_kv_heads
    eps = shape.rms_eps
    cos = rope[0][positions].unsqueeze(1)  # (b, 1, t, D)
    sin = rope[1][positions].unsqueeze(1)
    key_positions = torch.arange(key_len, device=tokens.device)
    mask = key_positions.view(1, 1, key_len) <= positions.unsqueeze(-1)  # (b, t, L)
    # Grouped-query attention without repeating keys: the n_rep query heads of a key/value head
    # become n_rep * t queries of that head.
    mask = mask.unsqueeze(1).expand(b, n_rep, t, key_len).reshape(b, 1, n_rep * t, key_len)
    write_rows = (torch.arange(b, device=tokens.device) if rows is None else rows).unsqueeze(1).expand(b, t)

    x = F.embedding(tokens, weights.embed.value)
    for layer, keys_cache, values_cache in zip(weights.layers, cache.keys, cache.values):
        h = rms_norm(x, layer.input_norm.value, eps)
        q = _linear(h, layer.q, layer.q_bias).view(b, t, shape.num_heads, shape.head_dim)
        k = _linear(h, layer.k, layer.k_bias).view(b, t, shape.num_kv_heads, shape.head_dim)
        v = _linear(h, layer.v, layer.v_bias).view(b, t, shape.num_kv_heads, shape.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = rms_norm(q, layer.q_norm.value, eps)
            k = rms_norm(k, layer.k_norm.value, eps)
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        keys_cache[write_rows, :, write_pos] = k.transpose(1, 2)
        values_cache[write_rows, :, write_pos] = v
        if rows is None:
            keys, values = keys_cache[:b, :, :key_len], values_cache[:b, :, :key_len]
        else:
            keys, values = keys_cache[rows, :, :key_len], values_cache[rows, :, :key_len]
        grouped = q.reshape(b, shape.num_kv_heads, n_rep * t, shape.head_dim)
        out = decode_attention(grouped, keys, values, mask) if t == 1 else F.scaled_dot_product_attention(
            grouped, keys, values, attn_mask=mask)
        out = out.reshape(b, shape.num_heads, t, shape.head_dim).transpose(1, 2).reshape(b, t, -1)
        x = x + _linear(out, layer.o, layer.o_bias)
        h = rms_norm(x, layer.post_norm.value, eps)
        x = x + _linear(F.silu(_linear(h, layer.gate)) * _linear(h, layer.up), layer.down)
    return rms_norm(x, weights.norm.value, eps)


def lm_logits(weights: DecoderWeights, hidden: torch.Tensor) -> torch.Tensor:
    """Float32 logits of hidden states, Shape (..., vocab)."""
    return F.linear(hidden, weights.lm_head.value).float()
