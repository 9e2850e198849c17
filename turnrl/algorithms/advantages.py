"""Advantage estimators for multi-turn agents, as pure functions over padded tensors.

Notation: ``b`` batch size, ``s`` sequence length, ``t`` turns (the most turns
of any row), ``g`` number of groups.

Every estimator takes padded ``(b, s)`` tensors and masks:

- ``token_rewards`` holds each turn's reward at that turn's last response token
  (see :func:`place_rewards`); any other non-zero entry is a per-token reward
  (a KL penalty folded into the reward, say).
- ``adv_mask`` (bool or 0/1 float) decides which tokens take part in the
  recursion. Tokens outside it are skipped: the recursion passes through them,
  carrying the next valid token's value and advantage, so observation tokens
  between two responses neither break nor bend the credit path. Rewards outside
  ``adv_mask`` are ignored. Returned advantages and returns are zero outside it.
- ``turn_end_mask`` is True at each turn's last response token. Turn ends
  outside ``adv_mask`` are ignored; the last token in ``adv_mask`` of a row
  always ends a turn, so a response cut off by the token budget still counts.

Sign convention: advantages are "higher is better"; the policy loss multiplies
them by ``-ratio``. Returns are ``advantages + values`` (the critic's target).

Nothing here loops over tokens in Python. Every recursion of the form
``y_i = x_i + c * y_{i+1}`` runs through :func:`discounted_reverse_cumsum`, a
chunked scan made of small matrix products: masked tokens are first compacted
to the left of each row, so the scan sees a constant coefficient.

Outputs are float32 (float64 when an input is float64; half-precision inputs
are summed in float32). On a GPU each token-level estimator reads one or two
sizes back to the host (the packed width, the most turns of a row).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "EpisodeStats",
    "GroupStats",
    "Placement",
    "anchored_share",
    "bilevel_gae",
    "broadcast_to_tokens",
    "discounted_reverse_cumsum",
    "gigpo_advantages",
    "group_stats",
    "grpo_advantages",
    "masked_gae",
    "place_rewards",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "turn_gae",
    "whiten",
]

Placement = Literal["per_turn", "episode_end"]
EpisodeStats = Literal["episodes", "turns"]

# Chunk length of the scan: each chunk is one (K x K) triangular matrix product,
# and the chunk totals are scanned again at the next level (s / K values). 32
# keeps the product cheap and bounds the rounding of a segmented scan to sums
# of at most 32 terms.
_CHUNK = 32


def _float_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (half types are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _powers(coef: float, n: int, like: torch.Tensor) -> torch.Tensor:
    """``coef ** k`` for ``k = 0 .. n-1``, computed in float64. Shape (n,)."""
    k = torch.arange(n, dtype=torch.float64, device=like.device)
    return torch.full_like(k, float(coef)).pow(k).to(like.dtype)


def discounted_reverse_cumsum(
    x: torch.Tensor, coef: float, segment_end: torch.Tensor | None = None
) -> torch.Tensor:
    """Reverse discounted cumulative sum, optionally restarted at segment ends.

    Computes, for each row independently and without a loop over positions::

        y_i = x_i + coef * y_{i+1}   if position i is not a segment end
        y_i = x_i                    if position i is a segment end
        y_n = 0                      (past the last position)

    i.e. ``y_i = sum_{j=i}^{e(i)} coef**(j-i) * x_j`` with ``e(i)`` the first
    segment end at or after ``i`` (the row end if none).

    Method: cut the row into chunks of ``K`` positions; inside a chunk the sum
    is one product with the triangular matrix ``T[i, j] = coef**(j-i)``; the
    chunks' first values are themselves a scan with coefficient ``coef**K``,
    solved recursively (4096 -> 128 -> 4 -> 1); each position then adds the
    next chunk's first value times ``coef**(K-i)``. A segment end inside a
    chunk is handled by subtracting the chunk's tail behind it, so the rounding
    error is that of a sum over one chunk, never over the whole row.

    Args:
        x: Shape (b, n), floating.
        coef: discount per position, in [0, 1].
        segment_end: Shape (b, n), bool, or None for one segment per row.

    Returns:
        Shape (b, n), same dtype as ``x``.
    """
    seg_last = None
    if segment_end is not None:
        idx = torch.arange(x.shape[1], device=x.device)
        seg_last = torch.where(segment_end, idx, x.shape[1]).flip(1).cummin(1).values.flip(1)
    return _scan(x, coef, seg_last)


def _scan(x: torch.Tensor, coef: float, seg_last: torch.Tensor | None) -> torch.Tensor:
    """:func:`discounted_reverse_cumsum` with segments given as ``seg_last``
    (Shape (b, n), long: the last position of each position's segment, n or
    more for "the row end")."""
    b, n = x.shape
    if n == 0:
        return x.clone()
    K = _CHUNK
    nc = -(-n // K)
    if nc * K > n:
        x = F.pad(x, (0, nc * K - n))
        if seg_last is not None:
            seg_last = F.pad(seg_last, (0, nc * K - n), value=nc * K)
    pw = _powers(coef, K + 1, x)  # coef**0 .. coef**K
    i = torch.arange(K, device=x.device)
    diff = i[None, :] - i[:, None]  # [i, j] -> j - i
    tri = torch.where(diff >= 0, pw[diff.clamp(min=0)], pw.new_zeros(()))
    local = (x.reshape(-1, K) @ tri.T).view(b, nc, K)  # unsegmented, inside the chunk
    cont = None  # whether position i's segment runs past its chunk's end
    if seg_last is not None:
        # chunk start of every position, as a full (nc, K) table: broadcasting
        # over the leading dim only keeps the subtraction vectorized on CPU
        chunk_start = torch.arange(nc * K, device=x.device).div_(K, rounding_mode="floor").mul_(K)
        to_end = seg_last.view(b, nc, K) - chunk_start.view(nc, K)  # segment end, chunk coordinates
        cont = to_end >= K
        after = to_end.add_(1).clamp_(max=K)  # first position behind it; K: the zero column
        tail = F.pad(local, (0, 1)).gather(-1, after)
        local = local.sub_(pw[after.sub_(i)] * tail)
    if nc > 1:
        # Chunk n's segment ends in chunk seg_last // K: the chunk-level segments.
        up = None if seg_last is None else seg_last.view(b, nc, K)[..., 0] // K
        starts = _scan(local[..., 0].contiguous(), float(coef) ** K, up)
        carry = pw[K - i] * F.pad(starts[:, 1:], (0, 1))[..., None]
        local = local + (carry if cont is None else carry * cont)
    return local.reshape(b, nc * K)[:, :n]


class _Packed(NamedTuple):
    """Where each masked token goes when the masked tokens of a row are packed left.

    Packed tensors have ``columns`` columns: the ``width`` packed positions, a
    zero column at index ``width`` (where tokens outside the mask read from
    and write to), and zeros up to a multiple of the scan's chunk, so that a
    scan needs no padding copy and leaves the zero column at zero.
    """

    position: torch.Tensor  # (b, s) long: packed position, or `width` outside the mask
    tokens: torch.Tensor  # (b,) long: masked tokens per row
    width: int  # most masked tokens in any row
    columns: int  # width + 1, rounded up to a multiple of _CHUNK


def _pack_layout(mask: torch.Tensor) -> _Packed:
    as_int = mask.long()
    pos = as_int.cumsum(1)
    count = pos[:, -1].clone() if mask.shape[1] else pos.new_zeros(mask.shape[0])
    width = int(count.max().item()) if mask.shape[0] else 0
    columns = -(-(width + 1) // _CHUNK) * _CHUNK
    # index = pos - 1 inside the mask, `width` outside. Written as arithmetic:
    # torch.where with a scalar branch is several times slower on CPU.
    index = pos.sub_(width + 1).mul_(as_int).add_(width)
    return _Packed(index, count, width, columns)


def _pack(x: torch.Tensor, layout: _Packed, dtype: torch.dtype) -> torch.Tensor:
    """Pack masked entries left. Shape (b, s) -> (b, columns), zero behind each
    row's last masked token."""
    out = torch.zeros(x.shape[0], layout.columns, dtype=dtype, device=x.device)
    out.scatter_(1, layout.position, x.to(dtype))
    out[:, layout.width] = 0  # the slot that tokens outside the mask were written to
    return out


