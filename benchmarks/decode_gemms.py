"""A decode step's GEMMs alone: cuBLAS (what the engine runs) beside cuBLASLt, Inductor's autotuned GEMMs and
hand-tiled Triton GEMMs.

The five projections of a decoder (q/k/v stacked, o, gate/up stacked, down, the LM head) at ``--batch`` rows,
bf16, each timed as the engine runs it, in a CUDA graph (``--iters`` replays of the step's calls, timed with CUDA
events). A step reads each layer's weights once, so the graph runs a projection once over each of the
decoder's layers, a weight apiece: one weight called again and again stays partly in the GPU's L2 (50 MB on an
H200, as large as the 3B decoder's down projection), which flatters the smaller GEMMs. The ratio is cuBLAS's time
over each library's in the same run, and the step's total counts the layer GEMMs once a layer.

``triton`` is the best of a sweep of hand-tiled Triton GEMMs (:func:`small_batch_linear`) for the batch: every
row in one tile, the weight's rows split into tiles of ``BLOCK_N``, and for the narrower projections the inner
dim split into ``SPLIT`` stretches (split-K) so that enough programs read the weight at once, each stretch
writing float32 partial sums that a second kernel adds; its time includes that sum. It is the kernel a
bandwidth-bound small-batch GEMM would be written as, measured to see whether cuBLAS leaves anything on the
table at decode sizes.

``--shape 0.5b``: Qwen2.5-0.5B's (24 layers); ``--shape 3b``: Qwen2.5-3B's, the decoder of ``vlm-3b`` (36
layers), whose decode steps run 64 rows in the VisGym recipe. The bounds are the time to read the weight at the
GPU's memory bandwidth and to do the FLOPs at its dense bf16 peak (``turnrl/models/throughput.py``'s tables;
an H100's 3.35 TB/s and 989 TFLOP/s for a GPU they do not name); the share is the read bound over cuBLAS's time.

    python benchmarks/decode_gemms.py --batch 256 64
    python benchmarks/decode_gemms.py --shape 3b --batch 64 --no-autotune
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.models.throughput import peak_bandwidth, peak_flops  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch without Triton: the sweep is left out
    triton = None

SHAPES: dict[str, tuple[int, dict[str, tuple[int, int, bool]]]] = {
    "0.5b": (24, {"qkv": (896, 1152, True), "o": (896, 896, False), "gate_up": (896, 9728, False),
                  "down": (4864, 896, False), "lm_head": (896, 151936, False)}),
    "3b": (36, {"qkv": (2048, 2560, True), "o": (2048, 2048, False), "gate_up": (2048, 22016, False),
                "down": (11008, 2048, False), "lm_head": (2048, 151936, False)}),
}
"""shape -> (layers, name -> (in features, out features, bias)) of Qwen2.5's 0.5B and 3B decoders."""


