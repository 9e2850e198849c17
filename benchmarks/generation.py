"""Generation throughput: turnrl's engine beside transformers' generate paths, in one run.

A Qwen2 decoder built from a config with random weights (the 0.5B preset has
Qwen2.5-0.5B's shapes: 24 layers, 896 wide, 14 query and 2 key/value heads,
a 151,936-token vocabulary), random prompts of ``--prompt`` tokens, and
``--new`` tokens sampled per prompt at temperature 1 (no end-of-turn token, so
every row generates them all). Rows, each timed after a warm-up run of the
same shape:

- ``generate``: transformers' ``generate`` with its default (dynamic) cache.
- ``generate static``: ``cache_implementation="static"`` (on a GPU, transformers
  compiles the decode step; the warm-up pays for that).
- ``generate_batch``: transformers' continuous batching with paged attention,
  where the installed version has it.
- ``engine``: turnrl's engine (CUDA-graph decode on a GPU); on a GPU also without graphs.

Tokens/s counts generated tokens over the wall time of the call (prefill
included). The last column is the ratio against ``generate`` at the same batch.

    python benchmarks/generation.py --device cuda                 # 0.5B, batch 64 and 256, 512 + 256
    python benchmarks/generation.py --quick                       # CPU, the small preset, a minute
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.config import EngineConfig  # noqa: E402
from turnrl.engine.engine import Engine, SamplingParams  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=768, vocab_size=1024),
}


def build(preset: str, device: torch.device, dtype: torch.dtype) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[preset], max_position_embeddings=4096, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def engine_run(model, prompts: torch.Tensor, new: int, dtype: torch.dtype, graphs: bool = True) -> Callable[[], object]:
    rows = prompts.shape[0]
    engine = Engine(model, EngineConfig(kv_cache_gb=40.0, max_rows=rows, max_seq_len=prompts.shape[1] + new + 1,
                                        cuda_graphs=graphs), dtype=dtype)
    inputs = prompts.tolist()
    params = [SamplingParams(temperature=1.0, max_new_tokens=new)] * rows

    def run() -> object:
        engine.table.clear()  # every call prefills its prompts, as the other rows do
        return engine.generate(inputs, params)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, choices=list(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=None)
    parser.add_argument("--prompt", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--skip", nargs="*", default=[],
                        help="rows to leave out: static generate_batch no_graphs")
    parser.add_argument("--quick", action="store_true", help="CPU-sized: small preset, batch 8 and 32, 64 + 32")
    parser.add_argument("--profile", action="store_true", help="profile one engine run at the largest batch")
    args = parser.parse_args()
    device = torch.device(args.device)
    quick = args.quick or device.type == "cpu"
    preset = args.preset or ("small" if quick else "0.5b")
    batches = args.batch or ([8, 32] if quick else [64, 256])
    prompt_len = args.prompt or (64 if quick else 512)
    new = args.new or (32 if quick else 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build(preset, device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    print(f"{preset} Qwen2, {dtype}, prompt {prompt_len} + {new} new tokens, on {name} "
          f"(torch {torch.__version__}, transformers {__import__('transformers').__version__})")
    print(f"{'batch':>5}  {'backend':<16} {'seconds':>8} {'tokens/s':>10} {'x generate':>10}")
    for batch in batches:
        prompts = torch.randint(0, SHAPES[preset]["vocab_size"], (batch, prompt_len), device=device)
        rows: list[tuple[str, Callable[[], object]]] = [("generate", hf_generate(model, prompts, new))]
        if "static" not in args.skip:
            rows.append(("generate static", hf_generate(model, prompts, new, cache_implementation="static")))
        if "generate_batch" not in args.skip and hasattr(model, "generate_batch"):
            rows.append(("generate_batch", hf_generate_batch(model, prompts, new)))
        rows.append(("engine", engine_run(model, prompts, new, dtype)))
        if device.type == "cuda" and "no_graphs" not in args.skip:
            rows.append(("engine, no graphs", engine_run(model, prompts, new, dtype, graphs=False)))
        baseline = None
        for label, run in rows:
            try:
                seconds = timed(run, device)
            except Exception as error:  # a path the installed transformers lacks is reported, not fatal
                print(f"{batch:>5}  {label:<16} failed: {type(error).__name__}: {str(error).splitlines()[0][:90]}")
                continue
            rate = batch * new / seconds
            baseline = baseline or (rate if label == "generate" else None)
            ratio = f"{rate / baseline:.1f}x" if baseline else "-"
            print(f"{batch:>5}  {label:<16} {seconds:>8.2f} {rate:>10,.0f} {ratio:>10}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.profile:
        profile_engine(model, prompts, new, dtype, device)


def profile_engine(model, prompts: torch.Tensor, new: int, dtype: torch.dtype, device: torch.device) -> None:
    """Where an engine run spends its time: the top operators by device time and by host time."""
    from torch.profiler import ProfilerActivity, profile

    run = engine_run(model, prompts, new, dtype)
    run()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        run()
        synchronize(device)
    for key in (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        print(profiler.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