def _unpack(packed: torch.Tensor, layout: _Packed) -> torch.Tensor:
    """Inverse of :func:`_pack`: (b, columns) -> (b, s), zero outside the mask
    (as long as the zero column stayed zero)."""
    return packed.gather(1, layout.position)


def _td_errors(
    r: torch.Tensor, v: torch.Tensor, gamma: float, ends: torch.Tensor | None = None, gamma_turn: float | None = None
) -> torch.Tensor:
    """``r_i + g_i * v_{i+1} - v_i`` along packed rows (zeros past the end
    bootstrap ``V = 0``), with ``g_i = gamma``, or ``gamma_turn`` where
    ``ends`` marks a turn's last token (the step to the next turn). Shape (b, n)."""
    delta = r - v
    if ends is None or gamma_turn is None or gamma_turn == gamma:
        return delta.add_(F.pad(v[:, 1:], (0, 1)), alpha=gamma)
    coef = torch.full_like(v, gamma).masked_fill_(ends, gamma_turn)
    return delta.add_(coef * F.pad(v[:, 1:], (0, 1)))


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


class _Turns(NamedTuple):
    """Turn structure of a batch in packed positions (see :func:`_pack`)."""

    ends: torch.Tensor  # (b, w + 1) bool: effective turn ends
    turn: torch.Tensor  # (b, w + 1) long: turn of each position (a free turn past the last)
    end_slot: torch.Tensor  # (b, w + 1) long: `turn` at turn ends, `n_turns` elsewhere
    n_turns: int  # most turns of any row


