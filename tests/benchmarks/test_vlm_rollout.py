"""benchmarks/vlm_rollout.py --profile: the roofline of a real rollout's device work on the tiny VLM (CPU), and
which phase each kernel of a trace is counted in."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler_util import Interval, Kernel

from benchmarks import vlm_rollout
from turnrl.config import EngineConfig, ModelConfig
from turnrl.models.loading import load_processor
from turnrl.policy.engine import EnginePolicy
from turnrl.policy.hf import HFPolicy


def test_a_profiled_rollouts_roofline_counts_each_new_image_once_and_reads_n_a_without_peaks(tiny_vlm_dir):
    """Whole histories, a new picture a turn: the vision tower encodes each turn's picture once (the earlier ones
    are in the rows); shares are n/a on a CPU, and the work over the time at a configured peak."""
    hf = HFPolicy.from_config(ModelConfig(device="cpu", dtype="float32"), str(tiny_vlm_dir))
    engine = EnginePolicy(hf.model, hf.tokenizer, EngineConfig(max_rows=2, max_seq_len=2048, kv_cache_gb=0.25),
                          processor=load_processor(str(tiny_vlm_dir)))
    args = argparse.Namespace(env="Maze2D", episodes=2, turns=3, new=8, context=1984)
    split = vlm_rollout.profiled_rollout(engine, args, None)
    assert split.work["evictions"] == 0
    assert split.work["images_encoded"] == len(split.responses) >= 4
    work = vlm_rollout.device_work(split, engine)
    steps = int(split.work["decode_steps"])
    assert work.decoder_flops > 0 and work.vision_flops > 0 and work.cache_bytes(steps) > 0
    assert work.weight_bytes == engine.engine.weights.decode_bytes()
    prefill, decode = vlm_rollout.roofline_lines(split, work, None, None)
    assert "n/a of the bf16 peak" in prefill and "n/a of the bandwidth floor (n/a" in decode
    flops = work.decoder_flops + work.vision_flops
    prefill, decode = vlm_rollout.roofline_lines(split, work, 4 * flops / split.prefill_s,
                                                 2 * work.decode_bytes / split.decode_s)
    assert "25% of the bf16 peak" in prefill and "50% of the bandwidth floor" in decode
    assert f"({1000 * split.decode_s / 2 / steps:.2f} ms:" in decode


@dataclass
class Event:
    """What :func:`vlm_rollout.phase_kernels` reads of a profiler event."""

    name: str
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CPU
    microseconds: int = 0
    kernels: list[Kernel] = field(default_factory=list)
    cpu_children: list["Event"] = field(default_factory=list)

    @property
    def time_range(self) -> Interval:
        return Interval(0, self.microseconds)


def on_gpu(name: str, microseconds: int) -> Event:
    return Event(name, torch.autograd.DeviceType.CUDA, microseconds)


def test_prefill_counts_the_kernels_its_operators_launched_and_decode_the_rest_of_the_trace():
    """A graph replay's kernels are linked to no operator, so decode's are the trace's kernels less prefill's; the
    phases' ranges, which show on the GPU's timeline too, are no kernels."""
    matmul = Event("aten::mm", kernels=[Kernel("gemm", 0, 30)])
    norm = Event("aten::mul", kernels=[Kernel("norm", 0, 10)])
    prefill = Event("engine.prefill", cpu_children=[Event("aten::linear", cpu_children=[matmul]), norm])
    events = [prefill, matmul, norm, Event("engine.decode"),
              on_gpu("gemm", 30), on_gpu("norm", 10), on_gpu("engine.prefill", 60),  # prefill's, on the GPU
              on_gpu("attention", 50), on_gpu("gemm", 20), on_gpu("engine.decode", 90)]  # a decode step's graph
    phases = vlm_rollout.phase_kernels(events)
    assert phases == {"prefill": {"gemm": 30, "norm": 10}, "decode": {"attention": 50, "gemm": 20}}
    lines = vlm_rollout.kernel_lines(phases, {"prefill": 80e-6, "decode": 100e-6}, top=1)
    assert lines[0] == "prefill: kernels 0.00 s of its 0.00 s on the device (50% busy)"
    assert lines[1].split() == ["0.000", "s", "37.5%", "gemm"]
    assert lines[2].startswith("decode:") and "(70% busy)" in lines[2] and lines[3].split()[-1] == "attention"
