"""SFT steps in micro-batches against one pass over each batch: the same loss and the same gradient norm at every
step, with token targets and with soft targets.

The gradient norm is read before clipping, so a micro-batch's loss weighted by any other share of the batch (its
own tokens, the number of micro-batches) shows in it at once; the weights after AdamW, which rescales each
gradient by its own size, would hide a weight common to every micro-batch.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.training.test_sft import CHAT, soft_demo_samples
from turnrl.training.sft import SoftTargets, conversation_samples, demo_target_positions, sft_train
from turnrl.training.train_config import SFTConfig


def logged_steps(model_dir, pad_id: int, samples, micro: int, soft: SoftTargets | None = None
                 ) -> list[dict[str, float]]:
    """Each step's logged metrics of one epoch in batches of 4 (the last batch shorter)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logged: list[dict[str, float]] = []
    config = SFTConfig(epochs=1, lr=1e-3, warmup_steps=0, batch_size=4, micro_batch_size=micro)
    sft_train(model, pad_id, samples, config, soft_targets=soft, log=lambda step, metrics: logged.append(metrics))
    return logged


def assert_same_steps(got: list[dict[str, float]], expected: list[dict[str, float]]) -> None:
    assert len(got) == len(expected) > 1
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-5), step
        assert a["sft/grad_norm"] == pytest.approx(b["sft/grad_norm"], rel=1e-4), step
    assert expected[0]["sft/grad_norm"] > 1.0  # clipped at 1: the norm before the clip is what is compared


@pytest.mark.parametrize("micro", [1, 3])
def test_sft_micro_batches_log_the_losses_and_gradient_norms_of_whole_batches(tiny_model_dir, tiny_tokenizer,
                                                                               micro):
    """Six samples of 44 to 101 tokens, 8 to 24 of them trained: batches of 4 and 2 rows, in micro-batches of one
    row or of 3 rows and the rest."""
    samples = conversation_samples(CHAT, tiny_tokenizer, window=1)
    samples += conversation_samples(CHAT[:5], tiny_tokenizer, window=None)
    samples += conversation_samples(CHAT[:3], tiny_tokenizer, window=None)
    samples += conversation_samples(CHAT, tiny_tokenizer, window=None)
    assert len(samples) == 6 and len({sum(s.loss_mask) for s in samples}) > 2
    pad = tiny_tokenizer.pad_token_id
    assert_same_steps(logged_steps(tiny_model_dir, pad, samples, micro), logged_steps(tiny_model_dir, pad, samples, 4))


def test_sft_micro_batches_with_soft_targets_log_the_losses_and_gradient_norms_of_whole_batches(
        tiny_model_dir, tiny_tokenizer):
    demos, samples, actions = soft_demo_samples(tiny_tokenizer, 1, episodes=2)
    soft = SoftTargets(actions, 0.8, demo_target_positions(demos, samples, actions))
    assert len(samples) > 4 and any(soft.positions)
    pad = tiny_tokenizer.pad_token_id
    assert_same_steps(logged_steps(tiny_model_dir, pad, samples, 3, soft),
                      logged_steps(tiny_model_dir, pad, samples, 4, soft))
