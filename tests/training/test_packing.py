"""Packed rows against padded rows: the same log-probs, entropies, values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from turnrl.models.loading import enable_checkpointing
from turnrl.training.model_passes import ValueModel, token_logprobs
from turnrl.training.packed_attention import ATTENTION
from turnrl.training.packing import pack


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=ATTENTION)


def padded_batch(vocab: int, lengths=(12, 5, 9, 1), seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.randint(0, vocab, (len(lengths), width), generator=gen)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention_mask[row, :n] = 1
    score_mask = (torch.rand(len(lengths), width, generator=gen) < 0.6).float() * attention_mask
    return input_ids, attention_mask, score_mask


def test_pack_lays_rows_end_to_end_with_restarting_positions():
    input_ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 0, 0]])
    attention_mask = (torch.arange(4)[None, :] < torch.tensor([3, 1, 2])[:, None]).long()
    packed = pack(input_ids, attention_mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 1, 2]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.rows.tolist() == [0, 0, 0, 1, 2, 2] and packed.cols.tolist() == [0, 1, 2, 0, 0, 1]


def vlm_rows(config, pad_id: int = 0):
    """Three rows of the tiny VLM: text, an image of 1x2 tokens, text; text only; text, then an image of 2x2
    tokens that ends the row. Returns the padded ids, the attention mask and the grids of the images in row order."""
    merge, image = config.vision_config.spatial_merge_size, config.image_token_id
    rows = [[10, 11, image, image, 12, 13], [14, 15, 16], [17, image, image, image, image]]
    input_ids = torch.tensor([row + [pad_id] * (6 - len(row)) for row in rows])
    attention_mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 5])[:, None]).long()
    grids = torch.tensor([[1, merge, 2 * merge], [1, 2 * merge, 2 * merge]])
    return input_ids, attention_mask, grids


def test_pack_gives_a_vlm_row_its_text_positions_then_its_own_mrope_positions(tiny_vlm_dir):
    """Each row's M-RoPE positions start at 0 as in generation, its images placed row-major after its text; the
    plain text positions lead, as Qwen-VL models read packed sequences."""
    config = AutoConfig.from_pretrained(tiny_vlm_dir)
    input_ids, attention_mask, grids = vlm_rows(config)
    packed = pack(input_ids, attention_mask, config, {"image_grid_thw": grids})
    text = [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]
    temporal = [0, 1, 2, 2, 4, 5, 0, 1, 2, 0, 1, 1, 1, 1]
    height = [0, 1, 2, 2, 4, 5, 0, 1, 2, 0, 1, 1, 2, 2]
    width = [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 1, 2]
    assert packed.position_ids.tolist() == [[text], [temporal], [height], [width]]


def test_pack_reads_nothing_of_the_padding(tiny_vlm_dir):
    """Padding ids that happen to be image placeholders change nothing: only each row's real tokens count."""
    config = AutoConfig.from_pretrained(tiny_vlm_dir)
    plain = pack(*vlm_rows(config)[:2], config, {"image_grid_thw": vlm_rows(config)[2]})
    input_ids, attention_mask, grids = vlm_rows(config, pad_id=config.image_token_id)
    placeholders = pack(input_ids, attention_mask, config, {"image_grid_thw": grids})
    assert torch.equal(placeholders.input_ids, plain.input_ids)
    assert torch.equal(placeholders.position_ids, plain.position_ids)


def test_packing_no_rows_gives_no_tokens_and_empty_positions_of_each_kind(tiny_vlm_dir):
    config = AutoConfig.from_pretrained(tiny_vlm_dir)
    packed = pack(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long), config, {})
    assert packed.input_ids.shape == (1, 0) and packed.position_ids.shape == (4, 1, 0)


def test_a_model_without_the_trainers_attention_refuses_packed_rows(tiny_model_dir):
    """Plain sdpa would let packed rows attend to each other: refused, with the setting to use."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="model.attention=sdpa"):
        token_logprobs(plain, *padded_batch(plain.config.vocab_size), packed=True)


def test_unpacked_rows_attend_as_plain_sdpa(model, tiny_model_dir):
    """Without sequence bounds the trainer's attention is transformers' sdpa, mask and all."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    inputs = padded_batch(model.config.vocab_size, seed=5)
    with torch.no_grad():
        assert torch.equal(token_logprobs(model, *inputs)[0], token_logprobs(plain, *inputs)[0])


def test_pack_refuses_left_padding():
    with pytest.raises(ValueError, match="right-padded"):
        pack(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_entropy_and_gradients_equal_padded(model, temperature):
    inputs = padded_batch(model.config.vocab_size)
    results = []
    for packed in (False, True):
        model.zero_grad()
        logprobs, entropy = token_logprobs(model, *inputs, temperature=temperature, with_entropy=True, packed=packed)
        (logprobs.sum() + 0.3 * entropy.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((logprobs.detach(), entropy.detach(), grads))
    (lp, ent, grads), (packed_lp, packed_ent, packed_grads) = results
    torch.testing.assert_close(packed_lp, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_ent, ent, atol=1e-5, rtol=1e-5)
    for name in grads:
        torch.testing.assert_close(packed_grads[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_rows_do_not_see_each_other(model):
    """Changing one row's tokens changes no other row's log-probs: each attends only to itself."""
    input_ids, attention_mask, score_mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        before, _ = token_logprobs(model, input_ids, attention_mask, score_mask, packed=True)
        changed = input_ids.clone()
        changed[0, :12] = (changed[0, :12] + 1) % model.config.vocab_size
        after, _ = token_logprobs(model, changed, attention_mask, score_mask, packed=True)
    torch.testing.assert_close(after[1:], before[1:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(after[0], before[0])


def test_packed_values_equal_padded(model):
    critic = ValueModel(model.base_model)
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)
    input_ids, attention_mask, _ = padded_batch(model.config.vocab_size, seed=3)
    values = critic(input_ids, attention_mask)
    packed = critic(input_ids, attention_mask, packed=True)
    torch.testing.assert_close(packed, values, atol=1e-5, rtol=1e-5)
    values.sum().backward()
    padded_grad = critic.value_head.weight.grad.clone()
    critic.zero_grad()
    packed.sum().backward()
    torch.testing.assert_close(critic.value_head.weight.grad, padded_grad, atol=1e-5, rtol=1e-4)


def test_packed_rows_with_gradient_checkpointing_give_the_same_gradients(tiny_model_dir):
    """The layers recomputed in the backward pass (after the packed forward has returned) attend per sequence
    as the forward did: every layer recomputed, or the first only (``model.checkpointed_layers=1``)."""
    grads = []
    for checkpointing in (False, True, 1):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                     attn_implementation=ATTENTION).train()
        if checkpointing is not False:
            enable_checkpointing(model, None if checkpointing is True else checkpointing)
        logprobs, _ = token_logprobs(model, *padded_batch(model.config.vocab_size, seed=7), packed=True)
        logprobs.sum().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name in grads[0]:
        for checkpointed in grads[1:]:
            torch.testing.assert_close(checkpointed[name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
