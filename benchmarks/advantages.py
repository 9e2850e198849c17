"""Vectorized advantage estimators against their plain Python loop references.

Builds a batch shaped like a multi-turn rollout (default [512, 4096], 10 turns:
a prompt, then per turn a response in the advantage mask followed by
observation tokens outside it, rewards at each response's last token), times
masked GAE (one discount, and a discount of its own across turns), bi-level
GAE and GRPO, and prints a table with the speedups.

The loop references (tests/algorithms/reference.py) take seconds per row batch,
so they are timed on a subset of rows and scaled linearly to the full batch
(they are linear in the number of rows); the table says when that happened.
Both sides include their own input conversion. Each timing is the fastest of
several calls after a warm-up (on CUDA, with synchronization).

    python benchmarks/advantages.py              # [512, 4096], 10 turns, CPU
    python benchmarks/advantages.py --quick      # [64, 1024], a few seconds
    python benchmarks/advantages.py --device cuda
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.algorithms import reference as ref  # noqa: E402
from turnrl.algorithms import (  # noqa: E402
    bilevel_gae,
    broadcast_to_tokens,
    grpo_advantages,
    masked_gae,
    place_rewards,
)


def make_batch(b: int, s: int, turns: int, group_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A padded multi-turn batch: prompt, then `turns` x (response, observation).

    Response and observation lengths vary by row; some rows stop early (fewer
    turns) and leave right padding, as finished episodes do.
    """
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, max(high, low + 1), (1,), generator=gen))

    adv_mask = torch.zeros(b, s, dtype=torch.bool)
    turn_end_index = torch.full((b, turns), -1, dtype=torch.long)
    prompt_len = s // 16
    budget = (s - prompt_len) // turns  # per turn: response + observation
    for row in range(b):  # building the batch is setup, not the measured work
        pos = randint(prompt_len // 2, prompt_len)
        for t in range(randint(max(1, turns // 2), turns + 1)):  # some episodes end early
            resp = randint(budget // 5, budget * 7 // 10)
            if pos + resp > s:
                break
            adv_mask[row, pos : pos + resp] = True
            turn_end_index[row, t] = pos + resp - 1
            pos += resp + randint(budget // 5, budget * 3 // 10)  # observation
    turn_rewards = torch.randn(b, turns, generator=gen)
    turn_end_mask = torch.zeros(b, s + 1, dtype=torch.bool)
    turn_end_mask.scatter_(1, torch.where(turn_end_index >= 0, turn_end_index, s), True)
    return {
        "token_rewards": place_rewards(turn_rewards, turn_end_index, s),
        "values": torch.randn(b, s, generator=gen),
        "adv_mask": adv_mask,
        "turn_end_mask": turn_end_mask[:, :s],
        "scores": torch.randn(b, generator=gen),
        "group_index": torch.arange(b) // group_size,
    }


def time_fn(fn, device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls of `fn()` after one warm-up call (the
    minimum is the least disturbed by other work on a shared machine)."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batch, a few seconds")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--ref-rows", type=int, default=None, help="rows timed for the loop references")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    b = args.batch or (64 if args.quick else 512)
    s = args.seq or (1024 if args.quick else 4096)
    ref_rows = min(b, args.ref_rows or (16 if args.quick else 32))
    repeats = args.repeats or (5 if args.quick else 10)
    device = torch.device(args.device)

    batch = make_batch(b, s, args.turns, group_size=8)
    on_dev = {k: v.to(device) for k, v in batch.items()}
    sub = {k: v[:ref_rows] for k, v in batch.items()}
    gamma, lam = 0.99, 0.95
    cases = [
        (
            "masked_gae",
            lambda: masked_gae(on_dev["token_rewards"], on_dev["values"], on_dev["adv_mask"], gamma, lam),
            lambda: ref.ref_masked_gae(sub["token_rewards"], sub["values"], sub["adv_mask"], gamma, lam),
            ref_rows,
        ),
        (
            "gae_turns",  # masked GAE with its own discount across turns (a loop over turns, not tokens)
            lambda: masked_gae(on_dev["token_rewards"], on_dev["values"], on_dev["adv_mask"], 1.0, lam,
                               turn_end_mask=on_dev["turn_end_mask"], gamma_turn=gamma, lambda_turn=lam),
            lambda: ref.ref_masked_gae(sub["token_rewards"], sub["values"], sub["adv_mask"], 1.0, lam,
                                       sub["turn_end_mask"], gamma, lam),
            ref_rows,
        ),
        (
            "bilevel_gae",
            lambda: bilevel_gae(
                on_dev["token_rewards"], on_dev["values"], on_dev["adv_mask"], on_dev["turn_end_mask"],
                gamma, lam, 1.0, lam,
            ),
            lambda: ref.ref_bilevel_gae(
                sub["token_rewards"], sub["values"], sub["adv_mask"], sub["turn_end_mask"], gamma, lam, 1.0, lam
            ),
            ref_rows,
        ),
        (
            "grpo",  # group-normalized scores, then spread on the masked tokens
            lambda: broadcast_to_tokens(grpo_advantages(on_dev["scores"], on_dev["group_index"]), on_dev["adv_mask"]),
            lambda: ref.ref_broadcast(ref.ref_grpo(sub["scores"], sub["group_index"], 1e-6), sub["adv_mask"]),
            ref_rows,
        ),
    ]

    n_turns = int((batch["turn_end_mask"]).sum(1).float().mean())
    print(f"batch [{b}, {s}], up to {args.turns} turns (mean {n_turns}), "
          f"{int(batch['adv_mask'].sum())} tokens in the advantage mask")
    print(f"device {device}; host: {os.cpu_count()} CPUs, {cpu_model()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'estimator':<12} {'vectorized':>12} {'loop ref':>12} {'ref rows':>9} {'speedup':>9}")
    for name, fast, slow, rows in cases:
        t_fast = time_fn(fast, device, repeats)
        t_slow = time_fn(slow, torch.device("cpu"), 3) * (b / rows)
        scaled = "" if rows == b else f" (timed on {rows} rows, scaled x{b / rows:g})"
        print(f"{name:<12} {t_fast * 1e3:>10.2f}ms {t_slow * 1e3:>10.0f}ms {rows:>9} "
              f"{t_slow / t_fast:>8.0f}x{scaled}")


if __name__ == "__main__":
    main()
