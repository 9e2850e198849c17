"""Multi-turn generation: KV reuse against re-prefilling the history, and turns that never wait.

Synthetic episodes with the shape of an agent rollout: a first prompt of
``--prompt`` tokens, then ``--turns`` turns, each a response of a random
length between 8 and ``--new`` tokens (as responses vary in a real rollout)
and an observation of ``--obs`` tokens that the next prompt appends. The same
episodes (same lengths, same tokens) are played three ways by turnrl's engine:

- ``rounds, re-prefill``: every turn waits for all episodes, and each prompt is
  prefilled whole (what a generate call per turn does, as in RAGEN and VAGEN).
- ``rounds, KV reuse``: every turn waits for all episodes; each prompt
  prefills only the tokens after its cached history.
- ``no wait, KV reuse``: an episode's next turn is submitted as soon as its
  response is done, while the others are still decoding.

Prefill tokens, generated tokens and wall time are printed with the speedup
against the first row.

    python benchmarks/multiturn.py --device cuda     # 0.5B, 256 episodes x 10 turns
    python benchmarks/multiturn.py --quick           # CPU-sized, the small preset
"""

from __future__ import annotations

import argparse
import cProfile
import platform
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generation import SHAPES, build  # noqa: E402
from benchmarks.timing import synchronize  # noqa: E402
from turnrl.config import EngineConfig  # noqa: E402
from turnrl.engine.llm_engine import Engine, EngineStats, SamplingParams  # noqa: E402
from turnrl.engine.model_runner import Launched  # noqa: E402
from turnrl.engine.scheduler import PrefillChunk  # noqa: E402


def episodes_plan(episodes: int, turns: int, prompt: int, obs: int, new: int, vocab: int, seed: int = 0):
    """First prompts, observations and response lengths of every episode, fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab, (episodes, prompt), generator=generator).tolist()
    observations = torch.randint(0, vocab, (episodes, turns, obs), generator=generator).tolist()
    lengths = torch.randint(8, new + 1, (episodes, turns), generator=generator).tolist()
    return first, observations, lengths


def play(engine: Engine, plan, turns: int, wait: bool, reuse: bool) -> int:
    """Play every episode; returns the tokens generated."""
    first, observations, lengths = plan
    prompts = [list(p) for p in first]
    turn = [0] * len(prompts)
    generated = 0

    def submit(e: int) -> int:
        params = SamplingParams(temperature=1.0, max_new_tokens=lengths[e][turn[e]])
        return engine.submit(prompts[e], params)

    def record(e: int, tokens: list[int]) -> None:
        nonlocal generated
        generated += len(tokens)
        prompts[e] = prompts[e] + tokens + observations[e][turn[e]]
        turn[e] += 1

    if wait:
        for _ in range(turns):
            if not reuse:
                engine.table.clear()
            results = engine.generate(prompts, [SamplingParams(temperature=1.0, max_new_tokens=lengths[e][turn[e]])
                                                for e in range(len(prompts))])
            for e, result in enumerate(results):
                record(e, result.token_ids)
        return generated
    owner = {submit(e): e for e in range(len(prompts))}
    while owner:
        for result in engine.step():
            e = owner.pop(result.id)
            record(e, result.token_ids)
            if turn[e] < turns:
                owner[submit(e)] = e
    return generated


def time_prefill_calls(engine: Engine, device: torch.device) -> list[tuple[float, int, int]]:
    """Time each of ``engine``'s prefill calls from now on; returns a list it appends (seconds, sequences,
    longest new tokens) to."""
    calls: list[tuple[float, int, int]] = []
    prefill = engine.runner.prefill

    def timed(chunk: PrefillChunk) -> Launched:
        longest = max(len(s.prompt) - s.cached for s in chunk.sequences)
        synchronize(device)
        start = time.perf_counter()
        launched = prefill(chunk)
        synchronize(device)  # the call's GPU work done (its tokens are read by the engine later)
        calls.append((time.perf_counter() - start, len(chunk.sequences), longest))
        return launched

    engine.runner.prefill = timed  # type: ignore[method-assign]
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="CPU-sized: small preset, 32 episodes x 5 turns")
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--obs", type=int, default=48)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--profile", action="store_true",
                        help="after the table, cProfile each mode's play (host time by function, cumulative)")
    parser.add_argument("--triton", default="auto", choices=["auto", "true", "false"],
                        help="the engine's Triton kernels (model.engine.triton)")
    args = parser.parse_args()
    device = torch.device(args.device)
    quick = args.quick or device.type == "cpu"
    preset = "small" if quick else "0.5b"
    episodes = args.episodes or (32 if quick else 256)
    turns = args.turns or (5 if quick else 10)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(preset, device, dtype)
    plan = episodes_plan(episodes, turns, args.prompt, args.obs, args.new, SHAPES[preset]["vocab_size"])
    max_len = args.prompt + turns * (args.obs + args.new) + 1
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    print(f"{preset} Qwen2, {dtype}, {episodes} episodes x {turns} turns (prompt {args.prompt}, observations "
          f"{args.obs}, responses 8-{args.new} tokens), triton {args.triton}, on {name} "
          f"(torch {torch.__version__})")
    print(f"{'mode':<20} {'prefill tokens':>15} {'calls':>6} {'decode steps':>12} {'generated':>10} {'seconds':>8} "
          f"{'tokens/s':>9} {'speedup':>8}")
    baseline = None
    modes = [("rounds, re-prefill", True, False), ("rounds, KV reuse", True, True), ("no wait, KV reuse", False, True)]
    engines = {}
    for label, wait, reuse in modes:
        engine = Engine(model, EngineConfig(kv_cache_gb=40.0, max_rows=episodes, max_seq_len=max_len,
                                            triton=args.triton), dtype=dtype)
        # The timed run is the episodes' second play: the first compiles, and captures the CUDA graphs of every
        # decode and prefill bucket they meet (the same ones again: same lengths; the tokens are sampled anew),
        # which a training run pays once.
        play(engine, plan, turns, wait, reuse)
        engine.table.clear()
        engine.stats = EngineStats()
        synchronize(device)
        start = time.perf_counter()
        generated = play(engine, plan, turns, wait, reuse)
        synchronize(device)
        seconds = time.perf_counter() - start
        baseline = baseline or seconds
        stats = engine.stats
        print(f"{label:<20} {stats.prefill_tokens:>15,} {stats.prefill_calls:>6,} {stats.decode_steps:>12,} "
              f"{generated:>10,} {seconds:>8.2f} {generated / seconds:>9,.0f} {baseline / seconds:>7.1f}x", flush=True)
        if args.profile:  # kept for the profile after the table; otherwise its cache is freed for the next mode
            engines[label] = engine
    if args.profile:
        for label, wait, reuse in modes[1:]:
            engine = engines[label]
            engine.table.clear()
            calls = time_prefill_calls(engine, device)
            profiler = cProfile.Profile()
            profiler.enable()
            play(engine, plan, turns, wait, reuse)
            synchronize(device)
            profiler.disable()
            seconds = sorted(calls, key=lambda call: call[0])
            print(f"\n{label}: {len(calls)} prefill calls, seconds each (to its tokens on the host): min "
                  f"{seconds[0][0]:.4f}, median {seconds[len(seconds) // 2][0]:.4f}, max {seconds[-1][0]:.4f}, "
                  f"total {sum(c[0] for c in calls):.2f}; slowest (seconds, sequences, longest new): "
                  + ", ".join(f"({c[0]:.3f}, {c[1]}, {c[2]})" for c in seconds[-5:]))
            print(f"{label}: cProfile, by cumulative time")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
