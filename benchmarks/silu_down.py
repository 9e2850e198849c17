"""A decode step's SwiGLU product and down projection: one Triton kernel beside the compiled product and cuBLAS.

At ``--batch`` rows and the ``--shape``'s sizes (the 3B's: hidden 2,048, intermediate 11,008, 36 layers), each way
runs over every layer's own weight in turn, as a decode step reads them (one weight called again and again stays
in the GPU's L2), ``--iters`` times in a CUDA graph timed with CUDA events: the engine's way before this kernel
(``F.silu(gate) * up`` compiled, then ``F.linear``: cuBLAS, which splits the inner dim and adds its partial sums
in a kernel of its own) and :func:`~turnrl.engine.silu_down.silu_down` at each setting. Microseconds a layer, the
ratio against the first way in the same run, and the share of the memory bandwidth that reading the weight at
that speed is (``--peak-tbps`` for a GPU not in turnrl's table).

    python benchmarks/silu_down.py --shape 3b --batch 64
    python benchmarks/silu_down.py --shape 3b --batch 64 32 --splits 2 4 8 --blocks 32 64 128 --stages 3 4 5
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention import timed_ms  # noqa: E402
from turnrl.engine.silu_down import default_split, silu_down  # noqa: E402
from turnrl.models.throughput import peak_bandwidth  # noqa: E402

SHAPES = {"0.5b": (24, 896, 4864), "3b": (36, 2048, 11008), "7b": (28, 3584, 18944)}
"""shape -> (layers, hidden, intermediate) of Qwen2.5's decoders."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="3b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--splits", type=int, nargs="+", default=None, help="default: the kernel's own choice")
    parser.add_argument("--blocks", type=int, nargs="+", default=[64], help="output tiles (BLOCK_N)")
    parser.add_argument("--block-k", type=int, nargs="+", default=[64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=[4])
    parser.add_argument("--peak-tbps", type=float, default=0.0, help="the GPU's memory bandwidth (0: turnrl's table)")
    args = parser.parse_args()
    device = torch.device("cuda")
    layers, hidden, inner = SHAPES[args.shape]
    bandwidth = peak_bandwidth(device, 1e12 * args.peak_tbps)
    weights = [torch.randn(hidden, inner, device=device, dtype=torch.bfloat16) / inner**0.5 for _ in range(layers)]
    read = hidden * inner * 2  # one layer's weight, bf16
    arrivals = torch.zeros(1024, dtype=torch.int32, device=device)

    @torch.compile
    def product(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; the {args.shape} shape ({layers} layers, "
          f"hidden {hidden}, intermediate {inner}), bf16; microseconds a layer")
    print(f"{'batch':>5} {'way':<44} {'us':>8} {'ratio':>7} {'bandwidth':>9}")
    for batch in args.batch:
        gate_up = torch.randn(batch, 2 * inner, device=device, dtype=torch.bfloat16)
        expected = F.linear(product(gate_up), weights[0])
        baseline = timed_ms(lambda gate_up=gate_up: [F.linear(product(gate_up), w) for w in weights],
                            args.iters) / layers
        share = f"{read / (baseline / 1000) / bandwidth:.0%}" if bandwidth else "n/a"
        print(f"{batch:>5} {'compiled silu * up, then cuBLAS':<44} {1000 * baseline:>8.1f} {1.0:>6.2f}x {share:>9}",
              flush=True)
        for split, block_n, block_k, warps, stages in itertools.product(args.splits or [None], args.blocks,
                                                                         args.block_k, args.warps, args.stages):
            def fused(split=split, block_n=block_n, block_k=block_k, warps=warps, stages=stages,
                      gate_up=gate_up) -> list:
                return [silu_down(gate_up, w, arrivals, split=split, block_n=block_n, block_k=block_k,
                                  num_warps=warps, num_stages=stages) for w in weights]
            splits = f"{split}" if split else f"{default_split(hidden, block_n, device)} (auto)"
            label = f"one kernel: split {splits} block {block_n}x{block_k} w{warps} s{stages}"
            try:
                error = (fused()[0].float() - expected.float()).abs().max().item()
                ms = timed_ms(fused, args.iters) / layers
            except Exception as failure:  # a setting the GPU cannot run (shared memory): printed, not fatal
                print(f"{batch:>5} {label:<44} {type(failure).__name__}", flush=True)
                continue
            share = f"{read / (ms / 1000) / bandwidth:.0%}" if bandwidth else "n/a"
            print(f"{batch:>5} {label:<44} {1000 * ms:>8.1f} {baseline / ms:>6.2f}x {share:>9}  (max diff {error:.3g})",
                  flush=True)


if __name__ == "__main__":
    main()
