"""The update's forward and backward at a real size on one GPU: padded against packed micro-batches, sdpa
against flex attention, and the scoring head against whole logits; tokens/s, MFU and peak memory.

A batch of ragged rows (lengths drawn between ``--min-len`` and ``--max-len``, the second half of each row
scored, as the responses of a multi-turn episode are) goes through ``token_logprobs``, the way the PPO
epochs run it (with gradient checkpointing unless ``--no-checkpointing``), in micro-batches of ``--rows``
rows (padded) or of ``--tokens`` tokens (packed: each sequence attends to itself only, SDPA sequence by
sequence). The weights are bf16, as FSDP's mixed precision gathers them. MFU counts 6 x parameters per real
(unpadded) token plus each sequence's causal attention (the trainer's ``throughput/update_mfu``) over the
device's bf16 peak; the ratio of each variant to the padded one is measured in the same run. ``--compile``
adds the packed passes with each layer's norms and MLP compiled (``model.compile``), after the eager ones.
``--next-fit`` adds the packed passes as they were cut before best fit (a pass closed when the next row, longest
first, overflows it), and each packed variant prints its number of passes and how full they ran; rows long
against the budget show the difference (``--batch 64 --min-len 300 --max-len 4200 --tokens 8704``).

    python benchmarks/update_speed.py --preset 3b
    python benchmarks/update_speed.py --preset tiny --device cpu --rows 4 --tokens 512 --batch 8   # a smoke run
    python benchmarks/update_speed.py --preset 3b --next-fit --no-padded --batch 64 --min-len 300 --max-len 4200 \
        --tokens 8704
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen2ForCausalLM  # noqa: E402

from turnrl.models.loading import compile_layer_parts, enable_checkpointing  # noqa: E402
from turnrl.models.tiny import model_preset, tiny_qwen2_config  # noqa: E402
from turnrl.training.packed_attention import implementation  # noqa: E402
from turnrl.training.model_passes import token_logprobs  # noqa: E402
from turnrl.training.head import chosen_logprobs, install_scoring_head  # noqa: E402
from turnrl.training.ppo import MicroBatching  # noqa: E402
from turnrl.models.throughput import peak_flops, training_flops, training_flops_per_token  # noqa: E402


def build(preset: str, device: torch.device, attention: str, vocab_limit: int, checkpointing: bool
          ) -> torch.nn.Module:
    p = model_preset(preset)
    rows = p.embedding_rows or vocab_limit
    config = tiny_qwen2_config(rows, hidden_size=p.hidden_size, num_layers=p.num_layers, num_heads=p.num_heads,
                               num_kv_heads=p.num_kv_heads, intermediate_size=p.intermediate_size,
                               max_position_embeddings=p.max_position_embeddings,
                               tie_word_embeddings=p.tie_word_embeddings, rope_theta=p.rope_theta)
    config._attn_implementation = implementation(attention)
    with device:
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    install_scoring_head(model, vocab_limit)
    if checkpointing:
        enable_checkpointing(model)
    return model.train()


def batch(n: int, low: int, high: int, vocab: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(0, vocab, (n, width), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    scored = ((torch.arange(width)[None, :] >= lengths[:, None] // 2) & mask.bool()).float()
    return ids.to(device), mask.to(device), scored.to(device), lengths


class NextFit(MicroBatching):
    """The packed passes before best fit, the baseline of ``--next-fit``: rows longest first, a pass closed when
    the next row would overflow it."""

    def split(self, index: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        passes: list[list[int]] = []
        used = 0
        for row in index[torch.argsort(lengths[index], descending=True, stable=True)].tolist():
            if not passes or used + int(lengths[row]) > self.tokens:
                passes.append([])
                used = 0
            passes[-1].append(row)
            used += int(lengths[row])
        return [torch.tensor(part, dtype=torch.long) for part in passes]


def one_pass(model, ids, mask, scored, lengths, batching: MicroBatching) -> None:
    for rows in batching.split(torch.arange(len(ids)), lengths):
        part = rows.to(ids.device)
        lp, entropy = token_logprobs(model, ids[part], mask[part], scored[part], with_entropy=True,
                                     packed=batching.packed)
        (lp.sum() * 1e-4 + entropy.sum() * 1e-6).backward()


def measure(model, data, batching: MicroBatching, repeats: int, device: torch.device) -> tuple[float, float]:
    """Seconds of one pass over the batch (median of ``repeats`` after a warm-up) and peak memory in GiB."""
    one_pass(model, *data, batching)  # warm-up: compilation, allocator
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass(model, *data, batching)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(times), peak


def head_memory(hidden: int, rows: int, limit: int, n: int, device: torch.device) -> list[tuple[str, float, float]]:
    """The LM head alone over ``n`` scored states: the scoring head against whole logits + log_softmax."""
    states = torch.randn(n, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, limit, (n,), device=device)

    def scoring():
        lp, ent = chosen_logprobs(states, weight, targets, vocab_limit=limit)
        (lp.sum() + ent.sum()).backward()

    def whole():  # what a trainer without the scoring head does: every row's logits kept for the backward pass
        logits = (states @ weight.T).float()
        logits[:, limit:] = float("-inf")
        log_p = torch.log_softmax(logits, -1)
        p = log_p.exp()
        entropy = -(p * log_p.masked_fill(p == 0, 0.0)).sum()
        (log_p.gather(-1, targets[:, None]).sum() + entropy).backward()

    out = []
    for name, fn in (("scoring head", scoring), ("whole logits", whole)):
        try:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            out.append((name, seconds, peak))
        except torch.OutOfMemoryError:
            out.append((name, float("nan"), float("inf")))
        states.grad = weight.grad = None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=32, help="rows (episodes) in the batch")
    parser.add_argument("--min-len", type=int, default=600)
    parser.add_argument("--max-len", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=8, help="rows of a padded micro-batch")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of a packed micro-batch")
    parser.add_argument("--vocab-limit", type=int, default=8192, help="the tokenizer's size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--attention", nargs="+", default=["sdpa"])
    parser.add_argument("--compile", action="store_true", help="also the packed passes with compiled layer parts")
    parser.add_argument("--next-fit", action="store_true", help="also the packed passes cut by next fit")
    parser.add_argument("--no-padded", dest="padded", action="store_false",
                        help="skip the padded passes (the speed-up column is then against the first packed row)")
    args = parser.parse_args()
    device = torch.device(args.device)
    peak = peak_flops(device)
    data = batch(args.batch, args.min_len, args.max_len, args.vocab_limit, device)
    tokens = int(data[3].sum())
    rows = []
    for attention in args.attention:
        model = build(args.preset, device, attention, args.vocab_limit, args.checkpointing)
        flops = training_flops(training_flops_per_token(model, None if model.config.tie_word_embeddings
                                                        else model.get_input_embeddings().weight),
                               model.config, data[3])
        variants = [("padded", MicroBatching(args.rows))] if args.padded else []
        if args.next_fit:
            variants.append(("packed, next fit", NextFit(args.rows, args.tokens)))
        variants.append(("packed", MicroBatching(args.rows, args.tokens)))
        if args.compile:
            variants.append(("packed, compiled", MicroBatching(args.rows, args.tokens)))
        for name, batching in variants:
            if name.endswith("compiled"):
                compile_layer_parts(model)  # in place: the eager variants ran before
            seconds, memory = measure(model, data, batching, args.repeats, device)
            utilization = flops / seconds / peak if peak else float("nan")
            rows.append((f"{name}, {attention}", seconds, tokens / seconds, utilization, memory))
            passes = len(batching.split(torch.arange(args.batch), data[3]))
            filled = f", {passes} passes {tokens / (passes * args.tokens):.0%} full" if batching.packed else ""
            print(f"{rows[-1][0]}: {seconds:.3f} s, {tokens / seconds:,.0f} tokens/s, MFU {utilization:.1%}, "
                  f"peak {memory:.1f} GiB{filled}", flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = rows[0][1]
    print(f"\n{args.preset}: {args.batch} rows of {args.min_len}-{args.max_len} tokens ({tokens:,} real, "
          f"{args.batch * int(data[3].max()):,} padded), forward + backward, "
          f"{'with' if args.checkpointing else 'without'} checkpointing, bf16")
    print("| variant | seconds | tokens/s | MFU | peak GiB | speed-up |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, seconds, rate, utilization, memory in rows:
        print(f"| {name} | {seconds:.3f} | {rate:,.0f} | {utilization:.1%} | {memory:.1f} | {base / seconds:.2f}x |")
    p = model_preset(args.preset)
    head_rows = p.embedding_rows or args.vocab_limit
    print(f"\nLM head alone, {args.tokens} scored tokens, {head_rows} rows, hidden {p.hidden_size}, "
          "forward + backward:")
    print("| head | seconds | peak GiB |\n| --- | ---: | ---: |")
    for name, seconds, memory in head_memory(p.hidden_size, head_rows, args.vocab_limit, args.tokens, device):
        print(f"| {name} | {seconds:.3f} | {memory:.1f} |")


if __name__ == "__main__":
    main()
