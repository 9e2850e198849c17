"""The transformers backend on the built-in tiny Qwen2: left padding, sampling logprobs, stopping."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs import make
from turnrl.policy.hf import HFPolicy, left_pad
from turnrl.policy.interface import GenerationRequest
from turnrl.rollout.runner import EpisodeSlot, Rollout

QUESTIONS = [
    "hi",
    "You are playing Sokoban. Push every box onto a target. Boxes on targets: 0 of 1.",
    "Turn 3.\nState:\n_P__\nOO__\nActions left: 7.",
]


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    """Chat prompts of different lengths (so the batch needs left padding)."""
    out = [
        tiny_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           return_dict=False)
        for q in QUESTIONS
    ]
    assert len({len(p) for p in out}) == len(out)
    return out


def requests(prompts, caps=None) -> list[GenerationRequest]:
    caps = caps or [None] * len(prompts)
    return [GenerationRequest(prompt_ids=p, messages=[], max_new_tokens=c) for p, c in zip(prompts, caps)]


def sample(policy, prompts, seed=0, caps=None, **sampling):
    torch.manual_seed(seed)
    return policy.generate(requests(prompts, caps), SamplingConfig(**sampling))


def reference_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits that predicted each response token, from one unpadded forward pass. Shape (R, vocab)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1]


def fresh_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


# --------------------------------------------------------------------------- logprobs
@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.3, top_k=20, top_p=0.9)],
    ids=["t1", "t0.6", "t1.3-topk-topp"],
)
def test_sampled_logprobs_equal_full_forward_log_softmax_over_temperature(tiny_policy, prompts, sampling):
    completions = sample(tiny_policy, prompts, seed=1, max_new_tokens=24, **sampling)
    temperature = sampling["temperature"]
    for prompt, completion in zip(prompts, completions):
        ids = completion.token_ids
        assert len(ids) >= 1 and len(completion.logprobs) == len(ids)
        logits = reference_logits(tiny_policy.model, prompt, ids)
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=2e-4, rtol=1e-4)


def test_rows_past_the_vocabulary_limit_are_never_sampled_nor_in_the_logprobs(tiny_model_dir, tiny_tokenizer,
                                                                                prompts):
    """A head with rows past the tokenizer's tokens: they are never sampled and the log-probs are over the rows
    below the limit, as the trainer's scoring head takes them."""
    model = fresh_model(tiny_model_dir)
    policy = HFPolicy(model, tiny_tokenizer)
    assert policy.vocab_limit == len(tiny_tokenizer)
    policy.vocab_limit = limit = 100
    with torch.no_grad():  # most of the mass past the limit: unlimited sampling would pick those rows
        model.get_output_embeddings().weight[limit:] *= 4
    completions = sample(policy, prompts, seed=3, max_new_tokens=16, temperature=1.0)
    for prompt, completion in zip(prompts, completions):
        ids = completion.token_ids
        assert ids and max(ids) < limit
        logits = reference_logits(model, prompt, ids)[:, :limit]
        expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=2e-4, rtol=1e-4)


def test_left_padding_does_not_change_what_a_prompt_samples(tiny_policy, prompts):
    """Greedy ids of each prompt are the same alone and in a left-padded batch."""
    batched = sample(tiny_policy, prompts, temperature=0, max_new_tokens=10)
    for prompt, completion in zip(prompts, batched):
        alone = sample(tiny_policy, [prompt], temperature=0, max_new_tokens=10)[0]
        assert alone.token_ids == completion.token_ids
        torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(completion.logprobs), atol=1e-4,
                                   rtol=1e-4)


def test_left_pad_puts_padding_on_the_left():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]


