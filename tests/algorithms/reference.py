"""Plain Python loop references for turnrl.algorithms.

Each function here follows the definition in the docstring of the function it
checks, one token (or one group) at a time, on Python floats (double
precision). They are slow on purpose: simple enough to verify by reading. The
tests compare the vectorized functions with them, and the benchmark times them.

Inputs are tensors (converted with ``tolist``) so that tests and benchmark call
them exactly like the functions they check; outputs are tensors of float64.
"""

from __future__ import annotations

import math

import torch


def _rows(*tensors: torch.Tensor) -> list[list]:
    return [t.tolist() for t in tensors]


def _out(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def ref_place_rewards(turn_rewards, turn_end_index, seq_len, mode="per_turn"):
    rewards, index = _rows(turn_rewards, turn_end_index)
    out = [[0.0] * seq_len for _ in rewards]
    for b, (rs, idx) in enumerate(zip(rewards, index)):
        valid = [(r, i) for r, i in zip(rs, idx) if i >= 0]
        if mode == "per_turn":
            for r, i in valid:
                out[b][i] += r
        elif valid:
            out[b][max(i for _, i in valid)] += sum(r for r, _ in valid)
    return _out(out)


def ref_masked_gae(token_rewards, values, adv_mask, gamma, lam, turn_end_mask=None, gamma_turn=None, lambda_turn=None):
    """Per-token GAE; the step from a turn's last token to the next token uses gamma_turn, lambda_turn."""
    rewards, vals, mask = _rows(token_rewards, values, adv_mask)
    ends = turn_end_mask.tolist() if turn_end_mask is not None else [[False] * len(r) for r in rewards]
    gamma_turn = gamma if gamma_turn is None else gamma_turn
    lambda_turn = lam if lambda_turn is None else lambda_turn
    advs, rets = [], []
    for r, v, m, e in zip(rewards, vals, mask, ends):
        adv = [0.0] * len(r)
        ret = [0.0] * len(r)
        next_value, last = 0.0, 0.0
        for i in range(len(r) - 1, -1, -1):
            if not m[i]:
                continue  # skipped: value and advantage pass through
            g, lm = (gamma_turn, lambda_turn) if e[i] else (gamma, lam)
            delta = r[i] + g * next_value - v[i]
            last = delta + g * lm * last
            adv[i], ret[i] = last, last + v[i]
            next_value = v[i]
        advs.append(adv)
        rets.append(ret)
    return _out(advs), _out(rets)


def _turns_of_row(m, e):
    """Lists of masked positions, one list per turn (the last masked token ends a turn)."""
    turns, current = [], []
    for i in range(len(m)):
        if not m[i]:
            continue
        current.append(i)
        if e[i]:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return turns


def _turn_gae_row(turn_rewards, turn_values, gamma, lam):
    adv = [0.0] * len(turn_rewards)
    last, next_value = 0.0, 0.0
    for t in range(len(turn_rewards) - 1, -1, -1):
        delta = turn_rewards[t] + gamma * next_value - turn_values[t]
        last = delta + gamma * lam * last
        adv[t] = last
        next_value = turn_values[t]
    return adv


def ref_bilevel_gae(
    token_rewards, values, adv_mask, turn_end_mask, gamma_turn, lambda_turn, gamma_token, lambda_token
):
    rewards, vals, mask, end = _rows(token_rewards, values, adv_mask, turn_end_mask)
    advs, rets = [], []
    for r, v, m, e in zip(rewards, vals, mask, end):
        turns = _turns_of_row(m, e)
        turn_adv = _turn_gae_row(
            [r[tok[-1]] for tok in turns], [v[tok[-1]] for tok in turns], gamma_turn, lambda_turn
        )
        adv = [0.0] * len(r)
        ret = [0.0] * len(r)
        for tokens, a_turn in zip(turns, turn_adv):
            last = a_turn
            adv[tokens[-1]] = a_turn
            for k in range(len(tokens) - 2, -1, -1):
                i, nxt = tokens[k], tokens[k + 1]
                delta = r[i] + gamma_token * v[nxt] - v[i]
                last = delta + gamma_token * lambda_token * last
                adv[i] = last
            for i in tokens:
                ret[i] = adv[i] + v[i]
        advs.append(adv)
        rets.append(ret)
    return _out(advs), _out(rets)


def ref_turn_gae(token_rewards, values, adv_mask, turn_end_mask, gamma, lam):
    rewards, vals, mask, end = _rows(token_rewards, values, adv_mask, turn_end_mask)
    advs, rets = [], []
    for r, v, m, e in zip(rewards, vals, mask, end):
        turns = _turns_of_row(m, e)
        turn_values = [v[tok[-1]] for tok in turns]
        turn_adv = _turn_gae_row([sum(r[i] for i in tok) for tok in turns], turn_values, gamma, lam)
        adv = [0.0] * len(r)
        ret = [0.0] * len(r)
        for tokens, a, tv in zip(turns, turn_adv, turn_values):
            for i in tokens:
                adv[i], ret[i] = a, a + tv
        advs.append(adv)
        rets.append(ret)
    return _out(advs), _out(rets)


def _groups(scores, group_index):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_index.tolist()):
        groups.setdefault(g, []).append(i)
    return scores.tolist(), groups


