"""A round's prompt inputs when every image stays in the conversation: each turn's images concatenated again for
its prompt, against views of the episode's inputs laid end to end (``EpisodeTokens.prompt_model_inputs``).

SkyRL's VisGym recipe keeps every turn's frame in the prompt: at turn t a request carries the pixel values of t
frames. Before each round's generation the rollout builds every episode's request, with the device waiting; this
times that part of it, turn by turn as the rollout asks (after each observation), for ``--episodes`` episodes of
``--turns`` turns, each turn adding one image of ``--patches`` patches of ``--patch-dim`` values in ``--dtype``
(the defaults: ``vlm-3b``'s 224 x 224 maze frames, 256 patches of 3 x 2 x 14 x 14, in the tower's bf16). Both
ways run in the same process on the same episodes, the plain way first; the script checks each prompt's tensors
are equal both ways and prints the seconds of each, the bytes the plain way copied, and the ratio; the views once
more with each episode's buffers sized for its turns at the first (``expected_turns``, as the rollout makes them)
instead of doubling from one turn's. Then it places the image tokens of the same prompts (``mrope_positions``, the
engine's per request) with every image's offsets built again, as before they were kept by size, and kept. Last,
the engine's row table (:class:`~turnrl.engine.rows.RowTable`) places each round's prompts on the rows that hold
the episodes' previous turns (a shared head, then each episode its own tokens, of lengths that differ), comparing
each candidate row whole, as before, and with its last token compared first.

    python benchmarks/prompt_inputs.py
    python benchmarks/prompt_inputs.py --episodes 8 --turns 6     # a quick look
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.config import ModelConfig  # noqa: E402
from turnrl.engine.rows import RowTable  # noqa: E402
from turnrl.models.builtin import builtin_model_path  # noqa: E402
from turnrl.models.loading import load_processor  # noqa: E402
from turnrl.models.mrope import image_offsets, mrope_positions, placeholder_spans  # noqa: E402
from turnrl.rollout.context import EpisodeTokens, concat_model_inputs  # noqa: E402

IMAGE_MESSAGE = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where to?"}]}


def placing(tokens: EpisodeTokens, image_token: int, merge: int, kept: bool) -> float:
    """Seconds to place the image tokens of each of the episode's prompts, the offsets kept or built each time."""
    seconds = 0.0
    for turn in range(len(tokens.turns)):
        prompt, grids = tokens.prompt_ids(turn), tokens.prompt_model_inputs(turn)["image_grid_thw"]
        if not kept:
            image_offsets.cache_clear()
        start = time.perf_counter()
        mrope_positions(len(prompt), placeholder_spans(prompt, image_token), grids, merge)
        seconds += time.perf_counter() - start
    return seconds


def add_turn(tokens: EpisodeTokens, turn: int, frame: dict[str, list[torch.Tensor]], placeholders: int,
             tokenizer) -> None:
    """Turn ``turn`` of a maze episode: the first observation, or a response and the next observation, each with
    one of ``frame``'s images (the encoder's tensors: its cache shares them between episodes, as when frames
    repeat)."""
    inputs = {key: value[turn % len(value)] for key, value in frame.items()}
    if turn == 0:
        tokens.start("Solve the maze.", IMAGE_MESSAGE, [placeholders], inputs)
    else:
        tokens.add_response([tokenizer.eos_token_id])
        tokens.add_observation(IMAGE_MESSAGE, [placeholders], inputs)


def play(episodes: int, turns: int, frame: dict[str, list[torch.Tensor]], placeholders: int, tokenizer, plain: bool,
         expected_turns: int = 1) -> tuple[float, int, list[dict[str, torch.Tensor]]]:
    """Seconds spent making the prompts' inputs, the bytes they hold, and the last episode's prompts' inputs."""
    seconds, held, last = 0.0, 0, []
    for episode in range(episodes):
        tokens = EpisodeTokens(tokenizer, image_token="<|image_pad|>", expected_turns=expected_turns)
        prompts = []
        for turn in range(turns):
            add_turn(tokens, turn, frame, placeholders, tokenizer)
            start = time.perf_counter()
            made = (concat_model_inputs([tokens.turns[j] for j in tokens.image_turns(turn)]) if plain
                    else tokens.prompt_model_inputs())
            seconds += time.perf_counter() - start
            held += sum(value.numel() * value.element_size() for value in made.values())
            if episode == episodes - 1:
                prompts.append(made)
        last = prompts
    return seconds, held, last


class WholeRowScan(RowTable):
    """The row table comparing each candidate row whole, as it did before its last token was compared first."""

    @staticmethod
    def begins_with(prompt: list[int], tokens: list[int], usable: int) -> bool:
        return prompt[:usable] == tokens[:usable]


