"""One decode step of the engine, alone: its kernels by device time, per engine variant.

``generation.py --profile`` profiles a whole call (prefill, host work and
sampling included); this script times the decode step itself, the part that
runs once per generated token: a cache filled to ``--context`` tokens for
``--batch`` rows, then ``--steps`` decode steps (CUDA-graph replays on a GPU)
and the sampler, timed and profiled per step. ``--prefill`` times a prefill
call instead: ``--batch`` fresh prompts of ``--context`` tokens in one forward
pass.

``--host-profile`` measures the other side, on a CPU: the engine's own Python
per decode step (scheduling, bookkeeping, stop checks, building inputs), with
the built-in ``tiny`` model's shape so that the model's compute is negligible.
It prints the wall time of a ``generate`` call per decode step, then, from
cProfile, the engine's functions by cumulative time and the costliest
functions overall, per step.

    python benchmarks/engine_profile.py --device cuda --batch 256 --context 640 --variants compiled,triton
    python benchmarks/engine_profile.py --device cuda --prefill --batch 32 --context 512 --variants compiled,triton
    python benchmarks/engine_profile.py --host-profile --batch 256 --context 64 --new 128
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generation import SHAPES, VARIANTS, build, short_error  # noqa: E402
from benchmarks.timing import mean_milliseconds, synchronize  # noqa: E402
from turnrl.config import EngineConfig  # noqa: E402
from turnrl.engine.forward import decoder_forward, final_logits  # noqa: E402
from turnrl.engine.llm_engine import Engine, SamplingParams  # noqa: E402


def give_rows_pages(engine: Engine, batch: int, positions: int) -> None:
    """Rows ``0 .. batch-1`` hold the pages of ``positions`` positions, as admitted sequences of that length do."""
    for row in range(batch):
        if not engine.cache.resize(row, positions):
            raise SystemExit(f"the key/value cache holds fewer than {batch} sequences of {positions} tokens: "
                             "raise kv_cache_gb in profile_variant")
    engine.cache.sync()


def decode_step(engine: Engine, batch: int, context: int):
    """A function that runs one decode step of ``batch`` rows at position ``context`` and samples from it."""
    give_rows_pages(engine, batch, context + 1)
    runner = engine.runner
    key_len = runner.key_len(context + 1, graphed=runner.use_graphs)
    tokens = torch.randint(0, engine.weights.shape.vocab_size, (batch,), device=engine.device)
    # Every step writes position ``context`` again; attention reads key_len positions all the same.
    positions = torch.full((batch,), context, dtype=torch.long, device=engine.device)
    temperature = torch.ones(batch, device=engine.device)

    def step() -> torch.Tensor:
        if runner.use_graphs:
            logits = runner.decode_graph(batch, key_len).run(tokens, positions)
        else:
            logits = runner.decode_logits(tokens, positions, key_len)
        return runner.sample_full(logits, temperature)[0]

    return step, key_len


def prefill_step(engine: Engine, batch: int, context: int):
    """A function that prefills ``batch`` fresh prompts of ``context`` tokens in one forward pass (one prefill
    chunk of the engine: ``prefill_chunk_tokens`` caps batch x context) and samples each one's first token."""
    give_rows_pages(engine, batch, context)
    runner = engine.runner
    key_len = runner.key_len(context)
    tokens = torch.randint(0, engine.weights.shape.vocab_size, (batch, context), device=engine.device)
    positions = torch.arange(context, device=engine.device).expand(batch, context)
    rows = torch.arange(batch, device=engine.device)
    temperature = torch.ones(batch, device=engine.device)
    weights = engine.weights

    @torch.no_grad()
    def step() -> torch.Tensor:
        hidden = decoder_forward(weights, engine.cache, runner.rope, tokens, positions, positions, rows, key_len,
                                 runner.kernels, runner.triton)
        logits = final_logits(hidden[:, -1], weights.norm.value, weights.lm_head.value, weights.shape.rms_eps)
        return runner.sample_full(logits, temperature)[0]

    return step, key_len


