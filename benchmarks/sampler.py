"""Sampling a decode step's tokens alone: the one-pass Gumbel kernel beside the two-pass inverse-CDF kernels.

``--batch`` rows of a 151,936-token vocabulary (the 0.5B shape), bf16 logits, temperature 1, each sampler timed as
the engine runs it, in a CUDA graph (:func:`benchmarks.attention.timed_ms`): microseconds per call, the ratio
(the one-pass time over the two-pass time, in the same run), and the bound of reading the logits once at
3.35 TB/s (an H100's memory).

    python benchmarks/sampler.py --batch 64 256
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention import timed_ms  # noqa: E402
from turnrl.engine.gumbel import sample_one_pass  # noqa: E402
from turnrl.engine.sampler_kernels import sample_two_pass  # noqa: E402

VOCAB = 151_936


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sampler.py times GPU kernels: run it on a machine with a CUDA GPU")
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; bf16 logits of {args.vocab} tokens, "
          "temperature 1; microseconds per call")
    print(f"{'batch':>5} {'one-pass':>9} {'two-pass':>9} {'ratio':>6} {'read bound':>11}")
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, device=device, dtype=torch.bfloat16) * 3
        temperature = torch.ones(batch, device=device)
        one_pass = 1000 * timed_ms(partial(sample_one_pass, logits, temperature), args.iters)
        two_pass = 1000 * timed_ms(partial(sample_two_pass, logits, temperature), args.iters)
        read_us = logits.numel() * logits.element_size() / 3.35e12 * 1e6
        print(f"{batch:>5} {one_pass:>9.1f} {two_pass:>9.1f} {one_pass / two_pass:>5.2f}x {read_us:>11.1f}",
              flush=True)


if __name__ == "__main__":
    main()
