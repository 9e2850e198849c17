"""A profiled step's trace written as ``.json.gz``: torch's own export of a ``.gz`` path against
:func:`turnrl.training.device_idle.export_compressed` (gzip's fastest level), on traces of the same work.

    python benchmarks/trace_export.py [--passes 300] [--rounds 3]

The work is a small MLP's forward and backward, ``--passes`` times, traced with Python stacks as
``run.profile_steps`` traces a step; each way exports its own trace of it (a trace exports once). Prints the seconds
of each export (the best of ``--rounds``), the ratio, and the files' sizes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from turnrl.training.device_idle import export_compressed


def traced(passes: int) -> torch.profiler.profile:
    """A trace (CPU activity and Python stacks) of ``passes`` forward and backward passes of a small MLP."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    trace = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True)
    with trace:
        for _ in range(passes):
            model(torch.randn(8, 64)).sum().backward()
    return trace


def timed(export, passes: int, path: Path) -> float:
    trace = traced(passes)
    start = time.perf_counter()
    export(trace, path)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        torch_gz, fast_gz = Path(folder) / "torch.json.gz", Path(folder) / "fast.json.gz"
        torch_s = min(timed(lambda trace, path: trace.export_chrome_trace(str(path)), args.passes, torch_gz)
                      for _ in range(args.rounds))
        fast_s = min(timed(export_compressed, args.passes, fast_gz) for _ in range(args.rounds))
        print(f"torch's .gz export: {torch_s:.3f} s, {torch_gz.stat().st_size / 2**20:.1f} MiB")
        print(f"export_compressed:  {fast_s:.3f} s, {fast_gz.stat().st_size / 2**20:.1f} MiB")
        larger = fast_gz.stat().st_size / torch_gz.stat().st_size
        print(f"ratio: {torch_s / fast_s:.2f}x faster, the file {larger:.2f}x the size")


if __name__ == "__main__":
    main()