def _packed_turns(turn_end_mask: torch.Tensor, layout: _Packed) -> _Turns:
    ends = _pack(_as_bool(turn_end_mask), layout, torch.bool)
    # The last masked token of a row always ends a turn (a cut-off response).
    rows = torch.arange(ends.shape[0], device=ends.device)
    last = (layout.tokens - 1).clamp(min=0)
    ends[rows, last] |= layout.tokens > 0
    as_int = ends.long()
    before = as_int.cumsum(1)
    n_turns = int(before[:, -1].max().item()) if ends.shape[0] else 0
    turn = before.sub_(as_int)
    end_slot = (turn - n_turns).mul_(as_int).add_(n_turns)  # turn at ends, n_turns elsewhere
    return _Turns(ends, turn, end_slot, n_turns)


def _per_turn(packed: torch.Tensor, turns: _Turns, at_ends_only: bool) -> torch.Tensor:
    """Per-turn value at the turn's end, or sum over the turn's tokens.
    Shape (b, w + 1) -> (b, t + 1), zero past each row's last turn."""
    out = packed.new_zeros(packed.shape[0], turns.n_turns + 1)
    if at_ends_only:
        out.scatter_(1, turns.end_slot, packed)
        out[:, -1] = 0  # the slot that non-end positions were written to
        return out
    return out.scatter_add_(1, turns.turn, packed)


def _turn_last_positions(turns: _Turns, columns: int) -> torch.Tensor:
    """Packed position of each turn's last token. Shape (b, t + 1): ``columns``
    for turns past a row's last (the free turn included)."""
    positions = torch.arange(columns, device=turns.turn.device).expand_as(turns.turn)
    end_at = torch.full((turns.turn.shape[0], turns.n_turns + 1), columns, dtype=torch.long, device=positions.device)
    end_at.scatter_(1, turns.end_slot, positions)
    end_at[:, -1] = columns  # the slot non-end positions were written to
    return end_at


def _two_level_scan(x: torch.Tensor, turns: _Turns, inside: float, across: float) -> torch.Tensor:
    """A reverse scan whose coefficient is ``inside`` within a turn and ``across`` from a
    turn's last token to the next turn's first::

        y_i = x_i + inside * y_{i+1}     i not a turn end
        y_e = x_e + across * y_{e+1}     e the last token of a turn

    Packed rows, Shape (b, columns) -> (b, columns). Each turn is first scanned on
    its own (a segmented scan); then the value at each turn's first token is
    carried backward across turns, ``Y_t = S(s_t) + inside**(e_t - s_t) * across * Y_{t+1}``
    (a loop over turns, vectorized over rows: never over tokens), and every
    token adds its share of the next turn's ``Y``.
    """
    if inside == across:
        return _scan(x, inside, None)
    columns = x.shape[1]
    end_at = _turn_last_positions(turns, columns)
    within = _scan(x, inside, end_at.gather(1, turns.turn))
    start_at = F.pad(end_at[:, :-1] + 1, (1, 0))  # first position of each turn
    real = start_at < columns
    first = torch.where(real, within.gather(1, start_at.clamp(max=columns - 1)), 0)
    # Powers in the scan's own dtype: float32 keeps ~1e-7 relative error, and a power that underflows
    # to 0 is the right answer.
    base = torch.tensor(inside, dtype=x.dtype, device=x.device)
    carry_coef = base.pow((end_at - start_at).clamp(min=0).to(x.dtype)).mul_(across)
    heads = torch.zeros(x.shape[0], turns.n_turns + 2, dtype=x.dtype, device=x.device)  # Y_t; 0 past the last
    for t in range(turns.n_turns - 1, -1, -1):
        heads[:, t] = first[:, t] + carry_coef[:, t] * heads[:, t + 1]
    position = torch.arange(columns, device=x.device)
    share = base.pow((end_at.gather(1, turns.turn) - position).clamp(min=0).to(x.dtype)).mul_(across)
    return within.add_(share.mul_(heads.gather(1, turns.turn + 1)))


