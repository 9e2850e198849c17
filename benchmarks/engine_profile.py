"""One decode step of the engine, alone: its kernels by device time, per engine variant.

``generation.py --profile`` profiles a whole call (prefill, host work and
sampling included); this script times the decode step itself, the part that
runs once per generated token: a cache filled to ``--context`` tokens for
``--batch`` rows, then ``--steps`` decode steps (CUDA-graph replays on a GPU)
and the sampler, timed and profiled per step.

    python benchmarks/engine_profile.py --device cuda --batch 256 --context 640 --variants fused,compiled
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generation import SHAPES, VARIANTS, build, short_error, synchronize  # noqa: E402
from turnrl.config import EngineConfig  # noqa: E402
from turnrl.engine.engine import Engine  # noqa: E402
from turnrl.engine.sampling import sample_untruncated  # noqa: E402


def decode_step(engine: Engine, batch: int, context: int):
    """A function that runs one decode step of ``batch`` rows at position ``context`` and samples from it."""
    engine._reserve(context + 1)
    key_len = engine._key_len(context + 1, graphed=engine.use_graphs)
    tokens = torch.randint(0, engine.weights.shape.vocab_size, (batch,), device=engine.device)
    # Writing at the scratch column keeps the cache as it is; attention reads key_len positions all the same.
    positions = torch.full((batch,), context, dtype=torch.long, device=engine.device)
    temperature = torch.ones(batch, device=engine.device)
    sampler = engine._sample_untruncated if engine.kernels.compiled else sample_untruncated

    def step() -> torch.Tensor:
        if engine.use_graphs:
            logits = engine._graph(batch, key_len).run(tokens, positions)
        else:
            logits = engine._decode_logits(tokens, positions, key_len)
        return sampler(logits, temperature)[0]

    return step, key_len


def profile_variant(model, dtype, device, variant: str, batch: int, context: int, steps: int, top: int) -> None:
    config = EngineConfig(kv_cache_gb=40.0, max_rows=batch, max_seq_len=context + 2, **VARIANTS[variant])  # type: ignore[arg-type]
    engine = Engine(model, config, dtype=dtype)
    step, key_len = decode_step(engine, batch, context)
    for _ in range(3):  # compilation, capture
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    wall_ms = 1000 * (time.perf_counter() - start) / steps
    print(f"\nengine {variant}: batch {batch}, key length {key_len}: {wall_ms:.3f} ms per step (wall, with sampling)"
          f"{'' if engine.kernels.compiled or 'compiled' not in variant else ' -- compile fell back to eager'}")
    if device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            step()
        synchronize(device)
    kernels = [(e.key, e.count, e.self_device_time_total) for e in profiler.key_averages()
               if e.self_device_time_total > 0]
    kernels.sort(key=lambda row: -row[2])
    total = sum(row[2] for row in kernels)
    print(f"device time {total / steps / 1000:.3f} ms per step in {sum(r[1] for r in kernels) / steps:.0f} kernels")
    print(f"{'us/step':>9} {'share':>6} {'calls/step':>10}  name")
    for key, count, time_us in kernels[:top]:
        print(f"{time_us / steps:>9.1f} {100 * time_us / total:>5.1f}% {count / steps:>10.1f}  {key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="tokens cached per row")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--variants", default="fused,compiled", help=f"comma-separated, of {','.join(VARIANTS)}")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = args.preset or ("0.5b" if cuda else "small")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(preset, device, dtype)
    batch, context = args.batch or (256 if cuda else 16), args.context or (640 if cuda else 64)
    for variant in args.variants.split(","):
        try:
            profile_variant(model, dtype, device, variant, batch, context, args.steps, args.top)
        except Exception as error:  # one variant's failure is printed; the others still run
            print(f"\nengine {variant}: failed: {short_error(error)}")
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
