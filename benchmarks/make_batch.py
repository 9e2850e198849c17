"""A step's episodes to its training batch (``make_batch``) when every turn brings an image: each episode's
pixel values taken as views of the buffers its rollout laid them in, against concatenated again per episode.

SkyRL's VisGym recipe keeps every turn's frame: a step of 64 episodes of 15 turns holds 960 images, 0.58 GB of
bf16 pixel values at ``vlm-3b``'s 224 x 224 frames (256 patches of 3 x 2 x 14 x 14). The batch joins them into
one tensor, a copy it needs; before, each episode's were also concatenated twice on the way (its whole stream's
inputs, then its sample's), host time between the rollout and the update while the device waits. This plays
``--episodes`` episodes of ``--turns`` turns into token contexts as the rollout does (no model, no env: scripted
responses of ``--response`` tokens, ``--distinct`` frames shared as the image encoder's cache shares them), then
times ``make_batch`` on them both ways in the same run, ``--repeats`` times each, alternating, and prints the
median seconds, the ratio and whether the batches are equal.

    python benchmarks/make_batch.py
    python benchmarks/make_batch.py --episodes 8 --turns 6      # a quick look
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.config import ModelConfig  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import load_processor  # noqa: E402
from turnrl.rollout.context import EpisodeTokens, concat_model_inputs  # noqa: E402
from turnrl.rollout.trajectory import Trajectory, TurnRecord  # noqa: E402
from turnrl.training.batch import Batch, collate, trajectory_samples  # noqa: E402
from turnrl.training.scoring import make_batch  # noqa: E402

IMAGE_MESSAGE = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where to? Say a direction."}]}


def played(args: argparse.Namespace, tokenizer) -> list[Trajectory]:
    """Episodes as a rollout leaves them: each turn an observation with one frame and a scripted response."""
    rng = random.Random(0)
    frames = [torch.randn(args.patches, args.patch_dim).to(torch.bfloat16) for _ in range(args.distinct)]
    grid = torch.tensor([[1, 16, args.patches // 16]])
    trajectories = []
    for episode in range(args.episodes):
        tokens = EpisodeTokens(tokenizer, image_token="<|image_pad|>", expected_turns=args.turns)
        trajectory = Trajectory(env_id="Maze2D", seed=episode // 8, group=episode // 8, sample=episode % 8)
        for turn in range(args.turns):
            inputs = {"pixel_values": frames[rng.randrange(args.distinct)], "image_grid_thw": grid}
            digest = [rng.randrange(2**62)]
            if turn == 0:
                tokens.start("Solve the maze.", IMAGE_MESSAGE, [args.patches // 4], inputs, image_digests=digest)
            else:
                tokens.add_observation(IMAGE_MESSAGE, [args.patches // 4], inputs, image_digests=digest)
            ids = [rng.randrange(1000) for _ in range(args.response - 1)] + [tokenizer.eos_token_id]
            tokens.add_response(ids, [-0.5] * len(ids))
            trajectory.turns.append(TurnRecord(index=turn, observation="", response="", response_ids=ids,
                                               response_logprobs=[-0.5] * len(ids), finish_reason="stop",
                                               parsed=None, rewards={"env": 0.0}))  # type: ignore[arg-type]
        trajectory.tokens = tokens
        trajectories.append(trajectory)
    return trajectories


def concatenated_batch(trajectories: list[Trajectory]) -> Batch:
    """``make_batch`` as it was: each sample's inputs concatenated from its turns (after its whole stream's had
    been), then joined into the batch's."""
    samples = trajectory_samples(trajectories, list(range(len(trajectories))))
    for sample, trajectory in zip(samples, trajectories):
        assert trajectory.tokens is not None
        concat_model_inputs(trajectory.tokens.turns)
        answered = trajectory.tokens.turns[: len(sample.turn_ends)]
        sample.model_inputs = {**concat_model_inputs(answered), "image_keys": sample.model_inputs["image_keys"]}
    return collate(samples, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--response", type=int, default=128, help="tokens a response")
    parser.add_argument("--patches", type=int, default=256)
    parser.add_argument("--patch-dim", type=int, default=1176)
    parser.add_argument("--distinct", type=int, default=4, help="distinct frames among the episodes' images")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_processor(builtin_model_path(ModelConfig(builtin_preset="vlm-tiny"))).tokenizer
    trajectories = played(args, tokenizer)
    keep, device = list(range(len(trajectories))), torch.device("cpu")
    ways = {"concatenated": lambda: concatenated_batch(trajectories),
            "views": lambda: make_batch(trajectories, keep, "trajectory", 0, device)}
    timings: dict[str, list[float]] = {name: [] for name in ways}
    batches = {}
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            batches[name] = way()
            timings[name].append(time.perf_counter() - start)
    pixels = batches["views"].model_inputs["pixel_values"]
    same = all(torch.equal(batches["views"].model_inputs[key], value)
               for key, value in batches["concatenated"].model_inputs.items())
    print(f"{args.episodes} episodes x {args.turns} turns, {len(pixels):,} rows of pixel values "
          f"({pixels.numel() * pixels.element_size() / 1e9:.2f} GB), torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); median of {args.repeats}:")
    for name, seconds in timings.items():
        print(f"  {name:<13} {statistics.median(seconds):.3f} s")
    ratio = statistics.median(timings["concatenated"]) / statistics.median(timings["views"])
    print(f"views {ratio:.2f}x faster; the same batch both ways: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
