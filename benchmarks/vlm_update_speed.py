"""A VLM's reference and update passes at a real size on one device: padded against packed micro-batches, and
packed with a frozen tower's features encoded once a step; seconds, tokens/s, MFU and peak memory.

A batch of multi-turn episodes laid out as the VisGym recipe's (``--images`` turns at most, each an image of
``--image-size`` pixels square, ``--text`` observation tokens and a ``--response``-token scored answer; an
image a turn kept in the conversation; an episode plays between ``--min-turns`` (half, by default) and all of
the turns, as episodes end apart) goes through what an RL step runs over it: a pass without gradients
(the reference's, or the old log-probs') and a training pass (forward and backward, as the PPO epochs run
it, checkpointed unless ``--no-checkpointing``), one micro-batch at a time: ``--rows`` rows padded, or
``--tokens`` tokens packed (each episode attends to itself; its image tokens keep their M-RoPE positions).
``features once`` runs the packed passes with one store of image features a step
(:mod:`turnrl.training.image_features`): the first pass encodes each image, the second reads them; the other
variants run the tower in both. ``--checkpointed-layers N`` adds the features-once passes with only the first N
decoder layers recomputed (``model.checkpointed_layers``), the training pass's speed-up against every layer
recomputed in the last column. Weights are bf16 (as FSDP's mixed precision gathers them) and the tower is
frozen (``model.train_vision=false``, the recipes' default).

MFU is the training pass's model FLOPs over its seconds and the device's bf16 peak: the decoder's 6 x
parameters a real token plus causal attention (the trainer's ``throughput/update_mfu``; a frozen tower's
forward is not counted, see :mod:`turnrl.models.throughput`). The tower's forward FLOPs are printed beside
it, as a share of the no-gradient pass. Ratios are to the padded variant, measured in the same run. Before the
passes, the tower's forward over the batch's images is timed alone: with its MLPs at an aligned width (as loaded,
:mod:`turnrl.models.vision_mlp`; Qwen2.5-VL's 3,420 is not) against their own width, and compiled with ``--compile``.

    python benchmarks/vlm_update_speed.py --preset vlm-3b
    python benchmarks/vlm_update_speed.py --quick      # the CPU smoke run: vlm-tiny, 4 episodes of 3 turns
    python benchmarks/vlm_update_speed.py --preset vlm-3b --compile --checkpointed-layers 31 22  # fewer recomputed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForImageTextToText  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP  # noqa: E402

from turnrl.models.loading import (  # noqa: E402
    compile_layer_parts,
    decoder_layers,
    enable_checkpointing,
    freeze_vision_tower,
    prepare_vision_tower,
    vision_tower,
)
from turnrl.models.vision_mlp import AlignedQwen2_5_VLMLP, align_vision_mlps  # noqa: E402
from turnrl.models.vlm import SizedTokenizer, vlm_config, vlm_preset  # noqa: E402
from turnrl.training.packed_attention import ATTENTION  # noqa: E402
from turnrl.training.batch import Batch  # noqa: E402
from turnrl.training.model_passes import token_logprobs  # noqa: E402
from turnrl.training.head import install_scoring_head  # noqa: E402
from turnrl.training.image_features import IMAGE_KEYS  # noqa: E402
from turnrl.training.ppo import MicroBatching, batched_logprobs  # noqa: E402
from turnrl.models.throughput import (  # noqa: E402
    peak_flops,
    training_flops,
    training_flops_per_token,
    vision_training_flops,
)


def build(preset: str, device: torch.device, vocab: int, checkpointing: bool) -> torch.nn.Module:
    """The preset's VLM with random bf16 weights on ``device``, as the trainer runs it (the trainer's attention,
    the tower's attention in one call a layer, the tower frozen, the scoring head)."""
    config = vlm_config(preset, SizedTokenizer(vocab))  # type: ignore[arg-type]
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, attn_implementation=ATTENTION,
                                                        dtype=torch.bfloat16)
    prepare_vision_tower(model)
    install_scoring_head(model, vocab)
    freeze_vision_tower(model)
    if checkpointing:
        enable_checkpointing(model)
    return model.train()


