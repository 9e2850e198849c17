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
allocations live at that peak by the line of turnrl or transformers that made them (the allocator's trace,
saved at ``--snapshot`` for pytorch.org/memory_viz; :mod:`turnrl.training.memory_trace`). The memory estimate
of a training run (``turnrl memory``) counts the weights and the cache; this is what it leaves out.

    python benchmarks/vlm_rollout.py                                   # CPU, vlm-tiny
    python benchmarks/vlm_rollout.py --device cuda --preset vlm-0.5b --episodes 64
    python benchmarks/vlm_rollout.py --memory --preset vlm-8b --episodes 64 --turns 15 --new 128 \
        --context 4032 --kv-cache-gb 12.5                               # VisGym's rollout, one GPU
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

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
from turnrl.training.memory_trace import GIB, recorded  # noqa: E402


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


def engine_memory(engine: EnginePolicy, args: argparse.Namespace, device: torch.device) -> None:
    """The engine's rollout alone: its peak above the weights and cache at rest, and what was live then."""
    rollout(engine, argparse.Namespace(**{**vars(args), "episodes": min(args.episodes, 4), "turns": 2}), 1000)
    torch.cuda.synchronize(device)
    at_rest = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    snapshot = Path(args.snapshot)
    with recorded(snapshot, device):
        _, seconds = rollout(engine, args, first_seed=0)
    print(f"rollout {seconds:.1f} s; at rest (weights, engine buffers, key/value cache) {at_rest / GIB:.2f} GiB; "
          f"peak {torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB; the snapshot: {snapshot}")
    print(snapshot.with_suffix(".txt").read_text(), end="")


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
    parser.add_argument("--snapshot", default="runs/vlm_rollout_memory.pickle",
                        help="with --memory, the allocator's snapshot (and its report, .txt)")
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
