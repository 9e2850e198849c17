"""Forward passes of training: token log-probs and entropy against full logits, and the critic's alignment."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.training.head import install_scoring_head
from turnrl.training.model_passes import ValueModel, token_and_candidate_logprobs, token_logprobs
from turnrl.training.precision import autocast


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def inputs(model):
    """Two right-padded rows of different lengths and a score mask with gaps (and position 0 set)."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    input_ids = torch.randint(0, vocab, (2, 12), generator=gen)
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, 9:] = 0
    score_mask = torch.zeros(2, 12)
    score_mask[0, [0, 3, 4, 5, 9, 10, 11]] = 1
    score_mask[1, [2, 3, 6, 7, 8]] = 1
    return input_ids, attention_mask, score_mask


def naive(model, input_ids, attention_mask, score_mask, temperature):
    """Full logits, log_softmax, gather: ``logprobs[i] = log p(x_i | x_<i)``; position 0 never scored."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    picked = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    mask = score_mask.bool().clone()
    mask[:, 0] = False
    pad = torch.zeros(input_ids.shape[0], 1)
    return (torch.cat([pad, picked], 1) * mask), (torch.cat([pad, entropy], 1) * mask)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
@torch.no_grad()
def test_token_logprobs_and_entropy_equal_a_full_logits_computation(model, inputs, temperature):
    logprobs, entropy = token_logprobs(model, *inputs, temperature=temperature, with_entropy=True)
    expected_lp, expected_h = naive(model, *inputs, temperature)
    assert torch.allclose(logprobs, expected_lp, atol=1e-5)
    assert torch.allclose(entropy, expected_h, atol=1e-5)
    scored = inputs[2].bool().clone()
    scored[:, 0] = False
    assert bool((logprobs[scored] < 0).all()) and bool((logprobs[~scored] == 0).all())
    assert bool((entropy[~scored] == 0).all())


def test_entropy_of_a_head_with_masked_vocabulary_is_finite_and_trains(model, inputs):
    # Rows past the scoring head's vocabulary limit get -inf logits: entropy and its gradient stay finite and
    # equal those of the allowed rows' softmax (0 log 0 is 0), where a plain -sum(p log p) is NaN.
    trained = copy.deepcopy(model)
    vocab = trained.config.vocab_size
    limit = vocab // 3
    limited = (inputs[0] % limit, *inputs[1:])  # no scored token is masked: only the entropy meets -inf
    install_scoring_head(trained, limit)
    _, entropy = token_logprobs(trained, *limited, with_entropy=True)
    allowed = torch.arange(vocab) < limit
    with torch.no_grad():
        logits = trained(input_ids=limited[0], attention_mask=limited[1]).logits.float()
    logits = logits.masked_fill(~allowed, -torch.inf)
    log_probs = torch.log_softmax(logits, dim=-1)
    assert not torch.isfinite(-(log_probs.exp() * log_probs).sum(-1)).all()  # the plain sum is NaN
    assert torch.isfinite(entropy).all()
    allowed_h = naive_allowed_entropy(trained, *limited, allowed)
    assert torch.allclose(entropy, allowed_h, atol=1e-5)
    entropy.sum().backward()
    grads = [p.grad for p in trained.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def naive_allowed_entropy(model, input_ids, attention_mask, score_mask, allowed):
    """The entropy of the softmax over the ``allowed`` vocabulary entries only, at the scored positions."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()[:, :-1][..., allowed]
    log_probs = torch.log_softmax(logits, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    mask = score_mask.bool().clone()
    mask[:, 0] = False
    return torch.cat([torch.zeros(input_ids.shape[0], 1), entropy], 1) * mask


@torch.no_grad()
def test_temperature_zero_scores_like_temperature_one(model, inputs):
    greedy, _ = token_logprobs(model, *inputs, temperature=0.0)
    plain, _ = token_logprobs(model, *inputs, temperature=1.0)
    assert torch.equal(greedy, plain)


@torch.no_grad()
def test_token_logprobs_do_not_depend_on_the_chunk_size(model, inputs):
    big, big_h = token_logprobs(model, *inputs, with_entropy=True, chunk_size=4096)
    one, one_h = token_logprobs(model, *inputs, with_entropy=True, chunk_size=1)
    three, _ = token_logprobs(model, *inputs, chunk_size=3)
    assert torch.allclose(big, one, atol=1e-6) and torch.allclose(big, three, atol=1e-6)
    assert torch.allclose(big_h, one_h, atol=1e-6)


def test_empty_score_mask_gives_zeros_that_backward_accepts(model, inputs):
    input_ids, attention_mask, _ = inputs
    trained = copy.deepcopy(model)
    logprobs, entropy = token_logprobs(trained, input_ids, attention_mask, torch.zeros(2, 12), with_entropy=True)
    assert not logprobs.any() and not entropy.any()
    (logprobs.sum() + entropy.sum()).backward()  # a micro-batch without trained tokens in a PPO epoch
    assert all(p.grad is None or not p.grad.any() for p in trained.parameters())


@pytest.mark.parametrize("with_head", [False, True])
def test_candidate_logprobs_and_their_gradients_equal_a_full_logits_computation(model, inputs, with_head):
    model = copy.deepcopy(model)
    if with_head:
        install_scoring_head(model, None)
    input_ids, attention_mask, score_mask = inputs
    rows, cols = torch.tensor([0, 1, 0]), torch.tensor([4, 7, 11])
    candidates = torch.tensor([[5, 9, 2], [1, 1, 3], [0, 8, 7]])
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [1.0, 0.0, 0.0]])

    logprobs, scored = token_and_candidate_logprobs(model, input_ids, attention_mask, score_mask, rows, cols,
                                                    candidates)
    (-(logprobs.sum() + (scored * weights).sum())).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)  # position i - 1 predicts token i
    expected_scored = log_probs[rows, cols - 1].gather(-1, candidates)
    expected_lp, _ = naive(model, input_ids, attention_mask, score_mask, 1.0)
    (-(expected_lp.sum() + (expected_scored * weights).sum())).backward()
    assert torch.allclose(logprobs, expected_lp, atol=1e-5)
    assert torch.allclose(scored, expected_scored, atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-5), name


