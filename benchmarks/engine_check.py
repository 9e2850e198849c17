"""The engine against transformers at real size on a GPU: greedy tokens and sampling logprobs.

The 0.5B Qwen2 of ``generation.py`` (random weights). In float32, greedy tokens
from the engine (CUDA-graph decode) are compared with ``generate``'s token for
token; in bf16, the engine's sampling logprobs are compared with a full forward
pass of the model over prompt and response (the mismatch the trainer sees), and
greedy agreement is reported (bf16 rounding differs between the two forward
implementations, so near-ties can go either way).

    python benchmarks/engine_check.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.generation import SHAPES, build  # noqa: E402
from turnrl.config import EngineConfig  # noqa: E402
from turnrl.engine.llm_engine import Engine, SamplingParams  # noqa: E402


def prompts_of(lengths: list[int], vocab: int, device: torch.device) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def greedy_reference(model, prompt: list[int], new: int, device: torch.device) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default=None, choices=list(SHAPES))
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--triton", default="auto", choices=["auto", "true", "false"],
                        help="the engine's Triton kernels (model.engine.triton)")
    args = parser.parse_args()
    device = torch.device(args.device)
    preset = args.preset or ("0.5b" if device.type == "cuda" else "small")
    vocab = SHAPES[preset]["vocab_size"]
    prompts = prompts_of([37, 64, 100, 200, 5, 150, 80, 20], vocab, device)
    config = EngineConfig(kv_cache_gb=8.0, max_rows=16, max_seq_len=512, triton=args.triton)

    model = build(preset, device, torch.float32)
    engine = Engine(model, config)
    results = engine.generate(prompts, [SamplingParams(temperature=0, max_new_tokens=args.new)] * len(prompts))
    exact = sum(r.token_ids == greedy_reference(model, p, args.new, device) for p, r in zip(prompts, results))
    print(f"float32 greedy, {preset}: {exact}/{len(prompts)} sequences of {args.new} tokens equal generate's "
          f"(graphs {'on' if engine.use_graphs else 'off'}, triton {args.triton}: "
          f"{engine.triton})")

    model = build(preset, device, torch.bfloat16)
    engine = Engine(model, config)
    results = engine.generate(prompts, [SamplingParams(temperature=0, max_new_tokens=args.new)] * len(prompts))
    agree = []
    for prompt, result in zip(prompts, results):
        reference = greedy_reference(model, prompt, args.new, device)
        agree.append(next((i for i, (a, b) in enumerate(zip(result.token_ids, reference)) if a != b), args.new))
    print(f"bf16 greedy: tokens equal to generate's before the first difference, per sequence: {agree}")
    torch.manual_seed(0)
    results = engine.generate(prompts, [SamplingParams(temperature=1.0, max_new_tokens=args.new)] * len(prompts))
    differences = []
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + result.token_ids], device=device)).logits[0].float()
        logits = logits[len(prompt) - 1 : len(prompt) + len(result.token_ids) - 1]
        reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.token_ids, device=device)[:, None])
        differences.append((torch.tensor(result.logprobs, device=device) - reference[:, 0]).abs())
    every = torch.cat(differences)
    print(f"bf16 sampling logprobs against a full forward pass: mean |diff| {every.mean():.4f}, "
          f"p99 {every.quantile(0.99):.4f}, max {every.max():.4f} over {every.numel()} tokens")


if __name__ == "__main__":
    main()
