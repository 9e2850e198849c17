"""Gathering a rollout's trajectories across processes: ``ranks.all_gather_objects`` (the pickles through a
buffer of 64 MiB a process) against torch's ``all_gather_object`` (every process's whole pickle on the device
at once), measured in the same run: seconds per gather and the device memory each took above what was
allocated before it.

Each process gathers ``--mib`` MiB of arrays (a stand-in for its trajectories' images and pixel values:
bytes are bytes to pickle). On GPUs (NCCL) the memory is the allocator's peak; on CPUs (gloo) there is no
device memory to count, and the seconds compare the two transfers.

    torchrun --standalone --nproc-per-node 4 benchmarks/gather.py --mib 2500     # GPUs: NCCL
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gather.py --mib 400   # CPU
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from turnrl.training import ranks


def timed(gather, device: torch.device, repeats: int) -> tuple[float, float]:
    """Mean seconds of ``repeats`` calls after one warm-up, and the device memory (GiB) the calls took at most."""
    gather()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        gather()
    dist.barrier()
    seconds = (time.perf_counter() - start) / repeats
    peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30 if device.type == "cuda" else float("nan")
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=400, help="MiB of arrays each process gathers")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    device = ranks.init_process_group("cuda" if use_cuda else "cpu", timeout_s=1800)
    rank, world = dist.get_rank(), dist.get_world_size()
    frame = 512 * 512 * 3
    value = [np.random.default_rng(rank).integers(0, 255, frame, dtype=np.uint8)
             for _ in range(int(args.mib * 2**20 // frame))]

    def whole() -> list:
        out: list = [None] * world
        dist.all_gather_object(out, value)
        return out

    rows = [("torch all_gather_object", *timed(whole, device, args.repeats)),
            ("ranks.all_gather_objects", *timed(lambda: ranks.all_gather_objects(value), device, args.repeats))]
    if rank == 0:
        print(f"{world} processes on {'GPUs (NCCL)' if use_cuda else 'CPUs (gloo)'}, {args.mib:.0f} MiB a process, "
              f"{os.cpu_count()} cores")
        print("| gather | s | device GiB | time vs torch |\n| --- | ---: | ---: | ---: |")
        for name, seconds, peak in rows:
            print(f"| {name} | {seconds:.2f} | {peak:.2f} | {seconds / rows[0][1]:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
