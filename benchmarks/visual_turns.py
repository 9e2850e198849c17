"""A visual rollout's host work a turn: each picture encoded and the chat template's pieces rendered every time,
against both taken from what was made before (``ImageEncoder``'s cache by each image's digest, ``ChatTemplateDeltas``'
memo of messages of texts and pictures).

Plays visual Sokoban as a training step does (``configs/sokoban_quickstart.yaml`` in image mode: 6x6, one box,
150x150 frames, 10 turns): ``--groups`` groups of ``--group-size`` episodes, each group on one level, through the
rollout with the expert standing in for the policy (``benchmarks/episode_tokens.py``'s ``play``), which takes a
random move with probability ``--noise``: 0 is a settled policy (the episodes of a group play alike, as 85-88% of
the groups did by the end of the visual Sokoban runs in docs/results.md), 1 a random one (which also bumps into
walls, so frames repeat). Each turn's work is what the rollout does for a prompt of the latest turn
(``agent.max_context_window=1``, the recipe's): the frame encoded (one call a frame), the user message (the frame
and its observation text) rendered as an observation for the episode's token stream, and the prompt's head (the
system prompt and that message) rendered, its placeholder expanded to the frame's visual tokens. Prints, for each
noise level, the turns, the share of frames met before, the milliseconds a turn of each part, every time and
remembered, measured in the same run, and the ratio of the totals; checks that both ways made the same tensors
and ids. The processor is the built-in ``vlm-0.5b``'s (images up to 448x448; 100 patches a frame here) with the
built-in VLM tokenizer's Qwen2.5-VL template.

    python benchmarks/visual_turns.py
    python benchmarks/visual_turns.py --groups 64 --noise 0 0.1 0.3 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.episode_tokens import play  # noqa: E402
from turnrl.chat.template_deltas import ChatTemplateDeltas, expand_placeholders  # noqa: E402
from turnrl.config import ModelConfig, load_config  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import load_processor  # noqa: E402
from turnrl.models.vision import ImageEncoder  # noqa: E402
from turnrl.models.vlm import vlm_preset  # noqa: E402
from turnrl.training.train_config import TrainConfig  # noqa: E402

Turn = tuple[str, np.ndarray, str]
"""A turn's system prompt, frame and observation text."""


def rollout_turns(groups: int, group_size: int, noise: float, seed: int) -> list[Turn]:
    """The turns of a step's episodes, episode by episode."""
    config = load_config(TrainConfig, Path(__file__).resolve().parents[1] / "configs" / "sokoban_quickstart.yaml",
                         ["env.settings.mode=image"])
    trajectories = play(config, list(range(seed, seed + groups)), group_size, noise)
    return [(trajectory.system_prompt, image, turn.observation) for trajectory in trajectories
            for image, turn in zip(trajectory.images, trajectory.turns)]


def turn_work(encoder: ImageEncoder, deltas: ChatTemplateDeltas, turns: list[Turn]
              ) -> tuple[float, float, list[tuple[dict[str, torch.Tensor], list[int]]]]:
    """Seconds encoding the frames and seconds making the template's pieces (the observation and the head), a turn
    at a time, and what each turn made."""
    encode_s = template_s = 0.0
    made = []
    for system, image, text in turns:
        start = time.perf_counter()
        images = encoder.message_inputs([image])
        middle = time.perf_counter()
        message = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}
        observation = deltas.observation(message)
        head = expand_placeholders(deltas.head(system, message), encoder.image_token_id, images.token_counts)
        end = time.perf_counter()
        encode_s, template_s = encode_s + middle - start, template_s + end - middle
        made.append((images.model_inputs, observation + head))
    return encode_s, template_s, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.25, 1.0])
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (the processor's tensor work)")
    parser.add_argument("--seed", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    preset = vlm_preset("vlm-0.5b")
    processor = load_processor(builtin_model_path(ModelConfig(builtin_preset="vlm-tiny")), preset.min_pixels,
                               preset.max_pixels)
    print(f"visual Sokoban 6x6, {args.groups} groups x {args.group_size} episodes x up to 10 turns, "
          f"the vlm-0.5b processor, bf16 pixels, {args.threads} torch thread(s); ms a turn")
    print("| noise | turns | met before | encode, every time | remembered | template, every time | remembered "
          "| both, every time | remembered | speed-up |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for noise in args.noise:
        turns = rollout_turns(args.groups, args.group_size, noise, args.seed)
        turn_work(ImageEncoder(processor, torch.bfloat16), ChatTemplateDeltas(processor.tokenizer),
                  turns[:16])  # warm-up
        plain = turn_work(ImageEncoder(processor, torch.bfloat16, cache_bytes=0),
                          ChatTemplateDeltas(processor.tokenizer, memo_size=0), turns)
        encoder = ImageEncoder(processor, torch.bfloat16)
        kept = turn_work(encoder, ChatTemplateDeltas(processor.tokenizer), turns)
        for (inputs, head), (kept_inputs, kept_head) in zip(plain[2], kept[2]):
            assert head == kept_head, "the memo changed the template's ids"
            assert all(torch.equal(inputs[key], kept_inputs[key]) for key in inputs), "the cache changed an image"
        count = len(turns)
        ms = [seconds / count * 1e3 for seconds in (plain[0], kept[0], plain[1], kept[1], plain[0] + plain[1],
                                                   kept[0] + kept[1])]
        print(f"| {noise:g} | {count} | {encoder.images_reused / count:.0%} | "
              + " | ".join(f"{value:.3f}" for value in ms) + f" | {ms[4] / ms[5]:.2f}x |")


if __name__ == "__main__":
    main()