def test_a_candidate_position_must_be_scored(model, inputs):
    with pytest.raises(ValueError, match="scored position"):
        token_and_candidate_logprobs(model, *inputs, torch.tensor([0]), torch.tensor([2]), torch.tensor([[1, 2]]))


def test_token_logprobs_carry_gradients_to_the_model(model, inputs):
    trained = copy.deepcopy(model)
    logprobs, _ = token_logprobs(trained, *inputs)
    logprobs.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.parameters())


def test_token_logprobs_go_through_lora_adapters(model, inputs):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False))
    logprobs, entropy = token_logprobs(lora, *inputs, with_entropy=True)
    with torch.no_grad():
        expected_lp, expected_h = naive(lora, *inputs, 1.0)
        base, _ = token_logprobs(model, *inputs)
        with lora.disable_adapter():
            off, _ = token_logprobs(lora, *inputs)
    assert torch.allclose(logprobs, expected_lp, atol=1e-5) and torch.allclose(entropy, expected_h, atol=1e-5)
    assert not torch.allclose(logprobs, base, atol=1e-3)  # the adapters are in the computation
    assert torch.allclose(off, base, atol=1e-6)  # switched off: the base model (the reference policy)
    logprobs.sum().backward()
    trainable = [(n, p) for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, _ in trainable)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trainable)


# --------------------------------------------------------------------------- the critic
@pytest.fixture
def critic(model):
    critic = ValueModel(copy.deepcopy(model.base_model)).eval()
    torch.nn.init.normal_(critic.value_head.weight, std=1.0, generator=torch.Generator().manual_seed(1))
    torch.nn.init.constant_(critic.value_head.bias, 0.25)
    return critic


def test_new_critic_predicts_zero(model, inputs):
    critic = ValueModel(copy.deepcopy(model.base_model))
    with torch.no_grad():
        assert not critic(*inputs[:2]).any()


