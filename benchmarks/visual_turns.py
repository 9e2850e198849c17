"""A visual rollout's host work a turn: each picture encoded and the chat template's pieces rendered every time,
against both taken from what was made before (``ImageEncoder``'s cache by each image's digest, ``ChatTemplateDeltas``'
memo of messages of texts and pictures).

Plays visual Sokoban (6x6, one box; 150x150 frames) as a training step does: ``--groups`` groups of
``--group-size`` episodes, each group on one level, round by round. The episodes follow the solver's moves but
take a random move with probability ``--noise``: 0 is a settled policy (the episodes of a group play alike, as
85-88% of the groups did by the end of the visual Sokoban runs in docs/results.md), 1 a random one (which also
bumps into walls, so frames repeat). Each turn's work is what the rollout does for a prompt of the latest turn
(``agent.max_context_window=1``, the visual Sokoban recipe's): the frame encoded (one call a frame), the
user message (the frame and its caption) rendered as an observation for the episode's token stream, and the
prompt's head (the system prompt and that message) rendered, its placeholder expanded to the frame's visual
tokens. Prints, for each noise level, the frames, the share met before, the milliseconds
a turn of each part, every time and remembered, measured in the same run, and the ratio of the totals; checks
that both ways made the same tensors and ids. The processor is the built-in ``vlm-0.5b``'s (images up to
448x448; 100 patches a frame here) with the built-in VLM tokenizer's Qwen2.5-VL template.

    python benchmarks/visual_turns.py
    python benchmarks/visual_turns.py --groups 64 --noise 0 0.1 0.3 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.chat.template_deltas import ChatTemplateDeltas, expand_placeholders  # noqa: E402
from turnrl.config import ModelConfig  # noqa: E402
from turnrl.envs import make  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import load_processor  # noqa: E402
from turnrl.models.vision import ImageEncoder  # noqa: E402
from turnrl.models.vlm import vlm_preset  # noqa: E402

SYSTEM = "Sokoban: push the box X onto the target O."


def rollout_observations(groups: int, group_size: int, turns: int, noise: float, seed: int
                         ) -> list[dict[str, Any]]:
    """The observations a rollout takes, in its order: each round's turns across every episode still playing."""
    rng = random.Random(seed)
    envs = [make("Sokoban", size=6, num_boxes=1, mode="image") for _ in range(groups * group_size)]
    observations, playing = [], []
    for index, env in enumerate(envs):
        obs, _ = env.reset(seed=seed + index // group_size)
        observations.append(obs)
        playing.append(env)
    for _ in range(turns - 1):
        still = []
        for env in playing:
            plan = env.solve()
            action = plan[0] if plan and rng.random() >= noise else rng.choice(env.action_names())
            obs, _, terminated, truncated, _ = env.step(action)
            if not (terminated or truncated):
                observations.append(obs)
                still.append(env)
        playing = still
    return observations


def turn_work(encoder: ImageEncoder, deltas: ChatTemplateDeltas, observations: list[dict[str, Any]]
              ) -> tuple[float, float, list[tuple[dict[str, torch.Tensor], list[int]]]]:
    """Seconds encoding the frames and seconds making the template's pieces (the observation and the head), a turn
    at a time, and what each turn made."""
    encode_s = template_s = 0.0
    made = []
    for obs in observations:
        start = time.perf_counter()
        images = encoder.message_inputs([obs["image"]])
        middle = time.perf_counter()
        message = {"role": "user", "content": [{"type": "image", "image": obs["image"]},
                                               {"type": "text", "text": obs["text"]}]}
        observation = deltas.observation(message)
        head = expand_placeholders(deltas.head(SYSTEM, message), encoder.image_token_id, images.token_counts)
        end = time.perf_counter()
        encode_s, template_s = encode_s + middle - start, template_s + end - middle
        made.append((images.model_inputs, observation + head))
    return encode_s, template_s, made


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
          f"the vlm-0.5b processor, bf16 pixels, {args.threads} torch thread(s); ms a turn")
    print("| noise | turns | met before | encode, every time | remembered | template, every time | remembered "
          "| both, every time | remembered | speed-up |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for noise in args.noise:
        observations = rollout_observations(args.groups, args.group_size, args.turns, noise, args.seed)
        turn_work(ImageEncoder(processor, torch.bfloat16), ChatTemplateDeltas(processor.tokenizer),
                  observations[:16])  # warm-up
        plain = turn_work(ImageEncoder(processor, torch.bfloat16, cache_bytes=0),
                          ChatTemplateDeltas(processor.tokenizer, memo_size=0), observations)
        encoder = ImageEncoder(processor, torch.bfloat16)
        kept = turn_work(encoder, ChatTemplateDeltas(processor.tokenizer), observations)
        for (inputs, head), (kept_inputs, kept_head) in zip(plain[2], kept[2]):
            assert head == kept_head, "the memo changed the template's ids"
            assert all(torch.equal(inputs[key], kept_inputs[key]) for key in inputs), "the cache changed an image"
        turns = len(observations)
        ms = [seconds / turns * 1e3 for seconds in (plain[0], kept[0], plain[1], kept[1], plain[0] + plain[1],
                                                   kept[0] + kept[1])]
        print(f"| {noise:g} | {turns} | {encoder.images_reused / turns:.0%} | "
              + " | ".join(f"{value:.3f}" for value in ms) + f" | {ms[4] / ms[5]:.2f}x |")


if __name__ == "__main__":
    main()