def _mean_std(xs):
    """Mean and unbiased std. The spread is taken around the smallest value first (the same numbers),
    so groups that hold the same values in any order, or shifted by a constant, get the same std to the
    last bit: select_groups breaks ties on it."""
    low = min(xs)
    shifted = [x - low for x in xs]
    mean = sum(shifted) / len(xs)
    if len(xs) < 2:
        return low + mean, 0.0
    return low + mean, math.sqrt(sum((x - mean) ** 2 for x in shifted) / (len(xs) - 1))


def ref_grpo(scores, group_index, eps, norm_by_std=True):
    xs, groups = _groups(scores, group_index)
    out = [0.0] * len(xs)
    for members in groups.values():
        mean, std = _mean_std([xs[i] for i in members])
        for i in members:
            out[i] = (xs[i] - mean) / (std + eps) if norm_by_std else xs[i] - mean
    return torch.tensor(out, dtype=torch.float64)


def ref_broadcast(seq_adv, mask):
    advs, m = _rows(seq_adv, mask)
    return _out([[a if k else 0.0 for k in row] for a, row in zip(advs, m)])


def ref_rloo(scores, group_index):
    xs, groups = _groups(scores, group_index)
    out = [0.0] * len(xs)
    for members in groups.values():
        for i in members:
            others = [xs[j] for j in members if j != i]
            out[i] = xs[i] - sum(others) / len(others) if others else 0.0
    return torch.tensor(out, dtype=torch.float64)


def ref_whiten(values, mask, eps=1e-8):
    vals, m = _rows(values, mask)
    picked = [x for row, mr in zip(vals, m) for x, k in zip(row, mr) if k]
    if not picked:
        return _out([[0.0] * len(row) for row in vals])
    mean = sum(picked) / len(picked)
    std = math.sqrt(sum((x - mean) ** 2 for x in picked) / len(picked) + eps)
    return _out([[(x - mean) / std if k else 0.0 for x, k in zip(row, mr)] for row, mr in zip(vals, m)])


def ref_reinforce_pp(token_rewards, adv_mask, gamma, turn_end_mask=None, gamma_turn=None):
    rewards, mask = _rows(token_rewards, adv_mask)
    ends = turn_end_mask.tolist() if turn_end_mask is not None else [[False] * len(r) for r in rewards]
    gamma_turn = gamma if gamma_turn is None else gamma_turn
    rets = []
    for r, m, e in zip(rewards, mask, ends):
        ret = [0.0] * len(r)
        g = 0.0
        for i in range(len(r) - 1, -1, -1):
            if m[i]:
                g = r[i] + (gamma_turn if e[i] else gamma) * g
                ret[i] = g
        rets.append(ret)
    returns = _out(rets)
    return ref_whiten(returns, adv_mask), returns


def ref_aggregate(per_token, mask, mode):
    xs, m = _rows(per_token, mask)
    if mode == "token-mean":
        picked = [x for row, mr in zip(xs, m) for x, k in zip(row, mr) if k]
        return sum(picked) / len(picked) if picked else 0.0
    seqs = []
    for row, mr in zip(xs, m):
        picked = [x for x, k in zip(row, mr) if k]
        if picked:
            seqs.append(sum(picked) / len(picked) if mode == "seq-mean-token-mean" else sum(picked))
    return sum(seqs) / len(seqs) if seqs else 0.0


def ref_ppo_token_loss(logprob, old_logprob, advantage, clip_low, clip_high, dual_clip):
    """One token's clipped (and dual-clipped) PPO loss."""
    ratio = math.exp(logprob - old_logprob)
    unclipped = -advantage * ratio
    clipped = -advantage * min(max(ratio, 1 - clip_low), 1 + clip_high)
    loss = max(unclipped, clipped)
    if dual_clip is not None and advantage < 0:
        loss = min(loss, -advantage * dual_clip)
    return loss