@torch.no_grad()
def test_value_at_position_i_depends_only_on_the_tokens_before_it(critic, inputs):
    input_ids, attention_mask, _ = inputs
    values = critic(input_ids, attention_mask)
    assert values.shape == input_ids.shape and values.dtype == torch.float32
    assert not values[:, 0].any()
    for i in (1, 5, 10):
        changed = input_ids.clone()
        changed[:, i] = (changed[:, i] + 1) % critic.backbone.config.vocab_size
        after = critic(changed, attention_mask)
        assert torch.allclose(after[:, : i + 1], values[:, : i + 1], atol=1e-6)  # V(x_<j) for j <= i: unchanged
        assert not torch.allclose(after[0, i + 1], values[0, i + 1], atol=1e-4)  # the next state sees token i


@torch.no_grad()
def test_value_is_the_head_on_the_hidden_state_of_the_previous_token(critic, inputs):
    input_ids, attention_mask, _ = inputs
    hidden = critic.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    after_each = critic.value_head(hidden).squeeze(-1)
    values = critic(input_ids, attention_mask)
    real = attention_mask[:, 1:].bool()
    assert torch.allclose(values[:, 1:][real], after_each[:, :-1][real], atol=1e-6)
    assert not values[:, 1:][~real].any() and not values[:, 0].any()  # padding and the first token: no value


@torch.no_grad()
def test_values_under_bf16_autocast_are_the_head_in_float32_on_the_hidden_states(critic, inputs):
    """Mixed precision rounds the body's matrix products, not the values: the head (one row of float32 weights)
    reads the hidden states in float32, so values near a return of 5 are not rounded to steps of 1/32."""
    input_ids, attention_mask, _ = inputs
    shifted = copy.deepcopy(critic)
    torch.nn.init.normal_(shifted.value_head.weight, std=0.01, generator=torch.Generator().manual_seed(2))
    torch.nn.init.constant_(shifted.value_head.bias, 5.3)
    with autocast(torch.device("cpu"), torch.bfloat16):
        values = shifted(input_ids, attention_mask)
        hidden = shifted.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    expected = shifted.value_head(hidden.float()).squeeze(-1)  # outside autocast: float32
    real = attention_mask[:, 1:].bool()
    assert values.dtype == torch.float32
    torch.testing.assert_close(values[:, 1:][real], expected[:, :-1][real], atol=1e-5, rtol=1e-6)


@torch.no_grad()
def test_critic_save_and_load_round_trip(critic, inputs, tmp_path):
    critic.save_pretrained(tmp_path / "critic")
    assert (tmp_path / "critic" / "value_head.pt").exists()
    loaded = ValueModel.from_pretrained(tmp_path / "critic").eval()
    assert torch.equal(loaded(*inputs[:2]), critic(*inputs[:2]))
    original = dict(critic.state_dict())
    assert all(torch.equal(v, original[k]) for k, v in loaded.state_dict().items())
    assert set(loaded.state_dict()) == set(original)


def test_a_vlm_critic_loaded_from_its_checkpoint_has_the_actors_vision_tower(tiny_tokenizer, tmp_path):
    """A resumed critic's tower attends in one call a layer and runs an unaligned MLP aligned, as the actor's (and
    so a new critic, its copy) does."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from tests.models.test_vision_mlp import bound_aligned
    from turnrl.models import vlm_config
    from turnrl.models.loading import load_model, vision_tower
    from turnrl.models.vision_attention import VISION_ATTENTION

    config = vlm_config("vlm-tiny", tiny_tokenizer)
    config.vision_config.intermediate_size = 100
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    actor = load_model(tmp_path / "model")
    ValueModel(actor.base_model).save_pretrained(tmp_path / "critic")
    for model in (actor, ValueModel.from_pretrained(tmp_path / "critic").backbone):
        tower = vision_tower(model)
        assert tower.config._attn_implementation == VISION_ATTENTION
        assert all(bound_aligned(block.mlp) for block in tower.blocks)
