"""SFT steps a second for a built-in preset: the device read every step against every 32 steps.

A small model's SFT step is bound by the host queuing its kernels (the `base` preset's Sokoban SFT: about
78 ms a step for 14k tokens on an H100, some 8% MFU). Reading the step's loss and gradient norm waits for
the device, so with a read every step host and device take turns; ``sft_train`` reads every 32 steps.
Samples are Sokoban-sized (``--length`` tokens, the last ``--targets`` of them trained), random ids below
the tokenizer's size; the bf16 autocast of a GPU run. Printed: ms a step for each, and the ratio measured in
the same run; then the same every-32 schedule with each layer's norms and MLP compiled (``model.compile``).

    python benchmarks/sft_speed.py --preset base
    python benchmarks/sft_speed.py --preset tiny --device cpu --steps 20     # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.config import ModelConfig  # noqa: E402
from turnrl.models.devices import resolve_dtype  # noqa: E402
from turnrl.models.loading import base_model_path, compile_layer_parts, load_model, load_tokenizer  # noqa: E402
from turnrl.training.batch import Sample  # noqa: E402
from turnrl.training.train_config import SFTConfig  # noqa: E402
from turnrl.training.head import install_scoring_head  # noqa: E402
from turnrl.training.precision import autocast  # noqa: E402
from turnrl.training.sft import sft_train  # noqa: E402


def samples(count: int, length: int, targets: int, vocab: int, seed: int = 0) -> list[Sample]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (count, length), generator=generator).tolist()
    return [Sample(input_ids=row, loss_mask=[0] * (length - targets) + [1] * targets, sampler_logprobs=[0.0] * length,
                   turn_ends=[length - 1], turn_rewards=[0.0], episode=i, group=0) for i, row in enumerate(ids)]


def seconds_a_step(preset: str, device: torch.device, data: list[Sample], config: SFTConfig, read_every: int,
                   compiled: bool = False) -> float:
    path = base_model_path(ModelConfig(builtin_preset=preset))
    model = load_model(path, device=device, attention="sdpa")
    install_scoring_head(model, len(load_tokenizer(path)))
    if compiled:
        compile_layer_parts(model)  # the warm-up steps below compile
    warm = SFTConfig(epochs=1, batch_size=config.batch_size, micro_batch_size=config.micro_batch_size,
                     warmup_steps=0)
    with autocast(device, resolve_dtype("auto", device)):
        sft_train(model, 0, data[: 3 * config.batch_size], warm, read_every=read_every)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        metrics = sft_train(model, 0, data, config, read_every=read_every)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / metrics["sft/steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=128, help="samples a step (sft.batch_size)")
    parser.add_argument("--micro-batch", type=int, default=128, help="sft.micro_batch_size")
    parser.add_argument("--length", type=int, default=110)
    parser.add_argument("--targets", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    vocab = len(load_tokenizer(base_model_path(ModelConfig(builtin_preset=args.preset))))
    data = samples(args.steps * args.batch, args.length, args.targets, vocab)
    config = SFTConfig(epochs=1, batch_size=args.batch, micro_batch_size=args.micro_batch, warmup_steps=0)
    print(f"{args.preset} on {device}: {args.steps} steps of {args.batch} samples x {args.length} tokens")
    every = seconds_a_step(args.preset, device, data, config, read_every=1)
    seldom = seconds_a_step(args.preset, device, data, config, read_every=32)
    print(f"  read every step       {every * 1000:8.1f} ms a step   1.00x")
    print(f"  read every 32 steps   {seldom * 1000:8.1f} ms a step   {every / seldom:.2f}x", flush=True)
    fused = seconds_a_step(args.preset, device, data, config, read_every=32, compiled=True)
    print(f"  the same, compiled    {fused * 1000:8.1f} ms a step   {every / fused:.2f}x")


if __name__ == "__main__":
    main()