# --------------------------------------------------------------------------- greedy
def test_greedy_is_deterministic_and_takes_the_argmax(tiny_policy, prompts):
    first = sample(tiny_policy, prompts, seed=0, temperature=0, max_new_tokens=12)
    second = sample(tiny_policy, prompts, seed=123, temperature=0, max_new_tokens=12)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    for prompt, completion in zip(prompts, first):
        logits = reference_logits(tiny_policy.model, prompt, completion.token_ids)
        assert completion.token_ids == logits.argmax(-1).tolist()
        # Greedy scores with temperature 1.
        expected = torch.log_softmax(logits, -1).max(-1).values
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=2e-4, rtol=1e-4)


def test_batches_larger_than_max_batch_size_are_split_without_changing_results(tiny_model_dir, tiny_policy, prompts):
    small = HFPolicy(tiny_policy.model, tiny_policy.tokenizer, max_batch_size=2)
    many = prompts * 2
    split = sample(small, many, temperature=0, max_new_tokens=6)
    whole = sample(tiny_policy, many, temperature=0, max_new_tokens=6)
    assert len(split) == len(many)
    assert [c.token_ids for c in split] == [c.token_ids for c in whole]


# --------------------------------------------------------------------------- lengths and stopping
def test_per_request_max_new_tokens_is_respected(tiny_policy, prompts):
    # Greedy on the untrained tiny model never picks an end-of-turn token, so every row runs to its cap.
    completions = sample(tiny_policy, prompts, caps=[3, None, 20], temperature=0, max_new_tokens=8)
    assert [len(c.token_ids) for c in completions] == [3, 8, 8]
    assert [len(c.logprobs) for c in completions] == [3, 8, 8]
    assert all(c.finish_reason == "length" for c in completions)
    uncapped = sample(tiny_policy, prompts, temperature=0, max_new_tokens=8)
    assert completions[0].token_ids == uncapped[0].token_ids[:3]


def cut_at(ids: list[int], stop_ids: set[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(ids) if t in stop_ids), len(ids))
    return ids[:end]


def test_end_of_turn_token_ends_the_response_and_is_included(tiny_model_dir, tiny_tokenizer, prompts):
    model = fresh_model(tiny_model_dir)
    policy = HFPolicy(model, tiny_tokenizer)
    free = sample(policy, prompts, seed=3, temperature=1.0, max_new_tokens=16)
    row = next(c.token_ids for c in free if len(c.token_ids) == 16)
    end_id = next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i] and t not in policy.eos_ids)
    # The model's generation config names the ids that end a turn; add one it samples mid-response.
    model.generation_config.eos_token_id = [*policy.eos_ids, end_id]
    stopping = HFPolicy(model, tiny_tokenizer)
    assert end_id in stopping.eos_ids
    stopped = sample(stopping, prompts, seed=3, temperature=1.0, max_new_tokens=16)
    hit = 0
    for before, after in zip(free, stopped):
        expected = cut_at(before.token_ids, set(stopping.eos_ids))
        assert after.token_ids == expected
        torch.testing.assert_close(after.logprobs, before.logprobs[: len(expected)])
        ended = expected[-1] in stopping.eos_ids
        assert after.finish_reason == ("stop" if ended else "length")
        hit += expected[-1] == end_id
    assert hit >= 1
    assert stopped[free.index(next(c for c in free if c.token_ids == row))].token_ids[-1] == end_id


def shortest_prefix_with(tokenizer, ids: list[int], stop: str) -> list[int] | None:
    for end in range(1, len(ids) + 1):
        if stop in tokenizer.decode(ids[:end], skip_special_tokens=True):
            return ids[:end]
    return None