def profile_variant(model, dtype, device, variant: str, batch: int, context: int, steps: int, top: int,
                    prefill: bool = False) -> None:
    config = EngineConfig(kv_cache_gb=40.0, max_rows=batch, max_seq_len=context + 2, **VARIANTS[variant])  # type: ignore[arg-type]
    engine = Engine(model, config, dtype=dtype)
    step, key_len = (prefill_step if prefill else decode_step)(engine, batch, context)
    wall_ms = mean_milliseconds(step, device, steps, warmup=3)  # the warm-up: compilation, capture
    what = f"prefill of {batch} x {context} tokens" if prefill else f"decode, batch {batch}, key length {key_len}"
    print(f"\nengine {variant}: {what}: {wall_ms:.3f} ms per step (wall, with sampling)"
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


PHASES = {
    "schedule": "step, less prefill and decode: admitting, weight checks",
    "prefill": "building prefill inputs and bookkeeping, less the forward pass and sampling",
    "inputs": "a decode step, less the forward pass and sampling: positions, buckets, index tensors",
    "sampled": "handling sampled tokens, less the sampler: copy to host, counters, stop checks, finishing",
    "total": "all of the above",
}
"""The host phases of :func:`host_phases`."""


ENGINE_MODULES = ("llm_engine.py", "scheduler.py", "model_runner.py", "running.py", "rows.py", "sampling.py",
                  "forward.py")
"""The engine's modules whose functions the host profile lists."""

DEVICE_WORK = ("decoder_forward", "final_logits", "sample_untruncated", "sample_tokens", "decode_logits")
"""The engine's functions (of its module, or methods) that run the model and the sampler: on a GPU, their operators
run asynchronously; the rest of a step is host work that the GPU waits for."""


@contextlib.contextmanager
def timed_device_work(runner: Any) -> Iterator[list[float]]:
    """Wrap the :data:`DEVICE_WORK` functions of an engine's ``runner`` (its module's, its methods) in a timer
    while the block runs; yields ``[seconds]`` spent in them, filled in as they run (a call inside another counts
    once)."""
    spent, depth = [0.0], [0]
    module = sys.modules[type(runner).__module__]
    owners = [owner for owner in (module, runner) for name in DEVICE_WORK if hasattr(owner, name)]
    originals = [(owner, name, getattr(owner, name)) for owner in dict.fromkeys(owners) for name in DEVICE_WORK
                 if hasattr(owner, name)]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    spent[0] += time.perf_counter() - start

        return wrapper

    for owner, name, fn in originals:
        setattr(owner, name, timed(fn))
    try:
        yield spent
    finally:
        for owner, name, fn in originals:
            if owner is runner:
                delattr(runner, name)  # the class's method again
            else:
                setattr(owner, name, fn)


def host_phases(stats: dict) -> dict[str, float]:
    """Seconds of :meth:`Engine.step` per host phase (:data:`PHASES`), from cProfile's raw stats: each phase is a
    function's cumulative time less that of the calls in it that run the model or the sampler."""

    def cumulative(name: str, caller: str | None = None) -> float:
        total = 0.0
        for (file, _, function), (_, _, _, cum, callers) in stats.items():
            if function != name or Path(file).parent.name not in ("engine", "benchmarks"):
                continue
            if caller is None:
                total += cum
            else:
                total += sum(entry[3] for (_, _, who), entry in callers.items() if who == caller)
        return total

    sampler = cumulative("sample_untruncated") + cumulative("sample_tokens")
    # The prefill phase: planning the chunks, building and launching each, and reading their first tokens.
    prefill = (cumulative("prefill_plan") + cumulative("prefill") + cumulative("prefilled")
               + cumulative("_read", "_admit_and_prefill"))
    phases = {
        "step": cumulative("step"),
        "schedule": cumulative("step") - prefill - cumulative("_decode"),
        "prefill": prefill - cumulative("_prefill_logits", "prefill") - cumulative("_sample", "prefill"),
        "inputs": cumulative("_decode") - cumulative("decode_logits") - cumulative("_sample", "decode")
        - cumulative("run", "decode"),  # run: a CUDA graph's replay
        "sampled": cumulative("_sample") - sampler,
    }
    phases["total"] = sum(phases[p] for p in ("schedule", "prefill", "inputs", "sampled"))
    return phases


def host_profile(batch: int, prompt: int, new: int, repeats: int, top: int, stop_string: str | None) -> None:
    """Host time per decode step of ``generate`` calls on the ``tiny`` shape (float32, CPU, one thread)."""
    torch.set_num_threads(1)  # the tiny model gains nothing from threads; a shared machine only adds noise
    device = torch.device("cpu")
    model = build("tiny", device, torch.float32)
    vocab = SHAPES["tiny"]["vocab_size"]
    # A decode for stop strings: two letters per token, so that texts are cheap to make and stops can match.
    letters = [chr(ord("a") + i % 26) + chr(ord("a") + i // 26 % 26) for i in range(vocab)]
    engine = Engine(model, EngineConfig(kv_cache_gb=1.0, max_rows=batch, max_seq_len=prompt + new + 1, compile="false"),
                    decode=lambda ids: "".join(letters[i] for i in ids))
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=generator).tolist()
    stops = (stop_string,) if stop_string else ()
    params = [SamplingParams(temperature=1.0, max_new_tokens=new, stop_strings=stops)] * batch

    def run() -> None:
        engine.table.clear()  # every call prefills its prompts
        engine.generate(prompts, params)

    run()  # warm-up: allocator, first-call work
    steps = engine.stats.decode_steps
    with timed_device_work(engine.runner) as device_seconds:
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        seconds = time.perf_counter() - start
    steps = (engine.stats.decode_steps - steps) // repeats
    per_step = 1000 / repeats / steps
    print(f"host profile: tiny model, batch {batch}, prompt {prompt} + {new} new, stop strings {list(stops)}: "
          f"{1000 * seconds / repeats:.1f} ms per call, {steps} decode steps; per decode step (wall, no profiler): "
          f"{seconds * per_step:.3f} ms in all, {device_seconds[0] * per_step:.3f} ms in the model and the sampler "
          f"({', '.join(DEVICE_WORK)}), {(seconds - device_seconds[0]) * per_step:.3f} ms of engine host work")
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    # (file, line, name) -> (primitive calls, calls, own time, cumulative time, callers)
    rows = [(f"{Path(file).name}:{name}", calls, own, cumulative) for (file, _, name), (_, calls, own, cumulative, _)
            in stats.items()]
    total = sum(row[2] for row in rows)
    phases = host_phases(stats)
    print(f"cProfile (its overhead included), ms per decode step: {1000 * phases['step'] / steps:.3f} in Engine.step; "
          "the engine's host work outside the model's and the sampler's operators:")
    for phase, description in PHASES.items():
        print(f"  {1000 * phases[phase] / steps:>7.3f}  {phase:<10} {description}")
    print(f"\nthe engine's functions by cumulative time\n{'ms/step':>9} {'calls/step':>10}  name")
    engine_rows = [row for row in rows if row[0].split(":")[0] in ENGINE_MODULES]
    for name, calls, _, cumulative in sorted(engine_rows, key=lambda row: -row[3])[:top]:
        print(f"{1000 * cumulative / steps:>9.3f} {calls / steps:>10.1f}  {name}")
    print(f"\nall functions by own time\n{'ms/step':>9} {'share':>6} {'calls/step':>10}  name")
    for name, calls, own, _ in sorted(rows, key=lambda row: -row[2])[:top]:
        print(f"{1000 * own / steps:>9.3f} {100 * own / total:>5.1f}% {calls / steps:>10.1f}  {name[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, choices=list(SHAPES))
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--context", type=int, default=None, help="tokens cached per row")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--variants", default="fused,compiled", help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--prefill", action="store_true",
                        help="profile a prefill call of --batch prompts of --context tokens instead of a decode step")
    parser.add_argument("--host-profile", action="store_true",
                        help="the engine's host time per decode step on a CPU (tiny model; --batch, --context as "
                             "the prompt length, --new)")
    parser.add_argument("--new", type=int, default=128, help="--host-profile: tokens generated per sequence")
    parser.add_argument("--repeats", type=int, default=2, help="--host-profile: timed calls")
    parser.add_argument("--stop-string", default=None, help="--host-profile: a stop string every sequence carries")
    args = parser.parse_args()
    if args.host_profile:
        host_profile(args.batch or 256, args.context or 64, args.new, args.repeats, args.top, args.stop_string)
        return
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = args.preset or ("0.5b" if cuda else "small")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(preset, device, dtype)
    batch, context = args.batch or (256 if cuda else 16), args.context or (640 if cuda else 64)
    for variant in args.variants.split(","):
        try:
            profile_variant(model, dtype, device, variant, batch, context, args.steps, args.top, args.prefill)
        except Exception as error:  # one variant's failure is printed; the others still run
            print(f"\nengine {variant}: failed: {short_error(error)}")
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
