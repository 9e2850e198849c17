"""Sampling a decode step's tokens alone: the engine's Triton kernels beside its compiled torch sampler.

``--batch`` rows of a 151,936-token vocabulary (the 0.5B shape), bf16 logits, temperature 1, each sampler timed as
the engine runs it, in a CUDA graph (:func:`benchmarks.attention.timed_ms`): the two inverse-CDF kernels of
:mod:`turnrl.engine.sampler_kernels` (``model.engine.triton=auto`` on a GPU) and ``sample_untruncated`` compiled
with ``torch.compile`` (``model.engine.triton=false``: a log-normalizer and a Gumbel argmax). Microseconds per call,
the ratio (torch's time over the kernels', in the same run), and the bound of reading the logits once at 3.35 TB/s
(an H100's memory).

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
from turnrl.engine.sampler_kernels import sample_two_pass  # noqa: E402
from turnrl.engine.sampling import sample_untruncated  # noqa: E402

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
    compiled_torch = torch.compile(sample_untruncated, dynamic=False)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; bf16 logits of {args.vocab} tokens, "
          "temperature 1; microseconds per call")
    print(f"{'batch':>5} {'torch, compiled':>15} {'Triton kernels':>14} {'ratio':>6} {'read bound':>11}")
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, device=device, dtype=torch.bfloat16) * 3
        temperature = torch.ones(batch, device=device)
        torch_us = 1000 * timed_ms(partial(compiled_torch, logits, temperature), args.iters)
        kernels_us = 1000 * timed_ms(partial(sample_two_pass, logits, temperature), args.iters)
        read_us = logits.numel() * logits.element_size() / 3.35e12 * 1e6
        print(f"{batch:>5} {torch_us:>15.1f} {kernels_us:>14.1f} {torch_us / kernels_us:>5.2f}x {read_us:>11.1f}",
              flush=True)


if __name__ == "__main__":
    main()
