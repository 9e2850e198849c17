"""Generation throughput: turnrl's engine beside transformers' generate paths, in one run.

A Qwen2 decoder built from a config with random weights (the 0.5B preset has
Qwen2.5-0.5B's shapes: 24 layers, 896 wide, 14 query and 2 key/value heads,
a 151,936-token vocabulary), random prompts of ``--prompt`` tokens, and
``--new`` tokens sampled per prompt at temperature 1 (no end-of-turn token, so
every row generates them all). Rows, each timed after a warm-up run of the
same shape (compilation and graph capture happen there):

- ``generate``: transformers' ``generate`` with its default (dynamic) cache,
  the baseline of the last column (always run).
- ``generate static`` (``--with static``): ``cache_implementation="static"``
  (on a GPU, transformers compiles the decode step).
- ``generate_batch`` (``--with generate_batch``): transformers' continuous
  batching with paged attention, where the installed version has it.
- ``engine <variant>`` for each of ``--engine-variants`` (:data:`VARIANTS`):
  ``unfused`` (separate q/k/v and gate/up GEMMs, eager, CUDA graphs: the
  engine before fusion and compilation), ``fused`` (stacked projections,
  eager), ``compiled`` (stacked projections, torch.compile), all three with
  torch's attention up to the longest sequence and a compiled torch sampler;
  ``triton`` (``compiled`` with the Triton kernels: attention that reads each
  row to its own length, the fused rotary and cache write, the Triton sampler;
  the GPU default), ``no_graphs`` and ``compiled_no_graphs``.

Tokens/s counts generated tokens over the wall time of the call (prefill
included); ``x generate`` is the ratio against ``generate`` at the same batch;
``lp err`` is the mean |logprob - full forward pass| over a few of the run's
sampled sequences (a broken variant shows here, not only in its speed).
An engine row splits its call's seconds into ``prefill`` and ``decode``
(device time of that work, from CUDA events: forward passes and sampling) and
``host`` (the rest of the wall time: the engine's Python between them, while
the device waits). Every
row runs in its own try/except: a failing one prints its error and the table
goes on. ``--profile`` ends with the top kernels of one decode step of a
variant (torch.profiler, device time per step).

    python benchmarks/generation.py --device cuda                 # 0.5B, batch 64 and 256, 512 + 256
    python benchmarks/generation.py --device cuda --batch 256 --profile --profile-variant compiled
    python benchmarks/generation.py --quick                       # CPU, the small preset, a minute
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import synchronize  # noqa: E402
from turnrl.config import EngineConfig  # noqa: E402
from turnrl.engine.llm_engine import Engine, Result, SamplingParams  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    # Qwen2.5-3B's decoder (and the built-in vlm-3b's language model): tied embeddings of 151,936 rows.
    "3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=768, vocab_size=1024),
    # The built-in ``tiny`` model's shape: compute is negligible, so a call's time is the engine's host work.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab_size=512),
}


def build(preset: str, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[preset], max_position_embeddings=4096, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]


def timed(fn: Callable[[], object], device: torch.device) -> float:
    fn()  # warm-up: compilation, graph capture, allocator
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def hf_generate(model, prompts: torch.Tensor, new: int, **options) -> Callable[[], object]:
    mask = torch.ones_like(prompts)

    def run() -> object:
        return model.generate(prompts, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, **options)

    return run


def hf_generate_batch(model, prompts: torch.Tensor, new: int) -> Callable[[], object]:
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, eos_token_id=-1, pad_token_id=0)
    inputs = prompts.tolist()
    return lambda: model.generate_batch(inputs=inputs, generation_config=config)


VARIANTS: dict[str, dict[str, object]] = {
    "unfused": dict(fuse_projections=False, compile="false", triton="false"),
    "fused": dict(compile="false", triton="false"),
    "compiled": dict(compile="true", triton="false"),
    "triton": dict(compile="true", triton="true"),
    "no_graphs": dict(compile="false", cuda_graphs=False, triton="false"),
    "compiled_no_graphs": dict(compile="true", cuda_graphs=False, triton="false"),
}
"""Engine settings compared by ``--engine-variants`` (``EngineConfig`` fields)."""


def make_engine(model, prompts: torch.Tensor, new: int, dtype: torch.dtype, variant: str,
                prefill_chunk_tokens: int | None = None) -> Engine:
    rows = prompts.shape[0]
    chunk = {"prefill_chunk_tokens": prefill_chunk_tokens} if prefill_chunk_tokens else {}
    config = EngineConfig(kv_cache_gb=40.0, max_rows=rows, max_seq_len=prompts.shape[1] + new + 1,
                          **chunk, **VARIANTS[variant])  # type: ignore[arg-type]
    return Engine(model, config, dtype=dtype)


def engine_run(engine: Engine, prompts: torch.Tensor, new: int) -> Callable[[], list[Result]]:
    inputs = prompts.tolist()
    params = [SamplingParams(temperature=1.0, max_new_tokens=new)] * len(inputs)

    def run() -> list[Result]:
        engine.table.clear()  # every call prefills its prompts, as the other rows do
        return engine.generate(inputs, params)

    return run


def logprob_error(model, prompts: torch.Tensor, results: list[Result], count: int = 4) -> float:
    """Mean |engine logprob - full forward pass logprob| over the first ``count`` sampled sequences."""
    errors = []
    for prompt, result in zip(prompts[:count].tolist(), results[:count]):
        ids = torch.tensor([prompt + result.token_ids], device=prompts.device)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        sampled = torch.tensor(result.token_ids, device=prompts.device)
        reference = torch.log_softmax(logits, -1).gather(-1, sampled[:, None])[:, 0]
        errors.append((torch.tensor(result.logprobs, device=prompts.device) - reference).abs())
    return torch.cat(errors).mean().item()


def short_error(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:100] if lines else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, choices=list(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--engine-variants", default=None,
                        help=f"comma-separated, of {','.join(VARIANTS)} (default: fused,compiled,triton on a GPU, "
                             "unfused,fused on a CPU)")
    parser.add_argument("--with", dest="extra", nargs="*", default=[], choices=["static", "generate_batch"],
                        help="slower transformers rows to add")
    parser.add_argument("--skip", nargs="*", default=[], choices=["static", "generate_batch"],
                        help="rows to leave out: static generate_batch (the default)")
    parser.add_argument("--quick", action="store_true", help="CPU-sized: small preset, batch 8 and 32, 64 + 32")
    parser.add_argument("--profile", action="store_true",
                        help="profile decode steps of one variant at the largest batch")
    parser.add_argument("--profile-variant", default=None,
                        help="the variant --profile runs (default: the last listed)")
    parser.add_argument("--profile-new", type=int, default=64, help="tokens per sequence in the profiled run")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="the engine's prefill_chunk_tokens (default: EngineConfig's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    quick = args.quick or device.type == "cpu"
    preset = args.preset or ("small" if quick else "0.5b")
    batches = args.batch or ([8, 32] if quick else [64, 256])
    prompt_len = args.prompt or (64 if quick else 512)
    new = args.new or (32 if quick else 256)
    variants = (args.engine_variants or ("fused,compiled,triton" if device.type == "cuda" else "unfused,fused")
                ).split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown engine variants {unknown}; choose from {list(VARIANTS)}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(preset, device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    print(f"{preset} Qwen2, {dtype}, prompt {prompt_len} + {new} new tokens, on {name} "
          f"(torch {torch.__version__}, transformers {__import__('transformers').__version__})", flush=True)
    table: list[str] = []
    header = (f"{'batch':>5}  {'row':<28} {'seconds':>8} {'tokens/s':>10} {'x generate':>10} {'lp err':>8} "
              f"{'ms/step':>8} {'prefill':>8} {'decode':>8} {'host':>8}")
    print(header, flush=True)
    started = time.perf_counter()
    for batch in batches:
        prompts = torch.randint(0, SHAPES[preset]["vocab_size"], (batch, prompt_len), device=device)
        rows: list[tuple[str, Callable[[], Callable[[], object]]]] = [
            ("generate", partial(hf_generate, model, prompts, new))]
        if "static" in args.extra and "static" not in args.skip:
            rows.append(("generate static", partial(hf_generate, model, prompts, new, cache_implementation="static")))
        if "generate_batch" in args.extra and "generate_batch" not in args.skip:
            rows.append(("generate_batch", partial(hf_generate_batch, model, prompts, new)))
        baseline = None
        for label, make in rows:
            try:
                seconds = timed(make(), device)
            except Exception as error:  # a path the installed transformers lacks is reported, not fatal
                table.append(f"{batch:>5}  {label:<28} failed: {short_error(error)}")
                print(table[-1], flush=True)
                continue
            rate = batch * new / seconds
            baseline = baseline or (rate if label == "generate" else None)
            ratio = f"{rate / baseline:.1f}x" if baseline else "-"
            table.append(f"{batch:>5}  {label:<28} {seconds:>8.2f} {rate:>10,.0f} {ratio:>10} {'-':>8} {'-':>8} "
                         f"{'-':>8} {'-':>8} {'-':>8}")
            print(table[-1], flush=True)
        for variant in variants:
            label = f"engine {variant}"
            try:
                engine = make_engine(model, prompts, new, dtype, variant, args.prefill_chunk)
                run = engine_run(engine, prompts, new)
                run()  # warm-up: compilation, graph capture, allocator
                synchronize(device)
                steps = engine.stats.decode_steps
                engine.timer.enabled = True
                engine.timer.reset()
                start = time.perf_counter()
                results = run()
                synchronize(device)
                seconds = time.perf_counter() - start
                engine.timer.collect()
                prefill_s, decode_s = engine.timer.seconds["prefill"], engine.timer.seconds["decode"]
                step_ms = 1000 * seconds / max(1, engine.stats.decode_steps - steps)
                lp_error = logprob_error(model, prompts, results)
                label += "" if engine.kernels.compiled or "compiled" not in variant else " (fell back)"
            except Exception as failure:  # a variant that fails is reported; the others still run
                table.append(f"{batch:>5}  {label:<28} failed: {short_error(failure)}")
                print(table[-1], flush=True)
                continue
            finally:
                engine = run = None  # type: ignore[assignment]
            rate = batch * new / seconds
            ratio = f"{rate / baseline:.1f}x" if baseline else "-"
            table.append(f"{batch:>5}  {label:<28} {seconds:>8.2f} {rate:>10,.0f} {ratio:>10} {lp_error:>8.4f} "
                         f"{step_ms:>8.2f} {prefill_s:>8.3f} {decode_s:>8.3f} {seconds - prefill_s - decode_s:>8.3f}")
            print(table[-1], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\nAll rows ({time.perf_counter() - started:.0f} s; ms/step is the wall time of the call over its "
          "decode steps, prefill included; an engine row's prefill and decode are their device seconds, host the "
          "rest of the call's seconds):")
    print(header)
    print("\n".join(table), flush=True)
    if args.profile:
        variant = args.profile_variant or variants[-1]
        try:
            profile_engine(model, prompts, args.profile_new, dtype, device, variant,
                           prefill_chunk_tokens=args.prefill_chunk)
        except Exception as error:
            print(f"profile of {variant} failed: {short_error(error)}")


def profile_engine(model, prompts: torch.Tensor, new: int, dtype: torch.dtype, device: torch.device,
                   variant: str, top: int = 25, prefill_chunk_tokens: int | None = None) -> None:
    """Where one decode step spends its time: the top kernels by device time (host time on a CPU), per step."""
    from torch.profiler import ProfilerActivity, profile

    engine = make_engine(model, prompts, new, dtype, variant, prefill_chunk_tokens)
    run = engine_run(engine, prompts, new)
    run()
    synchronize(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = engine.stats.decode_steps
    with profile(activities=activities) as profiler:
        run()
        synchronize(device)
    steps = max(1, engine.stats.decode_steps - steps)
    events = profiler.key_averages()
    if cuda:
        # Kernels only (device-side events), not the host operators that launched them.
        kernels = [e for e in events if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
        timing = [(e.key, e.count, e.self_device_time_total) for e in kernels]
    else:
        timing = [(e.key, e.count, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0]
    timing.sort(key=lambda row: -row[2])
    total = sum(row[2] for row in timing)
    print(f"\nProfile: engine {variant}, batch {prompts.shape[0]}, prompt {prompts.shape[1]} + {new}; "
          f"{steps} decode steps; {'device' if cuda else 'host'} time {total / 1000:.1f} ms in all "
          f"({total / steps / 1000:.3f} ms per decode step, prefill included), "
          f"{sum(row[1] for row in timing) / steps:.0f} {'kernels' if cuda else 'operators'} per step")
    print(f"{'us/step':>9} {'share':>6} {'calls/step':>10}  name")
    for key, count, time_us in timing[:top]:
        print(f"{time_us / steps:>9.1f} {100 * time_us / total:>5.1f}% {count / steps:>10.1f}  {key[:100]}")

if __name__ == "__main__":
    main()