def ref_kl(logprob, ref_logprob, kind):
    if kind == "k1":
        return logprob - ref_logprob
    if kind == "k2":
        return 0.5 * (logprob - ref_logprob) ** 2
    d = min(max(ref_logprob - logprob, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1, -10.0), 10.0)


def ref_entropy(logits_row):
    top = max(logits_row)
    exps = [math.exp(z - top) for z in logits_row]
    total = sum(exps)
    return -sum((e / total) * math.log(e / total) for e in exps if e > 0)


def ref_select(group_index, rewards, scores, strategy, value, weighting, temperature, largest, drop_zero):
    """Kept group ids (ascending) by the rules of select_groups, with plain sorting."""
    ids = sorted(set(group_index.tolist()))
    members = {g: [i for i, x in enumerate(group_index.tolist()) if x == g] for g in ids}
    xs = rewards.tolist() if rewards is not None else None
    if scores is None:
        score = {g: _mean_std([xs[i] for i in members[g]])[1] for g in ids}
    else:
        score = dict(zip(ids, scores.tolist()))
    candidates = [g for g in ids if not drop_zero or _mean_std([xs[i] for i in members[g]])[1] > 1e-8]
    sign = 1.0 if largest else -1.0
    ranked = sorted(candidates, key=lambda g: (-sign * score[g], g))
    if not ranked:
        return []
    if strategy == "none":
        kept = ranked
    elif strategy == "top_k":
        k = value if isinstance(value, int) else max(1, int(value * len(ids)))
        kept = ranked[:k]
    elif strategy == "top_p":
        keys = [sign * score[g] for g in ranked]
        if value >= 1:  # RAGEN keeps every group, whatever the weighting
            return sorted(ranked)
        if weighting == "linear":  # RAGEN: positive scores until they sum to value * total - 0.01, else none
            threshold, taken, kept = value * sum(keys) - 0.01, 0.0, []
            for g, k in zip(ranked, keys):
                if taken >= threshold or k <= 0:
                    break
                kept.append(g)
                taken += k
            return sorted(kept) if taken >= threshold else []
        else:
            top = max(keys)
            exps = [math.exp((k - top) / temperature) for k in keys]
            weights = [e / sum(exps) for e in exps]
        kept, cumulative = [], 0.0
        for g, w in zip(ranked, weights):
            if kept and cumulative >= value - 1e-9:
                break
            kept.append(g)
            cumulative += w
    else:  # min_p
        vals = [score[g] for g in ranked]
        kept = [g for g in ranked if (score[g] >= value * max(vals) if largest else score[g] <= min(vals) / value)]
    return sorted(kept)


def ref_whiten_with(values, mask, stats_mask, shift_mean=True, eps=1e-8):
    """``whiten`` with the mean and population variance taken over ``stats_mask`` (VAGEN's turn-wise GAE: one
    entry a turn) and applied to every entry of ``mask``; ``shift_mean=False`` adds the mean back (veRL's
    masked_whiten). No statistics (an empty ``stats_mask``) give zeros, as an empty ``mask`` does."""
    vals, m, s = _rows(values, mask, stats_mask)
    picked = [x for row, sr in zip(vals, s) for x, k in zip(row, sr) if k]
    if not picked:
        return _out([[0.0] * len(row) for row in vals])
    mean = sum(picked) / len(picked)
    std = math.sqrt(sum((x - mean) ** 2 for x in picked) / len(picked) + eps)
    back = 0.0 if shift_mean else mean
    return _out([[(x - mean) / std + back if k else 0.0 for x, k in zip(row, mr)] for row, mr in zip(vals, m)])


