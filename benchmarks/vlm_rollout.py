"""VLM rollouts on image observations: the engine beside transformers' ``generate``, in one run.

A built-in Qwen2.5-VL preset (random weights: this measures speed, not play),
``--episodes`` episodes of an image-mode env (a new picture every turn),
``--turns`` turns with the whole history in every prompt (every earlier image
too), greedy responses of at most ``--new`` tokens. The same rollout (same
seeds, so the same trajectories: greedy tokens are equal on both backends) is
played with ``model.backend=hf`` and ``model.backend=engine``, each timed after
a warm-up rollout of other seeds. ``generate`` encodes every image of the
history and prefills the whole history at every turn; the engine prefills only
each turn's new tokens and runs only the new image through the vision tower.

With ``--memory`` (a GPU) it plays the engine's rollout alone and reports its working memory: the peak
allocated during the rollout above what the weights and the key/value cache hold at rest, and the
allocations live at that peak, largest first, each at the first frame of turnrl or transformers that made it
(from the allocator's trace; ``--snapshot PATH`` also saves it for pytorch.org/memory_viz). The memory
estimate of a training run (``turnrl memory``) counts the weights and the cache; this is what it leaves out.

    python benchmarks/vlm_rollout.py                                   # CPU, vlm-tiny
    python benchmarks/vlm_rollout.py --device cuda --preset vlm-0.5b --episodes 64
    python benchmarks/vlm_rollout.py --memory --preset vlm-8b --episodes 64 --turns 15 --new 128 \
        --context 4032 --kv-cache-gb 12.5                               # VisGym's rollout, one GPU
"""

from __future__ import annotations

import argparse
import pickle
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.agent.formats import get_format  # noqa: E402
from turnrl.config import AgentConfig, EngineConfig, ModelConfig, SamplingConfig  # noqa: E402
from turnrl.envs import make  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import load_processor  # noqa: E402
from turnrl.policy.engine import EnginePolicy  # noqa: E402
from turnrl.policy.hf import HFPolicy  # noqa: E402
from turnrl.rollout.runner import EpisodeSlot, Rollout  # noqa: E402
from turnrl.rollout.trajectory import Trajectory  # noqa: E402


