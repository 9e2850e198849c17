"""The step's episodes: the rollout's roofline shares read off its counters."""

from __future__ import annotations

import pytest

from turnrl.training.step_episodes import rollout_roofline


def test_the_rollouts_roofline_is_its_work_over_its_device_seconds_at_the_peaks():
    metrics = {"generation/prefill_flops": 3e14, "timing/prefill_device_s": 0.5,
               "generation/decode_bytes": 6e12, "timing/decode_device_s": 2.5}
    shares = rollout_roofline(metrics, flops_peak=1e15, bandwidth=4e12)
    assert shares == pytest.approx({"throughput/prefill_roofline": 3e14 / (0.5 * 1e15),
                                    "throughput/decode_roofline": 6e12 / (2.5 * 4e12)})


@pytest.mark.parametrize(("metrics", "flops_peak", "bandwidth"), [
    ({}, 1e15, 4e12),  # a policy that counts no device work (transformers' generate, a server)
    ({"generation/prefill_flops": 3e14, "timing/prefill_device_s": 0.5,
      "generation/decode_bytes": 6e12, "timing/decode_device_s": 2.5}, None, None),  # a CPU: no peaks
])
def test_no_share_is_made_up_without_device_time_or_a_peak(metrics, flops_peak, bandwidth):
    assert rollout_roofline(metrics, flops_peak, bandwidth) == {}