def ref_ppo_token(logprob, old_logprob, advantage, clip_low, clip_high, dual_clip):
    """One token of the clipped surrogate (Schulman et al. 2017, Eq. 7, with DAPO's asymmetric clip) and the dual
    clip (Ye et al. 2020, Eq. 5), as veRL's compute_policy_loss writes them, with the log-ratio clamped to
    [-20, 20]. Returns ``(loss, clipped, dual_clipped, approx_kl)``: ``clipped`` where the clipped term is the
    larger (veRL's pg_clipfrac), ``dual_clipped`` where the dual bound replaced the loss (pg_clipfrac_lower),
    ``approx_kl = (r - 1) - log r``, Schulman's k3 estimate of KL(old || new) on samples from old."""
    log_ratio = min(max(logprob - old_logprob, -20.0), 20.0)
    ratio = math.exp(log_ratio)
    unclipped = -advantage * ratio
    clipped = -advantage * min(max(ratio, 1 - clip_low), 1 + clip_high)
    loss = max(unclipped, clipped)
    dual = dual_clip is not None and advantage < 0 and loss > -advantage * dual_clip
    if dual:
        loss = -advantage * dual_clip
    return loss, clipped > unclipped, dual, ratio - 1 - log_ratio


def ref_value_token(value, old_value, ret, clip):
    """One token of PPO2's clipped value loss (OpenAI baselines ppo2, veRL's compute_value_loss):
    ``0.5 * max((v - R)^2, (v_clip - R)^2)``, ``v_clip = old + clip(v - old, -c, c)``. Inside the range v_clip is
    v itself (written so, not as ``old + (v - old)``, which rounds). Returns ``(loss, clipped, error)``."""
    error = (value - ret) ** 2
    if clip is None or abs(value - old_value) <= clip:
        return 0.5 * error, False, error
    clipped_error = (old_value + math.copysign(clip, value - old_value) - ret) ** 2
    return 0.5 * max(error, clipped_error), clipped_error > error, error


def ref_tis_weight(trainer_logprob, sampler_logprob, cap):
    """Truncated importance weight ``min(pi_trainer / pi_sampler, C)`` (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"), the log-ratio clamped at 20 before the exp."""
    return min(math.exp(min(trainer_logprob - sampler_logprob, 20.0)), cap)


def ref_gspo_loss(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip):
    """GSPO's objective (Zheng et al. 2025, Eq. 5-7) as a loss: the mean over the sequences with tokens of
    ``max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high))`` with ``s_i = exp(mean_t log(pi / pi_old))``, A_i the
    sequence's advantage (its first masked token's) and, where given, the dual clip of a negative advantage.
    Returns ``(loss, grad)``: ``grad`` the gradient with respect to each token's log-prob from the paper's Eq. 10,
    ``s_i A_i / |y_i|`` per token of a sequence whose unclipped term is active, 0 where a clip is, over the
    number of sequences."""
    lps, olds, advs, m = _rows(logprobs, old_logprobs, advantages, mask)
    losses, grads = [], [[0.0] * len(row) for row in lps]
    rows = [b for b in range(len(lps)) if any(m[b])]
    for b in rows:
        tokens = [i for i, k in enumerate(m[b]) if k]
        s = math.exp(sum(lps[b][i] - olds[b][i] for i in tokens) / len(tokens))
        a = advs[b][tokens[0]]
        unclipped, clipped = -a * s, -a * min(max(s, 1 - clip_low), 1 + clip_high)
        loss, active = max(unclipped, clipped), unclipped >= clipped
        if dual_clip is not None and a < 0 and loss > -a * dual_clip:
            loss, active = -a * dual_clip, False
        losses.append(loss)
        for i in tokens:
            grads[b][i] = -a * s / len(tokens) / len(rows) if active else 0.0
    return (sum(losses) / len(rows) if rows else 0.0), _out(grads)


def ref_anchored_share(turn_states, group_index):
    """Share of known turns (state >= 0) that share their group and start state with another turn."""
    states, groups = turn_states.tolist(), group_index.tolist()
    known = [(groups[e], s) for e, row in enumerate(states) for s in row if s >= 0]
    if not known:
        return 0.0
    return sum(1 for key in known if known.count(key) > 1) / len(known)


def ref_aggregate_weights(mask, mode):
    """The weight of each token's term in ``ref_aggregate`` (its derivative): 1 / tokens for token-mean,
    1 / (row tokens * rows with tokens) for seq-mean-token-mean, 1 / rows with tokens for seq-mean-token-sum."""
    m = mask.tolist()
    tokens = sum(1 for row in m for k in row if k)
    rows = sum(1 for row in m if any(row))
    out = []
    for row in m:
        n = sum(1 for k in row if k)
        if mode == "token-mean":
            w = 1 / tokens if tokens else 0.0
        elif mode == "seq-mean-token-mean":
            w = 1 / (n * rows) if n else 0.0
        else:
            w = 1 / rows if rows else 0.0
        out.append([w if k else 0.0 for k in row])
    return _out(out)