def episodes(model, n: int, images: int, side: int, text: int, response: int, vocab: int, min_turns: int,
             seed: int = 0) -> Batch:
    """``n`` episodes of ``min_turns`` to ``images`` turns (observation text, an image, a scored response),
    right-padded."""
    config, p = model.config, model.config.vision_config
    patch = p.patch_size
    grid = (1, side // patch, side // patch)
    image_tokens = grid[1] * grid[2] // p.spatial_merge_size**2
    pad_dim = 3 * p.temporal_patch_size * patch * patch
    g = torch.Generator().manual_seed(seed)
    rows, masks, counts = [], [], []
    for _ in range(n):
        ids: list[int] = []
        mask: list[int] = []
        turns = int(torch.randint(min_turns, images + 1, (1,), generator=g))  # episodes end apart
        counts.append(turns)
        for _ in range(turns):
            ids += torch.randint(0, vocab - 8, (text,), generator=g).tolist()
            ids += [config.vision_start_token_id, *[config.image_token_id] * image_tokens, config.vision_end_token_id]
            ids += torch.randint(0, vocab - 8, (response,), generator=g).tolist()
            mask += [0] * (text + image_tokens + 2) + [1] * response
        rows.append(ids)
        masks.append(mask)
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    loss_mask = torch.zeros(n, width)
    for i, (ids, mask) in enumerate(zip(rows, masks)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.float)
    total = sum(counts)
    pixels = torch.randn(total * grid[1] * grid[2], pad_dim, generator=g).to(torch.bfloat16)
    per_row = torch.tensor(counts)
    return Batch(input_ids, attention, loss_mask, torch.zeros(n, width), torch.full((n, 1), width - 1),
                 torch.zeros(n, 1, dtype=torch.float64), torch.arange(n), torch.arange(n), torch.full((n,), -1),
                 model_inputs={"pixel_values": pixels, "image_grid_thw": torch.tensor([grid] * total),
                               IMAGE_KEYS: -1 - torch.arange(total)},
                 model_input_rows={"pixel_values": per_row * grid[1] * grid[2], "image_grid_thw": per_row,
                                   IMAGE_KEYS: per_row})


def training_pass(model, batch: Batch, batching: MicroBatching) -> None:
    for rows in batching.split(torch.arange(len(batch)), batch.attention_mask.sum(1).cpu()):
        part = batch.select(rows)
        lp, entropy = token_logprobs(model, part.input_ids, part.attention_mask, part.loss_mask, with_entropy=True,
                                     model_inputs=part.model_inputs, packed=batching.packed,
                                     image_features=part.image_features)
        (lp.sum() * 1e-4 + entropy.sum() * 1e-6).backward()


def a_step(model, batch: Batch, batching: MicroBatching, once: bool, device: torch.device) -> tuple[float, float]:
    """Seconds of the no-gradient pass and of the training pass over ``batch`` (one store of features for both
    when ``once``)."""
    batch = batch.with_image_features() if once else batch
    times = []
    for train in (False, True):
        start = time.perf_counter()
        if train:
            training_pass(model, batch, batching)
        else:
            with torch.no_grad():
                batched_logprobs(model, batch, batching, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return times[0], times[1]


def tower_seconds(model, batch: Batch, device: torch.device, repeats: int) -> float:
    """Seconds of the frozen tower's forward over every image of ``batch`` (after a warm-up call)."""
    tower = vision_tower(model)
    pixels, grids = (batch.model_inputs[key].to(device) for key in ("pixel_values", "image_grid_thw"))
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            tower(pixels, grid_thw=grids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


QUICK = {"preset": "vlm-tiny", "device": "cpu", "batch": 4, "images": 3, "image_size": 112, "text": 8, "response": 12,
         "rows": 2, "tokens": 512, "repeats": 1}
"""``--quick``'s settings: a smoke run of every variant on a CPU in seconds (a flag given beside it still counts)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smoke run on a CPU: " +
                        ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in QUICK.items()))
    parser.add_argument("--preset", default="vlm-3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=16, help="episodes in the batch")
    parser.add_argument("--images", type=int, default=15, help="turns of an episode at most, an image each")
    parser.add_argument("--min-turns", type=int, default=0, help="turns of an episode at least (0: half of --images)")
    parser.add_argument("--image-size", type=int, default=224, help="side of an image in pixels (VisGym's maze)")
    parser.add_argument("--text", type=int, default=40, help="observation tokens a turn")
    parser.add_argument("--response", type=int, default=100, help="scored response tokens a turn")
    parser.add_argument("--rows", type=int, default=4, help="rows of a padded micro-batch")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of a packed micro-batch")
    parser.add_argument("--vocab", type=int, default=8192, help="the tokenizer's size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--checkpointed-layers", type=int, nargs="*", default=[],
                        help="also the packed passes with features once and only the first N decoder layers "
                             "recomputed (model.checkpointed_layers), for each N given")
    parser.add_argument("--compile", action="store_true",
                        help="compile each decoder layer's and vision block's norms and MLP")
    if parser.parse_known_args()[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args()
    if args.checkpointed_layers and not args.checkpointing:
        parser.error("--checkpointed-layers chooses the layers checkpointing recomputes: drop --no-checkpointing")
    device = torch.device(args.device)
    peak = peak_flops(device)
    model = build(args.preset, device, args.vocab, args.checkpointing)
    layers = len(decoder_layers(model))
    if any(n > layers for n in args.checkpointed_layers):
        parser.error(f"--checkpointed-layers: {args.preset} has {layers} decoder layers")
    min_turns = args.min_turns or (args.images + 1) // 2
    batch = episodes(model, args.batch, args.images, args.image_size, args.text, args.response, args.vocab,
                     min_turns).to(device)
    eager_tower = tower_seconds(model, batch, device, args.repeats)
    mlps = [module for module in vision_tower(model).modules() if isinstance(module, AlignedQwen2_5_VLMLP)]
    if mlps:
        for module in mlps:
            module.__class__ = Qwen2_5_VLMLP  # its own forward, at the model's width
        own_width = tower_seconds(model, batch, device, args.repeats)
        align_vision_mlps(vision_tower(model))
        print(f"tower forward over the batch's images, eager: its MLPs at their width {own_width:.3f} s, aligned "
              f"{eager_tower:.3f} s ({own_width / eager_tower:.2f}x)", flush=True)
    if args.compile:
        compile_layer_parts(model)
        compiled_tower = tower_seconds(model, batch, device, args.repeats)
        print(f"tower forward over the batch's images: eager {eager_tower:.3f} s, compiled blocks "
              f"{compiled_tower:.3f} s ({eager_tower / compiled_tower:.2f}x)", flush=True)
    else:
        print(f"tower forward over the batch's images: {eager_tower:.3f} s (eager)", flush=True)
    lengths = batch.attention_mask.sum(1).cpu()
    tokens = int(lengths.sum())
    text_flops = training_flops(training_flops_per_token(model, None if model.config.tie_word_embeddings
                                                         else model.get_input_embeddings().weight),
                                model.config, lengths)
    grids = batch.model_inputs["image_grid_thw"]
    tower_forward = vision_training_flops(vision_tower(model), model.config.vision_config, grids, forward_only=True)
    packed = MicroBatching(args.rows, args.tokens)
    variants: list[tuple[str, MicroBatching, bool, int | None]] = [
        ("padded", MicroBatching(args.rows), False, None), ("packed", packed, False, None),
        ("packed, features once", packed, True, None),
        *((f"packed, features once, {n} of {layers} layers recomputed", packed, True, n)
          for n in args.checkpointed_layers)]
    results = []
    for name, batching, once, recomputed in variants:
        if args.checkpointing:
            enable_checkpointing(model, recomputed)
        a_step(model, batch, batching, once, device)  # warm-up: compilation, the allocator
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        runs = [a_step(model, batch, batching, once, device) for _ in range(args.repeats)]
        scoring, training = (statistics.median(r[i] for r in runs) for i in (0, 1))
        memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        utilization = f"{text_flops / training / peak:.1%}" if peak else "n/a"  # a CPU has no bf16 peak here
        results.append((name, scoring, training, utilization, memory))
        print(f"{name}: no-grad pass {scoring:.3f} s, training pass {training:.3f} s "
              f"({tokens / training:,.0f} tokens/s, MFU {utilization}), peak {memory:.1f} GiB", flush=True)
    p = vlm_preset(args.preset)
    print(f"\n{args.preset}: {args.batch} episodes of up to {args.images} turns ({args.image_size}px images, "
          f"{len(grids)} in all; {args.text} + {args.response} text tokens a turn): {tokens:,} tokens, bf16, "
          f"{'with' if args.checkpointing else 'without'} checkpointing{', compiled' if args.compile else ''}; "
          f"tower frozen ({p.vision.depth} blocks, {p.vision.hidden_size} wide): its forward "
          f"{tower_forward / (text_flops / 3 + tower_forward):.0%} of a no-grad pass's FLOPs, not in MFU")
    base = results[0][1] + results[0][2]
    every = results[2][2]  # the training pass with features once, every layer recomputed (or none, unchecked)
    print("| variant | no-grad pass s | training pass s | both s | training MFU | peak GiB | speed-up (both) | "
          "training pass against features once |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, scoring, training, utilization, memory in results:
        print(f"| {name} | {scoring:.3f} | {training:.3f} | {scoring + training:.3f} | {utilization} | "
              f"{memory:.1f} | {base / (scoring + training):.2f}x | {every / training:.2f}x |")


if __name__ == "__main__":
    main()