def test_stop_string_cuts_at_the_token_that_completes_it(tiny_tokenizer, tiny_policy, prompts):
    free = sample(tiny_policy, prompts, seed=5, temperature=1.0, max_new_tokens=20)
    # A stop string that one row produces mid-response, spanning two of its tokens.
    stop = None
    for row in free:
        for j in range(3, len(row.token_ids) - 3):
            text = tiny_tokenizer.decode(row.token_ids[j : j + 2], skip_special_tokens=True)
            before = tiny_tokenizer.decode(row.token_ids[:j], skip_special_tokens=True)
            if len(text.strip()) >= 3 and text.isascii() and text.isprintable() and text not in before:
                stop = text
                break
        if stop:
            break
    assert stop is not None, f"no usable stop string in {[c.text for c in free]}"
    stopped = sample(tiny_policy, prompts, seed=5, temperature=1.0, max_new_tokens=20, stop=[stop])
    cut = 0
    for before, after in zip(free, stopped):
        expected = shortest_prefix_with(tiny_tokenizer, before.token_ids, stop)
        if expected is None:
            assert after.token_ids == before.token_ids and after.finish_reason == before.finish_reason
            continue
        cut += 1
        # Only sampled tokens: the response ends at the token that completed the stop string.
        assert after.token_ids == expected
        assert after.finish_reason == "stop"
        assert stop in after.text
        assert len(after.logprobs) == len(expected)
        torch.testing.assert_close(after.logprobs, before.logprobs[: len(expected)])
    assert cut >= 1


def test_a_stop_string_that_begins_in_the_prompt_leaves_the_response_alone(tiny_tokenizer, tiny_policy, prompts):
    """Only the response is searched, as the engine searches it: a generation prompt that ends in a newline and a
    response that starts with one do not make ``"\\n..."`` a stop string of the response's first token."""
    assert all(tiny_tokenizer.decode(prompt).endswith("\n") for prompt in prompts)
    free = sample(tiny_policy, prompts, temperature=0, max_new_tokens=12)
    row = next(c for c in free if c.text.startswith("\n"))
    stop = "\n" + row.text[:1]
    # A row whose response does not start after a newline keeps the batch going past the others' stops.
    batch = [*prompts, prompts[1][:-1]]
    free = sample(tiny_policy, batch, temperature=0, max_new_tokens=12)
    stopped = sample(tiny_policy, batch, temperature=0, max_new_tokens=12, stop=[stop])
    for before, after in zip(free, stopped):
        expected = shortest_prefix_with(tiny_tokenizer, before.token_ids, stop) or before.token_ids
        assert after.token_ids == expected
        assert after.finish_reason == ("stop" if stop in after.text else before.finish_reason)
        torch.testing.assert_close(after.logprobs, before.logprobs[: len(expected)])


def test_stop_string_never_seen_leaves_responses_alone(tiny_policy, prompts):
    free = sample(tiny_policy, prompts, seed=2, temperature=1.0, max_new_tokens=10)
    same = sample(tiny_policy, prompts, seed=2, temperature=1.0, max_new_tokens=10, stop=["\u2603never\u2603"])
    assert [c.token_ids for c in same] == [c.token_ids for c in free]
    assert [c.finish_reason for c in same] == [c.finish_reason for c in free]


def test_text_is_the_decoded_response_without_special_tokens(tiny_tokenizer, tiny_policy, prompts):
    for completion in sample(tiny_policy, prompts, seed=7, temperature=1.0, max_new_tokens=16):
        assert completion.text == tiny_tokenizer.decode(completion.token_ids, skip_special_tokens=True)


# --------------------------------------------------------------------------- the checkpoint's generation config
RESHAPING = dict(repetition_penalty=3.0, no_repeat_ngram_size=2, min_new_tokens=12, typical_p=0.5, min_p=0.3,
                 epsilon_cutoff=0.01, top_k=2, top_p=0.1, temperature=0.1)
"""Settings a checkpoint's generation_config.json may carry (Qwen2.5 instruct: ``repetition_penalty: 1.05``), here
strong enough to change every response of the tiny model."""


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0)], ids=["greedy", "t1"])
def test_the_checkpoints_generation_config_does_not_reshape_sampling(tiny_model_dir, tiny_tokenizer, tiny_policy,
                                                                      prompts, sampling):
    """Responses and logprobs follow the sampling settings alone, as the engine's do: the checkpoint's own
    penalties and truncations would sample from a distribution the logprobs are not taken from."""
    model = fresh_model(tiny_model_dir)
    for name, value in RESHAPING.items():
        setattr(model.generation_config, name, value)
    reshaped = sample(HFPolicy(model, tiny_tokenizer), prompts, seed=4, max_new_tokens=16, **sampling)
    plain = sample(tiny_policy, prompts, seed=4, max_new_tokens=16, **sampling)
    assert [c.token_ids for c in reshaped] == [c.token_ids for c in plain]
    for a, b in zip(reshaped, plain):
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)


