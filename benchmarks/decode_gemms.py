"""A decode step's GEMMs alone: cuBLAS (what the engine runs) beside cuBLASLt and Inductor's autotuned GEMMs.

The five projections of a decoder (q/k/v stacked, o, gate/up stacked, down, the LM head) at ``--batch`` rows,
bf16, each timed as the engine runs it, in a CUDA graph (:func:`benchmarks.attention.timed_ms`); the ratio is
cuBLAS's time over each library's in the same run, and the step's total counts the layer GEMMs once a layer.
``--shape 0.5b``: Qwen2.5-0.5B's (24 layers); ``--shape 3b``: Qwen2.5-3B's, the decoder of ``vlm-3b`` (36
layers), whose decode steps run 64 rows in the VisGym recipe. The bounds are the time to read the weight at the
GPU's memory bandwidth and to do the FLOPs at its dense bf16 peak (``turnrl/models/throughput.py``'s tables;
an H100's 3.35 TB/s and 989 TFLOP/s for a GPU they do not name); the share is the read bound over cuBLAS's time.

    python benchmarks/decode_gemms.py --batch 256 64
    python benchmarks/decode_gemms.py --shape 3b --batch 64 --no-autotune
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention import timed_ms  # noqa: E402
from turnrl.models.throughput import peak_bandwidth, peak_flops  # noqa: E402

SHAPES: dict[str, tuple[int, dict[str, tuple[int, int, bool]]]] = {
    "0.5b": (24, {"qkv": (896, 1152, True), "o": (896, 896, False), "gate_up": (896, 9728, False),
                  "down": (4864, 896, False), "lm_head": (896, 151936, False)}),
    "3b": (36, {"qkv": (2048, 2560, True), "o": (2048, 2048, False), "gate_up": (2048, 22016, False),
                "down": (11008, 2048, False), "lm_head": (2048, 151936, False)}),
}
"""shape -> (layers, name -> (in features, out features, bias)) of Qwen2.5's 0.5B and 3B decoders."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-autotune", action="store_true", help="leave out Inductor's autotuning (minutes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_gemms.py times GPU kernels: run it on a machine with a CUDA GPU")
    device = torch.device("cuda")
    layers, projections = SHAPES[args.shape]
    bandwidth = peak_bandwidth(device) or 3.35e12
    flops = peak_flops(device) or 989e12
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; the {args.shape} shape, bf16, "
          f"microseconds per GEMM (ratio: cuBLAS's time over this one's); bounds at {bandwidth / 1e12:.2f} TB/s "
          f"and {flops / 1e12:.0f} TFLOP/s")
    for batch in args.batch:
        totals: dict[str, float] = {}
        bound = 0.0
        for name, (k, n, with_bias) in projections.items():
            weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            bias = torch.randn(n, device=device, dtype=torch.bfloat16) if with_bias else None
            x = torch.randn(batch, k, device=device, dtype=torch.bfloat16)
            times = {}
            for library in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(library)
                times[library] = 1000 * timed_ms(partial(F.linear, x, weight, bias), args.iters)
            torch.backends.cuda.preferred_blas_library("cublas")
            compile_s = 0.0
            if not args.no_autotune:
                start = time.perf_counter()
                tuned = torch.compile(partial(F.linear, weight=weight, bias=bias), mode="max-autotune-no-cudagraphs",
                                      dynamic=False)
                tuned(x)
                compile_s = time.perf_counter() - start
                times["autotune"] = 1000 * timed_ms(partial(tuned, x), args.iters)
            read_us = k * n * 2 / bandwidth * 1e6
            flops_us = 2 * batch * k * n / flops * 1e6
            cells = "  ".join(f"{lib} {us:6.1f} ({times['cublas'] / us:.2f}x)" for lib, us in times.items())
            print(f"batch {batch:>4} {name:<8} {cells}  bounds: read {read_us:.1f}, flops {flops_us:.1f}; "
                  f"cuBLAS at {read_us / times['cublas']:.0%} of the read bound"
                  + (f"  (autotuning {compile_s:.0f} s)" if compile_s else ""), flush=True)
            repeats = 1 if name == "lm_head" else layers
            bound += max(read_us, flops_us) * repeats
            for library, us in times.items():
                totals[library] = totals.get(library, 0.0) + us * repeats
        print(f"batch {batch:>4} a step's GEMMs: " + "  ".join(
            f"{lib} {us:.0f} us ({totals['cublas'] / us:.2f}x)" for lib, us in totals.items())
            + f"; bound {bound:.0f} us (cuBLAS at {bound / totals['cublas']:.0%})", flush=True)


if __name__ == "__main__":
    main()