def rollout(policy, args: argparse.Namespace, first_seed: int) -> tuple[list[Trajectory], float]:
    """Play ``args.episodes`` episodes from ``first_seed`` on; returns them and the wall seconds."""
    agent = AgentConfig(format="no_think", max_turns=args.turns, max_actions_per_episode=4 * args.turns,
                        max_context_tokens=args.context)
    runner = Rollout(policy, get_format("no_think"), agent, args.env)
    slots = [EpisodeSlot(env=make(args.env, mode="image"), seed=first_seed + e, group=e) for e in range(args.episodes)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    trajectories = runner.run(slots, SamplingConfig(temperature=0, max_new_tokens=args.new))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return trajectories, time.perf_counter() - start


def live_at_peak(events: Sequence[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """Replay an allocator trace (``torch.cuda.memory._snapshot()["device_traces"][device]``): the most bytes
    allocated at once above where the trace began, and the allocations the trace made that were live then,
    largest first. Blocks allocated before the trace and freed during it lower the count.

    Args:
        events: in order, each with ``action`` (``alloc``, ``free_completed``; others are ignored), ``addr``,
            ``size`` and ``frames``.
    """
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
            total -= event["size"]
    return peak, sorted(at_peak, key=lambda event: -event["size"])


def made_at(event: dict[str, Any]) -> str:
    """Where an allocation was made: its first frame in turnrl or transformers (``file:line function``)."""
    for frame in event.get("frames", []):
        name = frame["filename"]
        for package in ("turnrl/", "transformers/"):
            if package in name:
                return f"{package}{name.split(package, 1)[1]}:{frame['line']} {frame['name']}"
    return "(outside turnrl and transformers)"


def engine_memory(engine: EnginePolicy, args: argparse.Namespace, device: torch.device) -> None:
    """The engine's rollout alone: its peak above the weights and cache at rest, and what was live then."""
    rollout(engine, argparse.Namespace(**{**vars(args), "episodes": min(args.episodes, 4), "turns": 2}), 1000)
    torch.cuda.synchronize(device)
    at_rest = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, device=device)
    _, seconds = rollout(engine, args, first_seed=0)
    snapshot = torch.cuda.memory._snapshot(device)
    torch.cuda.memory._record_memory_history(enabled=None, device=device)
    if args.snapshot:
        Path(args.snapshot).write_bytes(pickle.dumps(snapshot))
    peak, live = live_at_peak(snapshot["device_traces"][device.index or 0])
    gib = 2**30
    print(f"rollout {seconds:.1f} s; at rest (weights, engine buffers, key/value cache) {at_rest / gib:.2f} GiB; "
          f"peak {torch.cuda.max_memory_allocated(device) / gib:.2f} GiB, {peak / gib:.2f} GiB above rest by the "
          "trace")
    by_place: dict[str, int] = {}
    for event in live:
        by_place[made_at(event)] = by_place.get(made_at(event), 0) + event["size"]
    print("live at the peak, by where it was made:")
    for place, size in sorted(by_place.items(), key=lambda item: -item[1])[:15]:
        print(f"  {size / gib:8.3f} GiB  {place}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, help="a built-in VLM preset (vlm-tiny on a CPU, vlm-0.5b on a GPU)")
    parser.add_argument("--env", default="Maze2D")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--context", type=int, default=8192, help="agent.max_context_tokens")
    parser.add_argument("--memory", action="store_true", help="the engine's working memory in its rollout (a GPU)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.0, help="the engine's cache (0: its default)")
    parser.add_argument("--snapshot", default=None, help="with --memory, save the allocator's snapshot here")
    args = parser.parse_args()
    device = torch.device(args.device)
    preset = args.preset or ("vlm-0.5b" if device.type == "cuda" else "vlm-tiny")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    path = str(builtin_model_path(ModelConfig(builtin_preset=preset)))
    hf = HFPolicy.from_config(ModelConfig(device=args.device, dtype=dtype), path, max_batch_size=args.episodes)
    engine = EnginePolicy(hf.model, hf.tokenizer, EngineConfig(max_rows=args.episodes, max_seq_len=args.context + 64,
                                                               kv_cache_gb=args.kv_cache_gb),
                          processor=load_processor(path))
    if args.memory:
        if device.type != "cuda":
            raise SystemExit("--memory reads the GPU allocator's trace: run it with --device cuda")
        print(f"{preset} (random weights), {dtype}, {args.env} images, {args.episodes} episodes x {args.turns} "
              f"turns of at most {args.new} tokens, on {torch.cuda.get_device_name(device)} "
              f"(torch {torch.__version__})")
        engine_memory(engine, args, device)
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    print(f"{preset} (random weights), {dtype}, {args.env} images, {args.episodes} episodes x {args.turns} turns, "
          f"greedy responses of at most {args.new} tokens, on {name} (torch {torch.__version__})")
    print(f"{'backend':<8} {'seconds':>8} {'turns':>6} {'prompt tokens':>14} {'generated':>10} {'tokens/s':>9} "
          f"{'prefilled':>10} {'reused':>8} {'speedup':>8}")
    played: dict[str, list[Trajectory]] = {}
    baseline = None
    for label, policy in (("hf", hf), ("engine", engine)):
        rollout(policy, args, first_seed=1000)  # warm-up: compilation, graphs, allocator
        before = engine.engine.stats.prefill_tokens, engine.engine.stats.reused_tokens
        trajectories, seconds = rollout(policy, args, first_seed=0)
        played[label] = trajectories
        turns = sum(len(t.turns) for t in trajectories)
        prompt = sum(len(sample.prompt_ids) for t in trajectories for sample in t.tokens.turn_samples())
        generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
        baseline = baseline or seconds
        prefilled, reused = ("-", "-") if label == "hf" else (
            f"{engine.engine.stats.prefill_tokens - before[0]:,}", f"{engine.engine.stats.reused_tokens - before[1]:,}")
        print(f"{label:<8} {seconds:>8.2f} {turns:>6} {prompt:>14,} {generated:>10,} {generated / seconds:>9,.0f} "
              f"{prefilled:>10} {reused:>8} {baseline / seconds:>7.2f}x", flush=True)
    same = all(a.tokens.stream().input_ids == b.tokens.stream().input_ids
               for a, b in zip(played["hf"], played["engine"]))
    print(f"same trajectories on both backends: {'yes' if same else 'no (bf16 near-ties break either way)'}")


if __name__ == "__main__":
    main()