def test_a_generation_config_that_reshapes_sampling_for_good_is_refused(tiny_model_dir, tiny_tokenizer):
    model = fresh_model(tiny_model_dir)
    model.generation_config.forced_eos_token_id = tiny_tokenizer.eos_token_id
    with pytest.raises(ValueError, match="forced_eos_token_id"):
        HFPolicy(model, tiny_tokenizer)


# --------------------------------------------------------------------------- guards
def test_requests_without_prompt_ids_are_refused(tiny_policy):
    with pytest.raises(ValueError, match="prompt_ids"):
        tiny_policy.generate([GenerationRequest(prompt_ids=None, messages=[])], SamplingConfig())


@pytest.mark.parametrize("bad_token", [-1, "vocab"])
def test_a_prompt_with_a_token_outside_the_vocabulary_fails_alone(tiny_policy, prompts, bad_token):
    vocab = tiny_policy.model.get_input_embeddings().num_embeddings
    bad = list(prompts[1])
    bad[3] = vocab if bad_token == "vocab" else bad_token
    completions = sample(tiny_policy, [prompts[0], bad, prompts[2]], temperature=0, max_new_tokens=6)
    assert completions[1].finish_reason == "error" and f"token id {bad[3]}" in (completions[1].error or "")
    alone = sample(tiny_policy, [prompts[0], prompts[2]], temperature=0, max_new_tokens=6)
    assert [completions[0].token_ids, completions[2].token_ids] == [c.token_ids for c in alone]


def test_tokenizer_without_pad_token_is_refused(tiny_model_dir, tiny_policy):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    with pytest.raises(ValueError, match="pad"):
        HFPolicy(tiny_policy.model, tokenizer)


def test_generate_restores_training_mode(tiny_model_dir, tiny_tokenizer, prompts):
    model = fresh_model(tiny_model_dir).train()
    policy = HFPolicy(model, tiny_tokenizer)
    first = sample(policy, prompts[:1], temperature=0, max_new_tokens=4)
    assert model.training
    model.eval()
    assert sample(policy, prompts[:1], temperature=0, max_new_tokens=4)[0].token_ids == first[0].token_ids


# --------------------------------------------------------------------------- the model's context window
def test_episodes_end_at_the_models_context_window_not_past_it(tiny_model_dir, tiny_tokenizer):
    """A model of 640 positions with an agent that allows 4,096 tokens: the rollout ends the episode where the
    next prompt and response would pass the window (as at agent.max_context_tokens), rather than running the
    model on positions it was never made for."""
    model = fresh_model(tiny_model_dir)
    assert HFPolicy(model, tiny_tokenizer).max_sequence_tokens == model.config.max_position_embeddings
    model.config.max_position_embeddings = 640
    policy = HFPolicy(model, tiny_tokenizer)
    assert policy.max_sequence_tokens == 640
    agent = AgentConfig(format="no_think", max_turns=8, max_actions_per_episode=8, max_context_tokens=4096)
    rollout = Rollout(policy, get_format("no_think"), agent, "Sokoban")
    assert rollout.context_budget == 640
    sampling = SamplingConfig(temperature=0, max_new_tokens=12)
    trajectories = rollout.run([EpisodeSlot(env=make("Sokoban"), seed=s, group=s, sample=0) for s in range(2)],
                               sampling)
    assert all(t.error is None for t in trajectories) and any(
        t.truncation_reason == "context_budget" for t in trajectories)
    for trajectory in trajectories:
        for index in range(len(trajectory.turns)):
            assert len(trajectory.tokens.prompt_ids(index)) + sampling.max_new_tokens <= 640
