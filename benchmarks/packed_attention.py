"""The trainer's attention over packed sequences: SDPA's flash kernel against cuDNN's, per sequence (GPU).

A training pass attends each packed sequence on its own, causally (:mod:`turnrl.training.packed_attention`), so
a VisGym ``vlm-3b`` step's reference and update passes call SDPA once a sequence a layer, about 64 sequences of
about 4,000 tokens, each of a length the run has not met before. This times those calls at the decoder's shape
(``--heads`` query and ``--kv-heads`` key/value heads of ``--head-dim``, Qwen2.5-3B's by default) with each SDPA
backend it names:

- ``flash``: SDPA's flash kernel on each sequence as it is (what ``model.packed_attention=flash`` runs);
- ``cudnn``: cuDNN's attention on each sequence as it is; cuDNN plans each new shape on the host, so the first
  pass over new lengths is timed apart from a pass over lengths it has met;
- ``cudnn-bucketed``: cuDNN's on each sequence padded at its end to a multiple of ``--bucket`` tokens (causal
  attention: no real query reads a padded key), so a run meets few shapes;
- ``cudnn-overlap``: the same lengths, the padding read in place from the tokens after the sequence in its pack
  (the next sequence's: no real query reads them either, and their outputs get no gradient), copied only for a
  pack's last sequence, every sequence in one layout (the trainer's
  :func:`~turnrl.training.packed_attention.bucketed`, what ``model.packed_attention=cudnn`` runs).

The sequences are laid end to end in packs of at most ``--pack-tokens``, as the trainer's micro-batches are.

For each it prints milliseconds for all the sequences forward (a scoring pass), forward and backward (an
update's), a first pass over new lengths and a second over other new lengths near them (a run's next step: few
new buckets), the attention's TFLOP/s (causal: ``2 x 2 x heads x dim x L(L+1)/2``
forward, 2.5 times that backward) and the largest difference of its output and its queries' gradient from flash's.

    python benchmarks/packed_attention.py                       # a GPU: 64 sequences of 3,600-4,300 tokens
    python benchmarks/packed_attention.py --sequences 16 --backends flash cudnn-bucketed
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import mean_milliseconds, synchronize  # noqa: E402
from turnrl.training.packed_attention import bucketed  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "cudnn-bucketed": SDPBackend.CUDNN_ATTENTION, "cudnn-overlap": SDPBackend.CUDNN_ATTENTION}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, int], backend: str,
           bucket: int) -> torch.Tensor:
    """Causal attention of the sequence at ``bounds`` of a pack, Shape (1, heads, t, dim) queries, (1, kv_heads, t,
    dim) keys and values, with ``backend``; its output, Shape (1, heads, L, dim)."""
    start, end = bounds
    length = end - start
    padded = -(-length // bucket) * bucket if backend.startswith("cudnn-") else length
    if backend == "cudnn-overlap":
        q, k, v = (bucketed(x, start, end, bucket) for x in (q, k, v))
    else:
        q, k, v = (F.pad(x[:, :, start:end], (0, 0, 0, padded - length)) for x in (q, k, v))
    with sdpa_kernel([BACKENDS[backend]]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return out[:, :, :length]


def packs_of(lengths: list[int], pack_tokens: int) -> list[list[int]]:
    """The lengths in order, grouped into packs of at most ``pack_tokens`` (a longer sequence alone)."""
    packs: list[list[int]] = [[]]
    for length in lengths:
        if packs[-1] and sum(packs[-1]) + length > pack_tokens:
            packs.append([])
        packs[-1].append(length)
    return packs


def inputs(packs: list[list[int]], heads: int, kv_heads: int, dim: int, device: torch.device):
    """Each pack's queries, keys and values, laid out as a decoder's projections leave them (1, t, heads, dim)
    transposed to (1, heads, t, dim), and its sequences' bounds."""
    made = []
    for lengths in packs:
        t = sum(lengths)
        q, k, v = (torch.randn(1, t, h, dim, device=device, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        ends = list(itertools.accumulate(lengths))
        made.append((q, k, v, [(end - n, end) for n, end in zip(lengths, ends)]))
    return made


def one_pass(packs, backend: str, bucket: int, backward: bool) -> list[torch.Tensor]:
    """Every pack's attention, its sequences' outputs joined, and with ``backward`` its gradient (the output's sum
    of squares' halves)."""
    outs = []
    with torch.set_grad_enabled(backward):
        for q, k, v, bounds in packs:
            out = torch.cat([attend(q, k, v, b, backend, bucket) for b in bounds], dim=2)
            if backward:
                out.float().square().mul(0.5).sum().backward()
            outs.append(out.detach())
    return outs


def causal_flops(lengths: list[int], heads: int, dim: int) -> float:
    """Forward FLOPs of causal attention over the sequences (two products of ``heads x dim`` a query-key pair)."""
    return sum(4 * heads * dim * length * (length + 1) / 2 for length in lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--shortest", type=int, default=3600)
    parser.add_argument("--longest", type=int, default=4300)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--pack-tokens", type=int, default=8192, help="tokens a pack (algorithm.micro_batch_tokens)")
    parser.add_argument("--bucket", type=int, default=128, help="the padded variants' length multiple")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("packed_attention.py times SDPA's GPU kernels; run it on a machine with a CUDA GPU")
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.shortest, args.longest + 1, (args.sequences,), generator=generator).tolist()
    flops = causal_flops(lengths, args.heads, args.head_dim)
    print(f"{args.sequences} sequences of {min(lengths)}-{max(lengths)} tokens, {args.heads} query and "
          f"{args.kv_heads} key/value heads of {args.head_dim}, bf16, causal, on {torch.cuda.get_device_name()}")
    torch.manual_seed(args.seed)
    packs = inputs(packs_of(lengths, args.pack_tokens), args.heads, args.kv_heads, args.head_dim, device)
    reference_out, reference_grad = None, None
    print("| backend | first pass, new lengths (ms) | again, other new lengths (ms) | forward (ms) | TFLOP/s "
          "| forward and backward (ms) | TFLOP/s | output vs flash | dq vs flash |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for backend in args.backends:
        for x in (x for pack in packs for x in pack[:3]):
            x.grad = None
        # Lengths this process has not met, twice (each backend its own): the first pass meets new shapes, the
        # second new packs of lengths near the first's, as a run's next step does.
        firsts = []
        for shift in (2 * args.backends.index(backend) + 1, 2 * args.backends.index(backend) + 2):
            fresh = inputs(packs_of([length + shift for length in lengths], args.pack_tokens), args.heads,
                           args.kv_heads, args.head_dim, device)
            synchronize(device)
            start = time.perf_counter()
            one_pass(fresh, backend, args.bucket, backward=True)
            synchronize(device)
            firsts.append((time.perf_counter() - start) * 1e3)
        del fresh
        outs = one_pass(packs, backend, args.bucket, backward=True)
        dq = [pack[0].grad.clone() for pack in packs]
        forward = mean_milliseconds(partial(one_pass, packs, backend, args.bucket, False), device, args.repeats, 1)
        both = mean_milliseconds(partial(one_pass, packs, backend, args.bucket, True), device, args.repeats, 1)
        if reference_out is None:
            reference_out, reference_grad = outs, dq
        out_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, reference_out))
        grad_diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(dq, reference_grad))
        print(f"| {backend} | {firsts[0]:.1f} | {firsts[1]:.1f} | {forward:.1f} | {flops / forward / 1e9:.0f} | "
              f"{both:.1f} | {3.5 * flops / both / 1e9:.0f} | {out_diff:.3g} | {grad_diff:.3g} |")


if __name__ == "__main__":
    main()
