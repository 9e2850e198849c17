"""Decode attention alone: the Triton kernel's settings beside torch's batched matmuls, in one run.

One layer of the 0.5B shape (14 query and 2 key/value heads of 64 dims; ``--heads``, ``--kv-heads`` and
``--head-dim`` set another: 16, 2 and 128 for the 3B) at a decode step of ``--batch`` rows:
rows all ``--context`` long, or of lengths spread evenly from a quarter of it to all of it (``varied``: episodes
that drifted apart). torch's attention reads every row up to the longest (its key length rounded up to 64); the
kernel reads each row to its own length. Each setting (key stretches per row, key block, warps, stages) is
timed as the engine runs it, in a CUDA graph (``--iters`` calls captured and replayed, timed with CUDA events);
the ratio is against torch in the same run (the last rows: the engine's decode kernel as a step runs it, with its
own settings, rotating the new token's query and key and writing its key and value before it attends, its key
stretches combined in the kernel, then by a second kernel), and beside it the share of the GPU's memory
bandwidth the kernel reached reading its rows' keys and values (``--peak-tbps`` for a GPU not in turnrl's table).
With ``--combine-in-kernel`` each split setting is timed both ways. The kernel reads the engine's paged cache,
each row's pages in a shuffled order (as a long run leaves them); torch reads the same keys and values as
contiguous rows. With
``--layers 24`` each call reads the next of 24 caches, as a decode step's layers do: a single cache stays partly
in the GPU's L2 between calls, which flatters every row.

    python benchmarks/attention.py --batch 64 256 --context 640
    python benchmarks/attention.py --batch 256 --lengths equal --layers 24 --splits 1 2 --warps 2 4 8 --stages 2 3 4
    python benchmarks/attention.py --heads 16 --kv-heads 2 --head-dim 128 --batch 64 --context 2048 \
        --lengths equal --layers 36 --splits 2 3 4 8 16                   # the VisGym rollout's 3B decode
    python benchmarks/attention.py --heads 16 --kv-heads 2 --head-dim 128 --batch 64 --context 2048 \
        --lengths equal varied --layers 36 --splits 3 --blocks 64 --warps 4 --stages 2 --combine-in-kernel
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from turnrl.engine.attention import cached_attention, decode_splits, rotate_write_attend  # noqa: E402
from turnrl.engine.cache import PAGE_TOKENS, pages_for  # noqa: E402
from turnrl.engine.forward import decode_attention, round_up  # noqa: E402
from turnrl.models.throughput import peak_bandwidth  # noqa: E402


def timed_ms(fn, iters: int) -> float:
    """Device time of one call: ``iters`` calls captured in a CUDA graph and replayed (the engine replays its
    decode step so; timing launches from Python would time the launches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compilation, autotuning, allocator
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def paged(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows Shape (2, b, Hkv, C + 1, D) as the engine's pages in a shuffled order, and their table."""
    two, rows, heads, columns, dim = kv.shape
    per_row = pages_for(columns - 1)
    padded = torch.zeros(two, rows, heads, per_row * PAGE_TOKENS, dim, device=kv.device, dtype=kv.dtype)
    padded[:, :, :, : columns - 1] = kv[:, :, :, : columns - 1]
    by_page = padded.view(two, rows, heads, per_row, PAGE_TOKENS, dim).permute(0, 1, 3, 2, 4, 5)
    order = torch.randperm(rows * per_row, device=kv.device) + 1  # page 0: scratch
    pages = torch.zeros(two, rows * per_row + 1, heads, PAGE_TOKENS, dim, device=kv.device, dtype=kv.dtype)
    pages[:, order] = by_page.reshape(two, rows * per_row, heads, PAGE_TOKENS, dim)
    table = torch.cat((order.view(rows, per_row), torch.zeros(rows, 1, dtype=order.dtype, device=kv.device)), 1)
    return pages, table.int()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=640)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--layers", type=int, default=1, help="caches read in turn (24: L2 cold, as in a step)")
    parser.add_argument("--lengths", nargs="+", default=["equal", "varied"], choices=["equal", "varied"])
    parser.add_argument("--splits", type=int, nargs="+", default=None, help="default: 1, 2, 4 and the engine's")
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--heads", type=int, default=14, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--combine-in-kernel", action="store_true",
                        help="each split setting also with its stretches combined in the attention kernel")
    parser.add_argument("--peak-tbps", type=float, default=0.0, help="the GPU's memory bandwidth (0: turnrl's table)")
    args = parser.parse_args()
    device = torch.device("cuda")
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    bandwidth = peak_bandwidth(device, 1e12 * args.peak_tbps)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; one layer, bf16, {heads} query and "
          f"{kv_heads} key/value heads of {head_dim}; microseconds per call")
    print(f"{'batch':>5} {'lengths':<8} {'row':<34} {'us':>8} {'x torch':>8} {'bandwidth':>9}")
    for batch, lengths in itertools.product(args.batch, args.lengths):
        capacity = round_up(args.context + 1)
        caches = [torch.randn(2, batch, kv_heads, capacity + 1, head_dim, device=device, dtype=torch.bfloat16)
                  for _ in range(args.layers)]
        paged_caches = [paged(kv) for kv in caches]
        scratch = pages_for(capacity) * PAGE_TOKENS
        q = torch.randn(batch, 1, heads, head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
        if lengths == "equal":
            last = torch.full((batch,), args.context - 1, device=device)
        else:
            last = torch.linspace(args.context // 4, args.context - 1, batch, device=device).long()
        positions = last[:, None]
        read = int((last + 1).sum()) * 2 * kv_heads * head_dim * 2  # each row's keys and values, bf16
        key_len = round_up(int(last.max()) + 1)
        baseline = timed_ms(lambda: [decode_attention(q, kv[0, :, :, :key_len], kv[1, :, :, :key_len], last)
                                     for kv in caches], args.iters) / args.layers
        print(f"{batch:>5} {lengths:<8} {'torch (batched matmuls)':<34} {1000 * baseline:>8.1f} {1.0:>7.2f}x")
        auto = decode_splits(batch, kv_heads, device)
        splits = sorted(set(args.splits or [1, 2, 4, auto]))
        # A split setting's row combines its key stretches in a second kernel; its "1 kernel" row in the attention
        # kernel itself, the last stretch of each row and key/value head combining them (counters given, as the
        # engine gives its cache's).
        arrivals = torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)
        ways = [("", None)] + ([(" 1 kernel", arrivals)] if args.combine_in_kernel else [])
        for split, block_n, warps, stages in itertools.product(splits, args.blocks, args.warps, args.stages):
            for way, counters in ways if split > 1 else ways[:1]:
                try:
                    ms = timed_ms(lambda: [cached_attention(q, pages, table, None, positions, scratch, split=split,
                                                            block_n=block_n, num_warps=warps, num_stages=stages,
                                                            arrivals=counters)
                                           for pages, table in paged_caches], args.iters) / args.layers
                except Exception as error:  # a setting the GPU cannot run (shared memory): printed, not fatal
                    print(f"{batch:>5} {lengths:<8} split {split} block {block_n} w{warps} s{stages}{way}: "
                          f"{type(error).__name__}")
                    continue
                label = (f"triton split {split}{' (auto)' if split == auto else ''} block {block_n} w{warps} "
                         f"s{stages}{way}")
                share = f"{read / (ms / 1000) / bandwidth:.0%}" if bandwidth else "n/a"
                print(f"{batch:>5} {lengths:<8} {label:<34} {1000 * ms:>8.1f} {baseline / ms:>7.2f}x {share:>9}",
                      flush=True)
        # The engine's decode: the q/k/v projection in, rotated, the new key and value written at each row's last
        # position (rewritten every call), then attended with the rest; its stretches combined as the engine
        # combines them (in the kernel), and by a second kernel.
        projected = torch.randn(batch, 1, (heads + 2 * kv_heads) * head_dim, device=device, dtype=torch.bfloat16)
        angles = torch.rand(capacity, head_dim, device=device)
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        for label, counters in (("engine decode (rotate, write, attend)", arrivals),
                                ("the same, a second combining kernel", None)):
            ms = timed_ms(lambda: [rotate_write_attend(projected, cos, sin, positions, pages, table, None, positions,
                                                       scratch, heads, arrivals=counters)
                                   for pages, table in paged_caches], args.iters) / args.layers
            share = f"{read / (ms / 1000) / bandwidth:.0%}" if bandwidth else "n/a"
            print(f"{batch:>5} {lengths:<8} {label:<34} {1000 * ms:>8.1f} {baseline / ms:>7.2f}x {share:>9}",
                  flush=True)


if __name__ == "__main__":
    main()