def masked_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    adv_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    turn_end_mask: torch.Tensor | None = None,
    gamma_turn: float | None = None,
    lambda_turn: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the tokens in ``adv_mask`` only.

    With ``k_1 < ... < k_n`` the masked positions of a row and ``V(k_{n+1}) = 0``
    (no bootstrap after the last valid token)::

        delta_m = r(k_m) + g_m * V(k_{m+1}) - V(k_m)
        A(k_m)  = delta_m + g_m * l_m * A(k_{m+1}),     A(k_{n+1}) = 0
        R(k_m)  = A(k_m) + V(k_m)

    ``g_m, l_m = gamma, lam`` from one token to the next inside a turn, and
    ``gamma_turn, lambda_turn`` from a turn's last token to the next turn's first
    (given ``turn_end_mask``; by default the same as inside a turn, which is the
    classic per-token GAE). So ``gamma=1, gamma_turn=0.95`` discounts per env
    turn, whatever the responses' lengths. With all four 1 this is reward-to-go
    minus value. Matches VAGEN's multi-turn GAE (next valid token's value,
    ``lastgaelam`` carried across gaps).

    Args:
        token_rewards: Shape (b, s).
        values: Shape (b, s), critic values.
        adv_mask: Shape (b, s), bool or 0/1.
        gamma, lam: discount and GAE lambda from token to token inside a turn.
        turn_end_mask: Shape (b, s), bool or 0/1: each turn's last token (see the module doc).
        gamma_turn, lambda_turn: discount and lambda from a turn to the next; None: ``gamma``, ``lam``.

    Returns:
        ``(advantages, returns)``, each Shape (b, s), zero outside ``adv_mask``;
        float32 (float64 if an input is float64).
    """
    mask = _as_bool(adv_mask)
    dtype = _float_dtype(token_rewards, values)
    layout = _pack_layout(mask)
    v = _pack(values, layout, dtype)
    r = _pack(token_rewards, layout, dtype)
    gamma_turn = gamma if gamma_turn is None else gamma_turn
    lambda_turn = lam if lambda_turn is None else lambda_turn
    if turn_end_mask is None or (gamma_turn, lambda_turn) == (gamma, lam):
        adv = _scan(_td_errors(r, v, gamma), gamma * lam, None)
    else:
        turns = _packed_turns(turn_end_mask, layout)
        delta = _td_errors(r, v, gamma, turns.ends, gamma_turn)
        adv = _two_level_scan(delta, turns, gamma * lam, gamma_turn * lambda_turn)
    return _unpack(adv, layout), _unpack(adv.add_(v), layout)


def _turn_level_gae(
    turn_rewards: torch.Tensor, turn_values: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE over packed turns. Inputs Shape (b, t + 1), zero past each row's last
    turn (so ``V(e_{T+1}) = 0`` after the last). Returns Shape (b, t + 1)."""
    delta = turn_rewards[:, :-1] + gamma * turn_values[:, 1:] - turn_values[:, :-1]
    return F.pad(discounted_reverse_cumsum(delta, gamma * lam), (0, 1))


