"""The scoring head as the trainer runs it, eager against compiled (``model.compile``).

The trainer scores chosen tokens through :func:`turnrl.training.head.chosen_logprobs`: chunk by chunk, a product of
the hidden states with the LM head's weight, then the log-softmax's arithmetic on the chunk's logits (the chosen
tokens' log-probs and the entropy forward; the logits' gradient backward). Eagerly that arithmetic is a dozen kernels
over float32 copies of the chunk (152k columns at Qwen2.5's vocabulary); compiled it is a few reductions and one
elementwise kernel over the bf16 logits. This times both for one micro-batch's scored tokens (``--tokens``, the
3B shape by default: hidden 2,048, 151,936 rows), float32 weights under bf16 autocast as training holds them:

- ``forward and backward``: an update's pass through the head (the log-probs and entropies, then their gradient);
- ``forward``: a scoring pass (the reference's, the old log-probs'), without gradients.

It prints each variant's milliseconds, the compiled one's speed-up measured in the same run, and the largest
difference of the compiled outputs (log-probs, entropies, the states' gradient) from the eager ones.

    python benchmarks/scoring_head.py                   # a GPU if there is one: 8,192 tokens at the 3B shape
    python benchmarks/scoring_head.py --device cpu --tokens 512 --hidden 256 --vocab 32768 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import mean_milliseconds  # noqa: E402
from turnrl.training.head import DEFAULT_CHUNK, chosen_logprobs  # noqa: E402


def score(states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grads: torch.Tensor | None,
          compiled: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One pass through the head under bf16 autocast (and the backward with ``grads``: Shape (2, n), the
    log-probs' and the entropies' gradients); returns the log-probs, the entropies and the states' gradient."""
    states = states.detach().requires_grad_(grads is not None)
    with torch.set_grad_enabled(grads is not None), torch.autocast(states.device.type, dtype=torch.bfloat16):
        logprobs, entropy = chosen_logprobs(states, weight, targets, temperature=1.0, chunk=chunk, compiled=compiled)
    if grads is not None:
        torch.autograd.backward([logprobs, entropy], [grads[0], grads[1]])
    return logprobs.detach(), entropy.detach(), states.grad


def milliseconds(states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grads: torch.Tensor | None,
                 compiled: bool, chunk: int, repeats: int) -> float:
    """Mean milliseconds of one pass, after two warm-up passes (the first compiles)."""
    return mean_milliseconds(lambda: score(states, weight, targets, grads, compiled, chunk), states.device, repeats,
                             warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192, help="scored tokens of a micro-batch")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="scored tokens a chunk (the trainer's)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    states = torch.randn(args.tokens, args.hidden, device=device, generator=generator)
    weight = torch.randn(args.vocab, args.hidden, device=device, generator=generator) / args.hidden ** 0.5
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=generator)
    grads = torch.randn(2, args.tokens, device=device, generator=generator)
    print(f"the scoring head: {args.tokens} tokens, hidden {args.hidden}, {args.vocab} rows, chunks of "
          f"{args.chunk}, float32 weights under bf16 autocast, on {device}")
    print("| pass | eager ms | compiled ms | speed-up | largest difference |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, pass_grads in (("forward and backward", grads), ("forward", None)):
        times = [milliseconds(states, weight, targets, pass_grads, compiled, args.chunk, args.repeats)
                 for compiled in (False, True)]
        eager, compiled = (score(states, weight, targets, pass_grads, flag, args.chunk) for flag in (False, True))
        difference = max(float((a.float() - b.float()).abs().max()) for a, b in zip(eager, compiled, strict=True)
                         if a is not None and b is not None)
        weight.grad = None
        print(f"| {name} | {times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f}x | {difference:.3g} |")


if __name__ == "__main__":
    main()
