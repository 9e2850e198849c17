"""The engine backend as a policy: the same completions as the transformers backend, and chosen by
``model.backend``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, ConfigError, EngineConfig, ModelConfig, SamplingConfig
from turnrl.envs import make
from turnrl.models.loading import load_processor
from turnrl.policy.base import GenerationRequest
from turnrl.policy.engine import EnginePolicy
from turnrl.policy.factory import model_policy
from turnrl.policy.hf import HFPolicy
from turnrl.rollout.runner import EpisodeSlot, Rollout

QUESTIONS = ["hi", "Turn 3.\nState:\n_P__\nOO__\nActions left: 7.", "You are playing Sokoban."]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return [tiny_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               return_dict=False) for q in QUESTIONS]


def engine_policy(model, tokenizer) -> EnginePolicy:
    return EnginePolicy(model, tokenizer, EngineConfig(kv_cache_gb=0.5, max_rows=16, max_seq_len=2048))


def requests(prompts, caps=None):
    caps = caps or [None] * len(prompts)
    return [GenerationRequest(prompt_ids=p, messages=[], max_new_tokens=c) for p, c in zip(prompts, caps)]


def test_greedy_completions_equal_the_transformers_backend(model, tiny_tokenizer, prompts):
    sampling = SamplingConfig(temperature=0, max_new_tokens=24)
    caps = [None, 5, None]
    hf = HFPolicy(model, tiny_tokenizer).generate(requests(prompts, caps), sampling)
    engine = engine_policy(model, tiny_tokenizer).generate(requests(prompts, caps), sampling)
    for a, b in zip(hf, engine):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)
    assert len(engine[1].token_ids) <= 5


def test_a_stop_string_cuts_the_response_at_the_token_that_completes_it(model, tiny_tokenizer, prompts):
    sampling = SamplingConfig(temperature=0, max_new_tokens=20)
    free = engine_policy(model, tiny_tokenizer).generate(requests(prompts), sampling)
    ids = free[1].token_ids
    stop = free[1].text[len(free[1].text) // 2 :][:2]
    stopped = engine_policy(model, tiny_tokenizer).generate(
        requests(prompts), SamplingConfig(temperature=0, max_new_tokens=20, stop=[stop]))
    # Only the response is searched: transformers' stopping criterion also matches a stop string that
    # begins in the prompt.
    shortest = next(ids[:end] for end in range(1, len(ids) + 1)
                    if stop in tiny_tokenizer.decode(ids[:end], skip_special_tokens=True))
    assert stopped[1].token_ids == shortest and stopped[1].finish_reason == "stop"


def rollout_trajectories(policy, seed: int):
    agent = AgentConfig(format="no_think", max_turns=6, max_actions_per_episode=6, max_context_tokens=2048)
    rollout = Rollout(policy, get_format("no_think"), agent, "Sokoban")
    slots = [EpisodeSlot(env=make("Sokoban"), seed=s, group=s // 2, sample=s % 2) for s in range(6)]
    torch.manual_seed(seed)
    return rollout.run(slots, SamplingConfig(temperature=0, max_new_tokens=12))


def test_multi_turn_rollouts_are_the_same_trajectories_with_the_engine(model, tiny_tokenizer):
    hf = rollout_trajectories(HFPolicy(model, tiny_tokenizer), 0)
    policy = engine_policy(model, tiny_tokenizer)
    engine = rollout_trajectories(policy, 0)
    assert sum(len(t.turns) for t in engine) > 12
    for a, b in zip(hf, engine):
        first, second = a.tokens.stream(), b.tokens.stream()
        assert (first.input_ids, first.loss_mask) == (second.input_ids, second.loss_mask)
        torch.testing.assert_close(first.logprobs, second.logprobs, atol=1e-4, rtol=1e-4)
        assert [t.reward for t in a.turns] == [t.reward for t in b.turns]
        assert a.status == b.status
    # Later turns extended the cached tokens instead of prefilling the history again.
    assert policy.engine.stats.reused_tokens > policy.engine.stats.prefill_tokens


def test_auto_takes_transformers_on_a_cpu_and_for_a_vlm(model, tiny_tokenizer, tiny_vlm_policy,
                                                                          tiny_vlm_dir):
    # On a CPU, auto takes transformers (the engine was slower there on short prompts); on a GPU the engine.
    assert isinstance(model_policy(model, tiny_tokenizer, ModelConfig(), max_batch_size=8), HFPolicy)
    assert isinstance(model_policy(model, tiny_tokenizer, ModelConfig(backend="engine"), max_batch_size=8),
                      EnginePolicy)
    assert isinstance(model_policy(model, tiny_tokenizer, ModelConfig(backend="hf"), max_batch_size=8), HFPolicy)
    vlm, processor = tiny_vlm_policy, load_processor(str(tiny_vlm_dir))
    chosen = model_policy(vlm.model, vlm.tokenizer, ModelConfig(), max_batch_size=8, processor=processor)
    assert isinstance(chosen, HFPolicy) and chosen.accepts_images
    with pytest.raises(ConfigError, match="model.backend=hf"):
        model_policy(vlm.model, vlm.tokenizer, ModelConfig(backend="engine"), max_batch_size=8, processor=processor)


def test_cache_rows_are_capped_by_the_batch(model, tiny_tokenizer):
    policy = model_policy(model, tiny_tokenizer, ModelConfig(backend="engine"), max_batch_size=12)
    assert isinstance(policy, EnginePolicy) and policy.engine.rows == 12


# --------------------------------------------------------------------------- episodes that do not wait
def streaming_trajectories(policy, wait: bool, executor=None, envs=None):
    agent = AgentConfig(format="no_think", max_turns=6, max_actions_per_episode=6, max_context_tokens=2048,
                        wait_for_turns=wait)
    rollout = Rollout(policy, get_format("no_think"), agent, "Sokoban", executor=executor)
    envs = envs or [make("Sokoban") for _ in range(6)]
    slots = [EpisodeSlot(env=env, seed=s, group=s // 2, sample=s % 2) for s, env in enumerate(envs)]
    return rollout.run(slots, SamplingConfig(temperature=0, max_new_tokens=12))


@pytest.mark.parametrize("threads", [0, 3])
def test_episodes_that_do_not_wait_give_the_same_trajectories_as_rounds(model, tiny_tokenizer, threads):
    from concurrent.futures import ThreadPoolExecutor

    rounds = streaming_trajectories(engine_policy(model, tiny_tokenizer), wait=True)
    executor = ThreadPoolExecutor(threads) if threads else None
    free = streaming_trajectories(engine_policy(model, tiny_tokenizer), wait=False, executor=executor)
    assert sum(len(t.turns) for t in free) > 12
    for a, b in zip(rounds, free):
        first, second = a.tokens.stream(), b.tokens.stream()
        assert (first.input_ids, first.loss_mask) == (second.input_ids, second.loss_mask)
        assert [(t.response, t.actions, t.rewards) for t in a.turns] == [(t.response, t.actions, t.rewards)
                                                                        for t in b.turns]
        assert (a.status, a.truncation_reason, a.success) == (b.status, b.truncation_reason, b.success)


def test_not_waiting_needs_a_policy_that_streams(model, tiny_tokenizer):
    agent = AgentConfig(format="no_think", wait_for_turns=False)
    with pytest.raises(ValueError, match="model.backend=engine"):
        Rollout(HFPolicy(model, tiny_tokenizer), get_format("no_think"), agent, "Sokoban")
