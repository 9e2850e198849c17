"""benchmarks/vlm_rollout.py --profile: the roofline of a real rollout's device work on the tiny VLM (CPU)."""

from __future__ import annotations

import argparse

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
    assert len(split.image_grids) == len(split.responses) >= 4
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