if triton is not None:

    @triton.jit
    def _small_batch_linear_kernel(X, W, Bias, Out, rows, out_features, in_features, stretch,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                   SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """One program: all ``rows`` (at most BLOCK_M) times BLOCK_N rows of the weight, over one stretch of the
        inner dim (``stretch`` long, a multiple of BLOCK_K). With SPLIT > 1 it writes float32 partial sums, Shape
        (SPLIT, rows, out_features), the first stretch's with the bias in; else the result with it."""
        tile = tl.program_id(0)
        part = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k = part * stretch + tl.arange(0, BLOCK_K)
        x_at = X + m[:, None] * in_features + k[None, :]
        w_at = W + n[:, None] * in_features + k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, stretch, BLOCK_K):
            x = tl.load(x_at, mask=m[:, None] < rows, other=0.0)
            w = tl.load(w_at, mask=n[:, None] < out_features, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
            x_at += BLOCK_K
            w_at += BLOCK_K
        if HAS_BIAS:
            bias = tl.load(Bias + n, mask=n < out_features, other=0.0).to(tl.float32)
            acc += tl.where(part == 0, 1.0, 0.0) * bias[None, :]
        inside = (m[:, None] < rows) & (n[None, :] < out_features)
        at = Out + part * rows * out_features + m[:, None] * out_features + n[None, :]
        tl.store(at, acc.to(Out.dtype.element_ty), mask=inside)


@dataclass(frozen=True)
class Tiling:
    """One setting of :func:`small_batch_linear`."""

    block_n: int
    block_k: int
    split: int
    stages: int
    warps: int

    def fits(self, rows: int, in_features: int) -> bool:
        """Whether the inner dim splits into whole blocks and the pipeline's tiles fit a GPU's shared memory."""
        block_m = max(16, triton.next_power_of_2(rows)) if triton is not None else rows
        tiles = (block_m + self.block_n) * self.block_k * 2 * self.stages
        return in_features % (self.split * self.block_k) == 0 and tiles <= 200 * 1024


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiling: Tiling,
                       partials: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by :func:`_small_batch_linear_kernel` (split-K partials summed in float32).

    Args:
        x: Shape (rows, in) with rows <= 128. weight: Shape (out, in). bias: Shape (out,) or None.
            partials: a float32 buffer of Shape (split, rows, out) for split-K (allocated when None).

    Returns:
        Shape (rows, out), in ``x``'s dtype.
    """
    rows, in_features = x.shape
    out_features = weight.shape[0]
    if not tiling.fits(rows, in_features):
        raise ValueError(f"{tiling} does not tile {rows} x {in_features}")
    block_m = max(16, triton.next_power_of_2(rows))
    if tiling.split == 1:
        out = x.new_empty(rows, out_features)
    else:
        out = partials if partials is not None else x.new_empty(tiling.split, rows, out_features,
                                                                 dtype=torch.float32)
    grid = (triton.cdiv(out_features, tiling.block_n), tiling.split)
    options = {} if x.device.type == "cpu" else {"num_stages": tiling.stages, "num_warps": tiling.warps}
    _small_batch_linear_kernel[grid](x, weight, weight if bias is None else bias, out, rows, out_features,
                                     in_features, in_features // tiling.split, BLOCK_M=block_m,
                                     BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, SPLIT=tiling.split,
                                     HAS_BIAS=bias is not None, **options)
    return out if tiling.split == 1 else out.sum(0).to(x.dtype)


def tilings(out_features: int) -> list[Tiling]:
    """The sweep: split-K only where the weight has too few rows to keep the GPU's SMs reading (under 16k)."""
    splits = (1,) if out_features >= 16384 else (1, 2, 4, 8)
    return [Tiling(n, k, split, stages, warps)
            for split, n, k, stages, warps in itertools.product(splits, (32, 64, 128), (128, 256), (3, 5), (4, 8))
            if not (warps == 8 and n < 64)]


def graph_us(calls: list[Callable[[], object]], iters: int) -> float:
    """Device microseconds of one call of ``calls``: the list captured in a CUDA graph, replayed ``iters`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:  # compilation, autotuning, allocator
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters / len(calls)


def best_tiling(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, expected: torch.Tensor,
                iters: int, seconds: float) -> tuple[float, Tiling | None, float]:
    """The fastest of :func:`tilings` over ``weights`` (microseconds a call, the tiling, its largest difference
    from ``expected``, cuBLAS's product over the first weight); settings tried for at most ``seconds``."""
    best: tuple[float, Tiling | None, float] = (float("inf"), None, 0.0)
    start = time.perf_counter()
    rows, in_features = x.shape
    for tiling in tilings(weights[0].shape[0]):
        if time.perf_counter() - start > seconds:
            break
        if not tiling.fits(rows, in_features):
            continue
        partials = None if tiling.split == 1 else x.new_empty(tiling.split, rows, weights[0].shape[0],
                                                               dtype=torch.float32)
        try:
            got = small_batch_linear(x, weights[0], bias, tiling, partials)
            difference = float((got.float() - expected).abs().max())
            us = graph_us([partial(small_batch_linear, x, w, bias, tiling, partials) for w in weights], iters)
        except Exception as error:  # a setting the GPU cannot run (out of resources): the next one  # noqa: BLE001
            print(f"    {tiling}: {type(error).__name__}", flush=True)
            continue
        if us < best[0]:
            best = (us, tiling, difference)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-autotune", action="store_true", help="leave out Inductor's autotuning (minutes)")
    parser.add_argument("--sweep-seconds", type=float, default=30.0,
                        help="time for the Triton sweep a projection and batch (0: leave it out)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_gemms.py times GPU kernels: run it on a machine with a CUDA GPU")
    device = torch.device("cuda")
    layers, projections = SHAPES[args.shape]
    bandwidth = peak_bandwidth(device) or 3.35e12
    flops = peak_flops(device) or 989e12
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; the {args.shape} shape, bf16, "
          f"microseconds per GEMM, each layer's own weight (ratio: cuBLAS's time over this one's); bounds at "
          f"{bandwidth / 1e12:.2f} TB/s and {flops / 1e12:.0f} TFLOP/s")
    for batch in args.batch:
        totals: dict[str, float] = {}
        timed: dict[str, int] = {}
        bound = 0.0
        for name, (k, n, with_bias) in projections.items():
            copies = 1 if name == "lm_head" else layers
            weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            bias = torch.randn(n, device=device, dtype=torch.bfloat16) if with_bias else None
            x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
            times = {}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                times[library] = graph_us([partial(F.linear, x, w, bias) for w in weights], args.iters)
            torch.backends.cuda.preferred_blas_library("cublas")
            notes = []
            if not args.no_autotune:
                start = time.perf_counter()
                tuned = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                tuned(x, weights[0], bias)
                notes.append(f"autotuning {time.perf_counter() - start:.0f} s")
                times["autotune"] = graph_us([partial(tuned, x, w, bias) for w in weights], args.iters)
            if triton is not None and args.sweep_seconds > 0 and batch <= 128:
                expected = F.linear(x, weights[0], bias).float()
                us, tiling, difference = best_tiling(x, weights, bias, expected, args.iters, args.sweep_seconds)
                if tiling is not None:
                    times["triton"] = us
                    notes.append(f"triton: {tiling}, largest difference {difference:.3g}")
            del weights
            read_us = k * n * 2 / bandwidth * 1e6
            flops_us = 2 * batch * k * n / flops * 1e6
            cells = "  ".join(f"{lib} {us:6.1f} ({times['cublas'] / us:.2f}x)" for lib, us in times.items())
            print(f"batch {batch:>4} {name:<8} {cells}  bounds: read {read_us:.1f}, flops {flops_us:.1f}; "
                  f"cuBLAS at {read_us / times['cublas']:.0%} of the read bound"
                  + (f"  ({'; '.join(notes)})" if notes else ""), flush=True)
            repeats = 1 if name == "lm_head" else layers
            bound += max(read_us, flops_us) * repeats
            for library, us in times.items():
                totals[library] = totals.get(library, 0.0) + us * repeats
                timed[library] = timed.get(library, 0) + 1
        complete = {lib: us for lib, us in totals.items() if timed[lib] == len(projections)}  # no gaps
        print(f"batch {batch:>4} a step's GEMMs: " + "  ".join(
            f"{lib} {us:.0f} us ({totals['cublas'] / us:.2f}x)" for lib, us in complete.items())
            + f"; bound {bound:.0f} us (cuBLAS at {bound / totals['cublas']:.0%})", flush=True)


if __name__ == "__main__":
    main()