def placing_rows(table: RowTable, episodes: int, turns: int, head: int, turn_tokens: int, seed: int = 0
                 ) -> tuple[float, list[tuple[int, int]]]:
    """Seconds to place every round's prompts, and each placement's (row, tokens reused): ``episodes`` rows
    sharing a ``head`` of tokens, each turn adding about ``turn_tokens`` of each episode's own (a length that
    differs by episode), the round's prompts placed in another order than their rows'."""
    rng = random.Random(seed)
    shared = [rng.randrange(50_000) for _ in range(head)]
    prompts = [list(shared) for _ in range(episodes)]
    seconds, placements = 0.0, []
    for _ in range(turns):
        for prompt in prompts:
            prompt += [rng.randrange(50_000) for _ in range(turn_tokens - rng.randrange(turn_tokens // 4))]
        order = rng.sample(range(episodes), episodes)
        start = time.perf_counter()
        placed = [table.place(prompts[i]) for i in order]
        seconds += time.perf_counter() - start
        for i, placement in zip(order, placed, strict=True):
            assert placement is not None
            placements.append((placement.row, placement.reused))
            table.release(placement.row, prompts[i])
    return seconds, placements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--patches", type=int, default=256)
    parser.add_argument("--patch-dim", type=int, default=1176)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads")
    parser.add_argument("--head", type=int, default=300, help="tokens every episode's prompt begins with")
    parser.add_argument("--turn-tokens", type=int, default=250, help="about the tokens a turn adds to a prompt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_processor(builtin_model_path(ModelConfig(builtin_preset="vlm-tiny"))).tokenizer
    dtype = getattr(torch, args.dtype)
    # a few distinct frames, each its own tensors, as the image encoder hands them out
    frame = {"pixel_values": [torch.randn(args.patches, args.patch_dim).to(dtype) for _ in range(4)],
             "image_grid_thw": [torch.tensor([[1, 16, args.patches // 16]]) for _ in range(4)]}
    placeholders = args.patches // 4
    plain_s, copied, plain_prompts = play(args.episodes, args.turns, frame, placeholders, tokenizer, plain=True)
    views_s, _, view_prompts = play(args.episodes, args.turns, frame, placeholders, tokenizer, plain=False)
    sized_s, _, sized_prompts = play(args.episodes, args.turns, frame, placeholders, tokenizer, plain=False,
                                     expected_turns=args.turns)
    tokens = EpisodeTokens(tokenizer, image_token="<|image_pad|>")  # one episode's prompts, to place their images
    for turn in range(args.turns):
        add_turn(tokens, turn, frame, placeholders, tokenizer)
    pad = int(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    built_s = args.episodes * placing(tokens, pad, 2, kept=False)
    kept_s = args.episodes * placing(tokens, pad, 2, kept=True)
    for plain, view, sized in zip(plain_prompts, view_prompts, sized_prompts, strict=True):
        for other in (view, sized):
            assert plain.keys() == other.keys() and all(torch.equal(plain[k], other[k]) for k in plain), \
                "not the same inputs"
    (whole_s, whole), (first_s, first) = (
        placing_rows(table(args.episodes), args.episodes, args.turns, args.head, args.turn_tokens)
        for table in (WholeRowScan, RowTable))
    assert whole == first, "not the same rows"
    requests = args.episodes * args.turns
    print(f"{args.episodes} episodes x {args.turns} turns, an image a turn of {args.patches} x {args.patch_dim} "
          f"{args.dtype}, every image kept; {args.threads} torch thread(s)")
    print(f"concatenated for each prompt: {plain_s:.3f} s ({1e3 * plain_s / requests:.3f} ms a request, "
          f"{copied / 1e9:.2f} GB copied)")
    print(f"views of the episode's inputs: {views_s:.3f} s ({1e3 * views_s / requests:.3f} ms a request)")
    print(f"{plain_s / views_s:.1f}x faster; the same tensors both ways")
    print(f"views, the buffers sized for {args.turns} turns at the first: {sized_s:.3f} s "
          f"({1e3 * sized_s / requests:.3f} ms a request, {views_s / sized_s:.2f}x the doubling buffers)")
    print(f"image tokens placed (mrope_positions), the step's prompts: offsets built for each image {built_s:.3f} s, "
          f"kept by size {kept_s:.3f} s ({built_s / kept_s:.1f}x)")
    print(f"rows placed for the step's prompts (a head of {args.head} tokens, about {args.turn_tokens} a turn): "
          f"each candidate row compared whole {whole_s:.3f} s, its last token first {first_s:.3f} s "
          f"({whole_s / first_s:.1f}x; the same rows both ways)")


if __name__ == "__main__":
    main()
