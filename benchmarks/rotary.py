"""One attention layer's rotary embedding as the trainer runs it, against the same compiled, and in bf16.

The trainer holds float32 weights and runs its passes under bf16 autocast. transformers' rotary modules return cos
and sin in the hidden states' dtype, float32 there, so the rotary embedding of the (bf16) queries and keys runs in
float32, returns float32, and attention casts the result back to bf16: a handful of memory-bound kernels over
float32 copies of the queries and keys in every layer of every pass. This times, for one layer's queries and keys
(``--tokens`` of a micro-batch, Qwen2.5-3B's heads by default), forward and backward and forward alone:

- ``eager, float32 cos``: what the trainer runs without ``model.compile`` (transformers' ``apply_rotary_pos_emb``,
  then the cast);
- ``compiled``: the same function and cast under ``torch.compile`` (the same float32 arithmetic, fused), for
  static shapes;
- ``CompiledRotary``: what ``model.compile`` runs, ``turnrl.models.loading.CompiledRotary`` over transformers'
  function, called under bf16 autocast as the trainer's passes call it (compiled for dynamic shapes, the cast
  to the autocast dtype inside);
- ``eager, bf16 cos``: cos and sin in bf16, as a bf16 model runs it (other rounding).

It prints each one's milliseconds and its speed-up over the first, measured in the same run, and the largest
difference of each output from the first.

    python benchmarks/rotary.py                         # a GPU if there is one: 8,192 tokens, 16 + 2 heads of 128
    python benchmarks/rotary.py --device cpu --tokens 256 --repeats 5
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import mean_milliseconds  # noqa: E402
from turnrl.models.loading import CompiledRotary  # noqa: E402

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rotary_for_attention(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary embedding, then the cast to bf16 that attention makes of its inputs.

    Args:
        q: Shape (1, heads, t, d), bf16. k: Shape (1, kv_heads, t, d), bf16. cos, sin: Shape (1, t, d).

    Returns:
        The rotated queries and keys, in bf16, shaped as ``q`` and ``k``.
    """
    rotated_q, rotated_k = apply_rotary_pos_emb(q, k, cos, sin)
    return rotated_q.to(torch.bfloat16), rotated_k.to(torch.bfloat16)


def under_autocast(rotary: Rotary) -> Rotary:
    """``rotary`` called under bf16 autocast on its inputs' device, as the trainer's passes call attention."""

    def call(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(q.device.type, dtype=torch.bfloat16):
            return rotary(q, k, cos, sin)

    return call


def milliseconds(rotary: Rotary, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 grads: tuple[torch.Tensor, torch.Tensor] | None, repeats: int) -> float:
    """Mean milliseconds of one call (and its backward with ``grads``, if given), after five warm-up calls."""
    q, k = q.detach().requires_grad_(grads is not None), k.detach().requires_grad_(grads is not None)

    def call() -> None:
        with torch.set_grad_enabled(grads is not None):
            outputs = rotary(q, k, cos, sin)
            if grads is not None:
                torch.autograd.backward(list(outputs), list(grads))

    return mean_milliseconds(call, q.device, repeats, warmup=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of a micro-batch")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)

    def normal(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    t, d = args.tokens, args.head_dim
    q, k = normal(1, args.heads, t, d, dtype=torch.bfloat16), normal(1, args.kv_heads, t, d, dtype=torch.bfloat16)
    cos, sin = normal(1, t, d), normal(1, t, d)
    grads = (normal(*q.shape, dtype=torch.bfloat16), normal(*k.shape, dtype=torch.bfloat16))
    variants: list[tuple[str, Rotary, torch.Tensor, torch.Tensor]] = [
        ("eager, float32 cos", rotary_for_attention, cos, sin),
        ("compiled", torch.compile(rotary_for_attention, dynamic=False), cos, sin),
        ("CompiledRotary", under_autocast(CompiledRotary(apply_rotary_pos_emb)), cos, sin),
        ("eager, bf16 cos", rotary_for_attention, cos.bfloat16(), sin.bfloat16()),
    ]
    print(f"one layer's rotary embedding: {t} tokens, {args.heads} query and {args.kv_heads} key heads of {d}, "
          f"on {device}")
    print("| variant | forward and backward ms | speed-up | forward ms | speed-up | largest difference |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    with torch.no_grad():
        reference = rotary_for_attention(q, k, cos, sin)
    first: tuple[float, float] | None = None
    for name, rotary, variant_cos, variant_sin in variants:
        both = milliseconds(rotary, q, k, variant_cos, variant_sin, grads, args.repeats)
        forward = milliseconds(rotary, q, k, variant_cos, variant_sin, None, args.repeats)
        first = first or (both, forward)
        with torch.no_grad():
            outputs = rotary(q, k, variant_cos, variant_sin)
        difference = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outputs, reference))
        print(f"| {name} | {both:.3f} | {first[0] / both:.2f}x | {forward:.3f} | {first[1] / forward:.2f}x "
              f"| {difference:.3g} |")


if __name__ == "__main__":
    main()