def bilevel_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    adv_mask: torch.Tensor,
    turn_end_mask: torch.Tensor,
    gamma_turn: float = 1.0,
    lambda_turn: float = 1.0,
    gamma_token: float = 1.0,
    lambda_token: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VAGEN's bi-level GAE: GAE across turns, then GAE inside each turn.

    Turn level (``e_t`` the last token of turn ``t``, ``V(e_{T+1}) = 0``,
    ``r_t = r(e_t)`` the reward at the turn's last token)::

        delta_t = r_t + gamma_turn * V(e_{t+1}) - V(e_t)
        A_t     = delta_t + gamma_turn * lambda_turn * A_{t+1}

    Token level, backward inside each turn from its end; ``i + 1`` is the next
    token of the turn in ``adv_mask``::

        A(e_t) = A_t
        A(i)   = delta_i + gamma_token * lambda_token * A(i + 1)
        delta_i = r(i) + gamma_token * V(i + 1) - V(i)
        R(i)   = A(i) + V(i)

    ``r(i)`` is zero inside a turn when rewards sit only at turn ends, giving
    ``delta_i = gamma_token * V(i+1) - V(i)``; a per-token reward (a KL penalty)
    enters here, and only the end reward enters the turn level, so nothing is
    counted twice. ``lambda_turn`` acts only across turns and ``lambda_token``
    only inside a turn (the paper's two lambdas); VAGEN's code uses one lambda
    for both, which is ``lambda_turn = lambda_token``.

    Args:
        token_rewards, values: Shape (b, s).
        adv_mask, turn_end_mask: Shape (b, s), bool or 0/1.

    Returns:
        ``(advantages, returns)``, each Shape (b, s), zero outside ``adv_mask``.
    """
    dtype = _float_dtype(token_rewards, values)
    layout = _pack_layout(_as_bool(adv_mask))
    r = _pack(token_rewards, layout, dtype)
    v = _pack(values, layout, dtype)
    turns = _packed_turns(turn_end_mask, layout)
    turn_adv = _turn_level_gae(
        _per_turn(r, turns, True), _per_turn(v, turns, True), gamma_turn, lambda_turn
    )
    # Token level: each token's segment ends at its turn's end; at that end the
    # recursion restarts from the turn-level advantage.
    end_at = _turn_last_positions(turns, layout.columns)
    x = torch.where(turns.ends, turn_adv.gather(1, turns.turn), _td_errors(r, v, gamma_token))
    adv = _scan(x, gamma_token * lambda_token, end_at.gather(1, turns.turn))
    return _unpack(adv, layout), _unpack(adv.add_(v), layout)


def turn_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    adv_mask: torch.Tensor,
    turn_end_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-PPO: GAE over turns, each turn's advantage given to all its tokens.

    A turn is one action of the MDP; its value is the critic's value at the
    turn's last token ``V(e_t)`` and its reward ``r_t`` is the sum of the
    token rewards of the turn's masked tokens (the turn-end reward when rewards
    come from :func:`place_rewards`)::

        delta_t = r_t + gamma * V(e_{t+1}) - V(e_t),      V(e_{T+1}) = 0
        A_t     = delta_t + gamma * lam * A_{t+1}
        A(i)    = A_t,   R(i) = A_t + V(e_t)     for every masked token i of turn t

    Only end-token values enter the estimate, so a trainer may restrict the
    value loss to ``turn_end_mask``; training every token towards ``R`` is also
    consistent.

    Args:
        token_rewards, values: Shape (b, s).
        adv_mask, turn_end_mask: Shape (b, s), bool or 0/1.

    Returns:
        ``(advantages, returns)``, each Shape (b, s), zero outside ``adv_mask``.
    """
    dtype = _float_dtype(token_rewards, values)
    layout = _pack_layout(_as_bool(adv_mask))
    turns = _packed_turns(turn_end_mask, layout)
    turn_values = _per_turn(_pack(values, layout, dtype), turns, True)
    turn_rewards = _per_turn(_pack(token_rewards, layout, dtype), turns, False)
    turn_adv = _turn_level_gae(turn_rewards, turn_values, gamma, lam)
    adv = turn_adv.gather(1, turns.turn)
    ret = (turn_adv + turn_values).gather(1, turns.turn)
    return _unpack(adv, layout), _unpack(ret, layout)


def place_rewards(
    turn_rewards: torch.Tensor,
    turn_end_index: torch.Tensor,
    seq_len: int,
    mode: Placement = "per_turn",
) -> torch.Tensor:
    """Put turn rewards on the token sequence.

    ``per_turn``: ``out[b, turn_end_index[b, t]] += turn_rewards[b, t]``.
    ``episode_end``: the sum of a row's turn rewards at its last turn end (the
    largest index), as RAGEN does for trajectory-level PPO/GRPO.

    Args:
        turn_rewards: Shape (b, t).
        turn_end_index: Shape (b, t), long: position of each turn's last token,
            -1 for padding turns.
        seq_len: s.

    Returns:
        Shape (b, s), float32 (float64 for float64 rewards). Rows without turns
        are zero.
    """
    dtype = _float_dtype(turn_rewards)
    turn_end_index = turn_end_index.long()
    valid = turn_end_index >= 0
    rewards = torch.where(valid, turn_rewards.to(dtype), 0)
    out = torch.zeros(turn_rewards.shape[0], seq_len + 1, dtype=dtype, device=turn_rewards.device)
    if mode == "per_turn":
        out.scatter_add_(1, torch.where(valid, turn_end_index, seq_len), rewards)
    elif mode == "episode_end":
        last = turn_end_index.max(1, keepdim=True).values if turn_end_index.numel() else None
        if last is not None:
            last = torch.where(last >= 0, last, seq_len)
            out.scatter_add_(1, last, rewards.sum(1, keepdim=True))
    else:
        raise ValueError(f"mode must be 'per_turn' or 'episode_end', got {mode!r}")
    return out[:, :seq_len]


def whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
    stats_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalize the masked entries to zero mean and unit variance.

    ``(x - mean) / sqrt(var + eps)`` with the mean and the population variance
    (divided by n, so the output has exactly unit variance) over all masked
    entries of the batch, or over the entries of ``stats_mask`` where given
    (VAGEN's turn-wise GAE takes them over one entry a turn, its reward
    position, and applies them to every token). ``shift_mean=False`` adds the
    mean back. Entries outside the mask are zero; an empty mask, or an empty
    ``stats_mask`` (no statistics to take), gives zeros.

    Args:
        values: any shape, e.g. (b, s). mask, stats_mask: same shape, bool or 0/1.
    """
    m = _as_bool(mask)
    stats = m if stats_mask is None else _as_bool(stats_mask)
    x = torch.where(stats, values, 0)
    n = stats.sum().clamp(min=1)
    mean = x.sum() / n
    var = torch.where(stats, (values - mean) ** 2, 0).sum() / n
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m & stats.any(), out, 0)


class GroupStats(NamedTuple):
    """Per-group statistics of a per-sample score."""

    group_ids: torch.Tensor  # (g,) the distinct group ids, ascending
    inverse: torch.Tensor  # (b,) long: row of each sample in group_ids
    size: torch.Tensor  # (g,) samples per group
    mean: torch.Tensor  # (g,)
    std: torch.Tensor  # (g,) unbiased (n - 1); 0 for groups of one sample
    deviation: torch.Tensor  # (b,) each score minus its group's mean; exactly 0 in a group of equal scores


def group_stats(scores: torch.Tensor, group_index: torch.Tensor) -> GroupStats:
    """Mean and unbiased standard deviation of ``scores`` within each group.

    The std divides by ``n - 1`` (Bessel), as ``torch.std`` and the GRPO code of
    the reference systems do; a group of one sample gets std 0 instead of NaN.

    Exact for equal scores: each group's smallest score is subtracted before
    anything is summed (and the sums run in float64), so a group whose scores
    are all equal has deviations and std of exactly 0. Summing the raw scores
    would not: eight float32 copies of 10.1 have a float32 mean that differs
    from 10.1, and GRPO would divide that rounding error by a std of ~1e-7.

    Args:
        scores: Shape (b,). group_index: Shape (b,), any integer ids.

    Returns:
        float32 statistics (float64 for float64 scores).
    """
    dtype = _float_dtype(scores)
    ids, inverse = torch.unique(group_index, sorted=True, return_inverse=True)
    g = ids.numel()
    x = scores.to(torch.float64)
    # The anchor is the group's smallest score, not its first: groups holding the same scores in
    # another order then get the same statistics to the last bit (filters break ties on them).
    anchor = torch.full((g,), torch.inf, dtype=torch.float64, device=x.device).scatter_reduce_(0, inverse, x, "amin")
    offset = x - anchor[inverse]  # 0 for every member of a group of equal scores
    count = torch.zeros(g, dtype=torch.float64, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    mean_offset = torch.zeros_like(count).index_add_(0, inverse, offset) / count
    deviation = offset - mean_offset[inverse]
    sq = torch.zeros_like(count).index_add_(0, inverse, deviation**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    mean = anchor + mean_offset
    return GroupStats(ids, inverse, count.to(dtype), mean.to(dtype), std.to(dtype), deviation.to(dtype))


def grpo_advantages(
    scores: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """GRPO / Dr.GRPO outcome advantages, one per sequence.

    ``A_i = (r_i - mean_G(r)) / (std_G(r) + eps)`` with ``G`` the group of
    sample ``i`` and the unbiased std of :func:`group_stats`;
    ``norm_by_std=False`` gives Dr.GRPO's ``A_i = r_i - mean_G(r)``. A group of
    one sample gets 0 (its mean is its own score; veRL gives the raw score
    instead); a group of equal scores gets exactly 0.

    Args:
        scores: Shape (b,), the sequence rewards. group_index: Shape (b,).

    Returns:
        Shape (b,). Use :func:`broadcast_to_tokens` to spread it on tokens.
    """
    st = group_stats(scores, group_index)
    if not norm_by_std:
        return st.deviation
    return st.deviation / (st.std[st.inverse] + eps)


def rloo_advantages(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out: the baseline is the mean of the other samples.

    ``A_i = r_i - (sum_G(r) - r_i) / (n_G - 1) = n_G / (n_G - 1) * (r_i - mean_G(r))``;
    0 for a group of one sample (no other sample to compare with).

    Args:
        scores: Shape (b,). group_index: Shape (b,).

    Returns:
        Shape (b,).
    """
    st = group_stats(scores, group_index)
    n = st.size[st.inverse]
    return st.deviation * n / (n - 1).clamp(min=1)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    adv_mask: torch.Tensor,
    gamma: float = 1.0,
    turn_end_mask: torch.Tensor | None = None,
    gamma_turn: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over all masked tokens of the batch.

    With ``k_1 < ... < k_n`` the masked positions of a row::

        G(k_m) = r(k_m) + g_m * G(k_{m+1}),     G(k_{n+1}) = 0
        A      = whiten(G, adv_mask)              (see :func:`whiten`)

    ``g_m = gamma`` inside a turn and ``gamma_turn`` from a turn's last token to
    the next turn's first (given ``turn_end_mask``; None: ``gamma``). The return
    passes through unmasked tokens (veRL resets it there, which cuts a
    multi-turn episode into unrelated pieces).

    Args:
        token_rewards: Shape (b, s). adv_mask, turn_end_mask: Shape (b, s), bool or 0/1.

    Returns:
        ``(advantages, returns)``, each Shape (b, s), zero outside ``adv_mask``.
    """
    mask = _as_bool(adv_mask)
    layout = _pack_layout(mask)
    rewards = _pack(token_rewards, layout, _float_dtype(token_rewards))
    if turn_end_mask is None or gamma_turn is None or gamma_turn == gamma:
        packed = _scan(rewards, gamma, None)
    else:
        packed = _two_level_scan(rewards, _packed_turns(turn_end_mask, layout), gamma, gamma_turn)
    returns = _unpack(packed, layout)
    return whiten(returns, mask), returns


def broadcast_to_tokens(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give each sequence's advantage to its masked tokens.

    Args:
        seq_adv: Shape (b,). mask: Shape (b, s), bool or 0/1.

    Returns:
        Shape (b, s): ``seq_adv[b]`` where ``mask`` is set, 0 elsewhere.
    """
    return torch.where(_as_bool(mask), seq_adv[:, None], 0).to(seq_adv.dtype)


def gigpo_advantages(
    turn_rewards: torch.Tensor,
    turn_valid: torch.Tensor,
    turn_states: torch.Tensor,
    group_index: torch.Tensor,
    gamma: float = 0.95,
    step_weight: float = 1.0,
    norm_by_std: bool = False,
    eps: float = 1e-6,
    episode_stats: EpisodeStats = "episodes",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO: an episode advantage from the group, plus a step advantage from anchor-state groups.

    Notation: e episodes, T turns (padded). The episode advantage is GRPO's on the total reward,
    ``(R_i - mean_G R) / F_G``, with the mean and std over the group's episodes (``episode_stats="episodes"``,
    the paper's formula) or over the group's valid turns, each carrying its episode's total
    (``"turns"``: verl-agent's code, whose every turn is a sample holding the episode reward and whose
    ``compute_mean_std_cross_all_data`` defaults to true; an episode of many turns weighs more). Every valid
    turn ``(i, t)`` belongs to the anchor group of the turns of its episode group that start from the same env
    state; its discounted return
    ``G_it = sum_k gamma^k r_i(t+k)`` is compared with that anchor group's mean: ``(G_it - mean_A G) / F_A``.
    ``F`` is 1 (``mean_norm``, verl-agent's default), or with ``norm_by_std`` the unbiased std (plus
    ``eps``). An anchor group of one turn, or a turn whose state is unknown (-1), gets a step advantage of 0.
    A turn's advantage is ``episode + step_weight * step``.

    Args:
        turn_rewards: Shape (e, T), each turn's reward (0 on padding turns).
        turn_valid: Shape (e, T), bool: the episode's real turns (a prefix of each row).
        turn_states: Shape (e, T), long: an id of the state each turn started from, equal ids for equal
            states within a group; -1 for unknown.
        group_index: Shape (e,), the episode groups.
        episode_stats: ``episodes`` or ``turns``: what the episode advantage's group mean and std run over.

    Returns:
        advantages Shape (e, T) (0 on padding turns) and the step advantages alone, Shape (e, T).
    """
    valid = _as_bool(turn_valid)
    rewards = torch.where(valid, turn_rewards.to(torch.float64), 0.0)
    episode = _gigpo_episode_advantages(rewards.sum(1), valid, group_index, eps, norm_by_std, episode_stats)
    returns = discounted_reverse_cumsum(rewards, gamma)  # padding turns are 0 and come after the real ones
    known = valid & (turn_states >= 0)
    step = torch.zeros_like(rewards)
    if bool(known.any()):
        rows, turns = known.nonzero(as_tuple=True)
        keys = torch.stack([group_index[rows].to(torch.long), turn_states[rows, turns].to(torch.long)], dim=1)
        _, anchor = torch.unique(keys, dim=0, return_inverse=True)
        stats = group_stats(returns[rows, turns], anchor)
        deviation = stats.deviation.to(torch.float64)
        if norm_by_std:
            deviation = deviation / (stats.std.to(torch.float64)[stats.inverse] + eps)
        step[rows, turns] = torch.where(stats.size[stats.inverse] > 1, deviation, 0.0)
    advantages = torch.where(valid, episode[:, None] + step_weight * step, 0.0)
    return advantages.to(_float_dtype(turn_rewards)), step.to(_float_dtype(turn_rewards))


def _gigpo_episode_advantages(
    totals: torch.Tensor, valid: torch.Tensor, group_index: torch.Tensor, eps: float, norm_by_std: bool,
    over: EpisodeStats,
) -> torch.Tensor:
    """GiGPO's episode advantages, Shape (e,) float64, from the totals Shape (e,) and the valid turns Shape (e, T);
    see :func:`gigpo_advantages` for ``over``. An episode without valid turns gets 0 under ``turns``."""
    if over == "episodes":
        return grpo_advantages(totals, group_index, eps=eps, norm_by_std=norm_by_std).to(torch.float64)
    if over != "turns":
        raise ValueError(f"episode_stats must be 'episodes' or 'turns', got {over!r}")
    rows = valid.nonzero(as_tuple=True)[0]  # one entry per valid turn: its episode
    per_turn = grpo_advantages(totals[rows], group_index[rows], eps=eps, norm_by_std=norm_by_std)
    # Every turn of an episode carries the same total, so all its entries hold the same advantage.
    return torch.zeros_like(totals).index_put_((rows,), per_turn.to(torch.float64))


def anchored_share(turn_states: torch.Tensor, group_index: torch.Tensor) -> float:
    """The share of known turns whose anchor group (same group, same start state) holds at least two turns:
    the turns :func:`gigpo_advantages` gives a step advantage.

    Args:
        turn_states: Shape (e, T), long: each turn's start state, -1 for unknown or padding turns.
        group_index: Shape (e,).

    Returns:
        A share in [0, 1]; 0 without known turns.
    """
    rows, turns = (turn_states >= 0).nonzero(as_tuple=True)
    if len(rows) == 0:
        return 0.0
    keys = torch.stack([group_index[rows], turn_states[rows, turns]], dim=1)
    _, inverse, counts = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    return float((counts[inverse] > 1).float().mean())
