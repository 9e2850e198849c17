"""A rollout's images through the VLM's image processor: every image processed, against images met again taken
from the encoder's cache (``ImageEncoder``, by each image's digest).

Plays visual Sokoban (6x6, one box; 150x150 frames) as a training step does: ``--groups`` groups of
``--group-size`` episodes, each group on one level, round by round, and encodes each turn's frame as the
rollout does (one call a frame). The episodes follow the solver's moves but take a random move with
probability ``--noise``: 0 is a settled policy (the episodes of a group play alike, as 85-88% of the groups did
by the end of the visual Sokoban runs in docs/results.md), 1 a random one (which also bumps into walls, so
frames repeat). Prints, for each noise level, the frames, the share met before, the milliseconds a frame
without and with the cache, measured in the same run, and their ratio, and checks that both gave the same
tensors. The processor is the built-in ``vlm-0.5b``'s (images up to 448x448; 100 patches a frame here).

    python benchmarks/image_encoding.py
    python benchmarks/image_encoding.py --groups 64 --noise 0 0.1 0.3 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.config import ModelConfig  # noqa: E402
from turnrl.envs import make  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import load_processor  # noqa: E402
from turnrl.models.vision import ImageEncoder  # noqa: E402
from turnrl.models.vlm import vlm_preset  # noqa: E402


def rollout_frames(groups: int, group_size: int, turns: int, noise: float, seed: int) -> list[np.ndarray]:
    """The frames a rollout encodes, in its order: each round's turns across every episode still playing."""
    rng = random.Random(seed)
    envs = [make("Sokoban", size=6, num_boxes=1, mode="image") for _ in range(groups * group_size)]
    frames, playing = [], []
    for index, env in enumerate(envs):
        obs, _ = env.reset(seed=seed + index // group_size)
        frames.append(obs["image"])
        playing.append(env)
    for _ in range(turns - 1):
        still = []
        for env in playing:
            plan = env.solve()
            names = env.action_names()
            action = plan[0] if plan and rng.random() >= noise else rng.choice(names)
            obs, _, terminated, truncated, _ = env.step(action)
            if not (terminated or truncated):
                frames.append(obs["image"])
                still.append(env)
        playing = still
    return frames


def encode_each(encoder: ImageEncoder, frames: list[np.ndarray]) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """Seconds to encode each frame in its own call, as a rollout's turns do, and what each call gave."""
    start = time.perf_counter()
    inputs = [encoder.message_inputs([frame]).model_inputs for frame in frames]
    return time.perf_counter() - start, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.25, 1.0])
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (the processor's tensor work)")
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = vlm_preset("vlm-0.5b")
    processor = load_processor(builtin_model_path(ModelConfig(builtin_preset="vlm-tiny")), preset.min_pixels,
                               preset.max_pixels)
    print(f"visual Sokoban 6x6, {args.groups} groups x {args.group_size} episodes x up to {args.turns} turns, "
          f"the vlm-0.5b processor, bf16 pixels, {args.threads} torch thread(s)")
    print("| noise | frames | met before | ms a frame, every frame processed | with the cache | speed-up |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for noise in args.noise:
        frames = rollout_frames(args.groups, args.group_size, args.turns, noise, args.seed)
        encode_each(ImageEncoder(processor, torch.bfloat16), frames[:16])  # warm-up
        plain_s, plain = encode_each(ImageEncoder(processor, torch.bfloat16, cache_bytes=0), frames)
        cached = ImageEncoder(processor, torch.bfloat16)
        cached_s, reused = encode_each(cached, frames)
        for a, b in zip(plain, reused):
            assert all(torch.equal(a[key], b[key]) for key in a), "the cache changed an image's inputs"
        print(f"| {noise:g} | {len(frames)} | {cached.images_reused / len(frames):.0%} | "
              f"{plain_s / len(frames) * 1e3:.3f} | {cached_s / len(frames) * 1e3:.3f} | {plain_s / cached_s:.2f}x |")


if __name__ == "__main__":
    main()
