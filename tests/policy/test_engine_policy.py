"""The engine backend as a policy: the same completions as the transformers backend, and chosen by
``model.backend``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, ConfigError, EngineConfig, ModelConfig, SamplingConfig
from turnrl.engine import attention
from turnrl.envs import make
from turnrl.models.loading import load_processor, vision_tower
from turnrl.policy.engine import EnginePolicy
from turnrl.policy.factory import model_policy, rollout_policies
from turnrl.policy.hf import HFPolicy
from turnrl.policy.interface import GenerationRequest
from turnrl.rollout.context import EpisodeTokens
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


def test_a_rollout_logs_the_engines_work_of_that_rollout_alone(model, tiny_tokenizer):
    """``timings.policy_work``: what the engine counted during one ``run`` (a second run's own counts, not the
    engine's running totals); a policy that counts nothing logs nothing."""
    agent = AgentConfig(format="no_think", max_turns=4, max_actions_per_episode=4, max_context_tokens=2048)
    policy = engine_policy(model, tiny_tokenizer)
    rollout = Rollout(policy, get_format("no_think"), agent, "Sokoban")
    works = []
    for _ in range(2):
        slots = [EpisodeSlot(env=make("Sokoban"), seed=s, group=s, sample=0) for s in range(3)]
        trajectories = rollout.run(slots, SamplingConfig(temperature=0, max_new_tokens=8))
        works.append(rollout.timings.policy_work)
        generated = sum(len(turn.response_ids) for t in trajectories for turn in t.turns)
        assert works[-1]["generated_tokens"] == generated
        assert works[-1]["reused_tokens"] > 0 and works[-1]["decode_steps"] >= 8
        # and its device work, timed (wall time on a CPU) within the rollout's generation
        assert 0 < works[-1]["prefill_device_s"] + works[-1]["decode_device_s"] <= rollout.timings.generate_s
        assert works[-1]["prefill_flops"] > 0 and works[-1]["decode_bytes"] > 0 and works[-1]["vision_flops"] == 0
    # The same greedy episodes, counted afresh: the same tokens generated and prompt tokens met; the second
    # run finds more of its prompts still cached.
    seen = [w["prefill_tokens"] + w["reused_tokens"] + w["shared_tokens"] for w in works]
    assert works[0]["generated_tokens"] == works[1]["generated_tokens"] and seen[0] == seen[1]
    assert works[1]["reused_tokens"] > works[0]["reused_tokens"]
    assert policy.counters()["generated_tokens"] == 2 * works[0]["generated_tokens"]
    hf = Rollout(HFPolicy(model, tiny_tokenizer), get_format("no_think"), agent, "Sokoban")
    hf.run([EpisodeSlot(env=make("Sokoban"), seed=0, group=0, sample=0)], SamplingConfig(max_new_tokens=4))
    assert hf.timings.policy_work == {}


def test_an_episode_that_outgrows_an_engine_row_ends_at_its_budget_not_in_an_error(model, tiny_tokenizer):
    """The agent allows 4,096 tokens an episode, an engine row holds 640 (the first prompt is 469): the rollout
    ends the episode where the next prompt and response would not fit the row (as at agent.max_context_tokens),
    no request fails, and no response is cut short by the row's end."""
    policy = EnginePolicy(model, tiny_tokenizer, EngineConfig(kv_cache_gb=0.5, max_rows=16, max_seq_len=640))
    assert policy.max_sequence_tokens == 640
    agent = AgentConfig(format="no_think", max_turns=8, max_actions_per_episode=8, max_context_tokens=4096)
    rollout = Rollout(policy, get_format("no_think"), agent, "Sokoban")
    assert rollout.context_budget == 640
    slots = [EpisodeSlot(env=make("Sokoban"), seed=s, group=s, sample=0) for s in range(3)]
    sampling = SamplingConfig(temperature=0, max_new_tokens=12)
    trajectories = rollout.run(slots, sampling)
    assert all(t.status != "error" and t.error is None for t in trajectories), [t.error for t in trajectories]
    assert all(t.turns for t in trajectories) and any(t.truncation_reason == "context_budget" for t in trajectories)
    for trajectory in trajectories:
        for index in range(len(trajectory.turns)):
            assert len(trajectory.tokens.prompt_ids(index)) + sampling.max_new_tokens <= 640


def test_an_engine_row_longer_than_the_models_context_window_is_held_to_the_window(model, tiny_tokenizer):
    """The tiny model was made for 2,048 positions: rows of 4,096 would let an episode run past them."""
    assert model.config.max_position_embeddings == 2048
    policy = EnginePolicy(model, tiny_tokenizer, EngineConfig(kv_cache_gb=0.5, max_rows=16, max_seq_len=4096))
    assert policy.max_sequence_tokens == 2048


def test_auto_takes_transformers_on_a_cpu_for_text_and_vlms(model, tiny_tokenizer, tiny_vlm_policy, tiny_vlm_dir):
    # On a CPU, auto takes transformers (the engine was slower there on short prompts); on a GPU the engine, for
    # VLMs too (1.8x generate's speed in image rollouts on an H100).
    assert isinstance(model_policy(model, tiny_tokenizer, ModelConfig(), max_batch_size=8), HFPolicy)
    assert isinstance(model_policy(model, tiny_tokenizer, ModelConfig(backend="engine"), max_batch_size=8),
                      EnginePolicy)
    assert isinstance(model_policy(model, tiny_tokenizer, ModelConfig(backend="hf"), max_batch_size=8), HFPolicy)
    vlm, processor = tiny_vlm_policy, load_processor(str(tiny_vlm_dir))
    chosen = model_policy(vlm.model, vlm.tokenizer, ModelConfig(), max_batch_size=8, processor=processor)
    assert isinstance(chosen, HFPolicy) and chosen.accepts_images
    engine = model_policy(vlm.model, vlm.tokenizer, ModelConfig(backend="engine"), max_batch_size=8,
                          processor=processor)
    assert isinstance(engine, EnginePolicy) and engine.accepts_images and engine.engine.weights.vision is not None
    with pytest.raises(ConfigError, match="model.backend=engine"):
        model_policy(Unsupported(), tiny_tokenizer, ModelConfig(backend="engine"), max_batch_size=8)


def test_training_and_validation_share_one_engine_and_get_a_generate_batch_each(model, tiny_tokenizer):
    train, val = rollout_policies(model, tiny_tokenizer, ModelConfig(), batch_size=64, validation_batch_size=32)
    assert isinstance(train, HFPolicy) and isinstance(val, HFPolicy)
    assert (train.max_batch_size, val.max_batch_size) == (64, 32) and train.model is val.model is model
    train, val = rollout_policies(model, tiny_tokenizer, ModelConfig(backend="engine"), batch_size=8,
                                  validation_batch_size=12)
    assert isinstance(train, EnginePolicy) and train is val and train.engine.config.max_rows == 12
    assert train.streaming() is train and train.max_batch_size is None


class Unsupported(torch.nn.Module):
    """A model of an architecture the engine does not run."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = type("Config", (), {"model_type": "gpt2"})()


def test_cache_rows_are_capped_by_the_batch(model, tiny_tokenizer):
    policy = model_policy(model, tiny_tokenizer, ModelConfig(backend="engine"), max_batch_size=12)
    assert isinstance(policy, EnginePolicy) and policy.engine.rows == 12


# --------------------------------------------------------------------------- episodes that do not wait
def streaming_trajectories(policy, wait: bool, executor=None, envs=None, prefill_groups: int = 1):
    agent = AgentConfig(format="no_think", max_turns=6, max_actions_per_episode=6, max_context_tokens=2048,
                        wait_for_turns=wait, prefill_groups=prefill_groups)
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


def assert_same_episodes(expected, got) -> None:
    for a, b in zip(expected, got, strict=True):
        first, second = a.tokens.stream(), b.tokens.stream()
        assert (first.input_ids, first.loss_mask) == (second.input_ids, second.loss_mask)
        torch.testing.assert_close(first.logprobs, second.logprobs, atol=1e-4, rtol=1e-4)
        assert [(t.response, t.actions, t.rewards) for t in a.turns] == [(t.response, t.actions, t.rewards)
                                                                        for t in b.turns]
        assert (a.status, a.truncation_reason, a.success) == (b.status, b.truncation_reason, b.success)


def prefill_calls(policy: EnginePolicy) -> list[int]:
    """The sequences of each of the policy's prefill calls from now on (filled as it runs)."""
    calls: list[int] = []
    prefill = policy.engine.runner.prefill

    def counted(chunk):
        calls.append(len(chunk.sequences))
        return prefill(chunk)

    policy.engine.runner.prefill = counted
    return calls


@pytest.mark.parametrize(("groups", "threads"), [(2, 0), (4, 3), (6, 0)])
def test_rounds_prefilled_in_parts_give_the_same_trajectories_as_rounds(model, tiny_tokenizer, groups, threads):
    """Each part's prefill starts while the next part's envs step; the decode waits for the whole round."""
    from concurrent.futures import ThreadPoolExecutor

    in_rounds, in_parts = engine_policy(model, tiny_tokenizer), engine_policy(model, tiny_tokenizer)
    rounds_calls, parts_calls = prefill_calls(in_rounds), prefill_calls(in_parts)
    rounds = streaming_trajectories(in_rounds, wait=True)
    executor = ThreadPoolExecutor(threads) if threads else None
    parts = streaming_trajectories(in_parts, wait=True, executor=executor, prefill_groups=groups)
    assert_same_episodes(rounds, parts)
    assert sum(len(t.turns) for t in parts) > 12
    # The same prompts prefilled, after the first round in smaller calls: a round's parts went to the device apart.
    assert sum(parts_calls) == sum(rounds_calls) and parts_calls[0] == rounds_calls[0] == 6
    assert max(parts_calls[1:]) <= -(-6 // groups) < max(rounds_calls[1:])
    # Decode steps never ran a part alone: each round's batch was whole, so the steps are the rounds' own.
    assert in_parts.engine.stats.decode_steps == in_rounds.engine.stats.decode_steps


def test_a_failed_prefill_ends_the_rounds_queued_requests_and_the_rollout_goes_on(model, tiny_tokenizer,
                                                                                   monkeypatch):
    policy = engine_policy(model, tiny_tokenizer)
    prefill = policy.engine.prefill_waiting
    calls = []

    def second_fails():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        prefill()

    monkeypatch.setattr(policy.engine, "prefill_waiting", second_fails)
    trajectories = streaming_trajectories(policy, wait=True, prefill_groups=3)
    errors = [t for t in trajectories if t.status == "error"]
    assert errors and all("prefill failed: RuntimeError: out of memory" in (t.error or "") for t in errors)
    assert len(errors) < len(trajectories)  # the first part's episodes had finished their first round earlier


def test_a_request_refused_at_submission_ends_its_episode_alone_in_parts(model, tiny_tokenizer, monkeypatch):
    policy = engine_policy(model, tiny_tokenizer)
    submit, calls = policy.submit, []

    def seventh_refused(request, sampling):
        calls.append(1)
        if len(calls) == 7:  # the first request of the second round
            raise ValueError("prompt refused")
        return submit(request, sampling)

    monkeypatch.setattr(policy, "submit", seventh_refused)
    trajectories = streaming_trajectories(policy, wait=True, prefill_groups=2)
    errors = [t for t in trajectories if t.status == "error"]
    assert len(errors) == 1 and "policy failed: ValueError: prompt refused" in (errors[0].error or "")
    assert len(errors[0].turns) == 2 and all(len(t.turns) >= 2 for t in trajectories)


def test_parts_of_a_round_need_rounds_and_a_policy_that_streams(model, tiny_tokenizer):
    with pytest.raises(ConfigError, match="agent.wait_for_turns=false has none"):
        AgentConfig(wait_for_turns=False, prefill_groups=2).validate()
    with pytest.raises(ValueError, match="model.backend=engine"):
        Rollout(HFPolicy(model, tiny_tokenizer), get_format("no_think"), AgentConfig(prefill_groups=2), "Sokoban")


def test_not_waiting_needs_a_policy_that_streams(model, tiny_tokenizer):
    agent = AgentConfig(format="no_think", wait_for_turns=False)
    with pytest.raises(ValueError, match="model.backend=engine"):
        Rollout(HFPolicy(model, tiny_tokenizer), get_format("no_think"), agent, "Sokoban")


# --------------------------------------------------------------------------- a VLM's images
def image_rollouts(policy, wait: bool = True, prefill_groups: int = 1):
    # Without the env's and the format's instructions: a first prompt of 79 tokens instead of 300, whose prefill
    # is most of the Triton variant's time in the interpreter; the images, turns and reuse are the same.
    agent = AgentConfig(format="no_think", max_turns=3, max_actions_per_episode=20, wait_for_turns=wait,
                        env_instructions=False, format_instructions=False, prefill_groups=prefill_groups)
    rollout = Rollout(policy, get_format("no_think"), agent, "Maze2D")
    slots = [EpisodeSlot(env=make("Maze2D", mode="image"), seed=s, group=s) for s in range(3)]
    return rollout.run(slots, SamplingConfig(temperature=0, max_new_tokens=12))


def vlm_engine_policy(tiny_vlm_policy, tiny_vlm_dir, triton: str = "false") -> EnginePolicy:
    return EnginePolicy(tiny_vlm_policy.model, tiny_vlm_policy.tokenizer,
                        EngineConfig(kv_cache_gb=0.5, max_rows=8, max_seq_len=4096, triton=triton),
                        processor=load_processor(str(tiny_vlm_dir)))


# The Triton variant (22-35 s in Triton's interpreter) runs with the slow tests. By default the Triton kernels
# rotate a Qwen-VL decoder's image tokens by their M-RoPE positions as they cache them, and a second turn's new image
# extends the cached row, in tests/engine/test_qwen2_vl.py (Qwen2-VL: the decoder and image positions of the tiny
# Qwen2.5-VL here); the rollouts here run with torch's kernels.
@pytest.mark.parametrize(("wait", "triton", "groups"), [
    (True, "false", 1), (False, "false", 1), (True, "false", 3),
    pytest.param(True, "true", 1, marks=[pytest.mark.cpu_triton, pytest.mark.slow])])
def test_vlm_rollouts_with_images_are_the_same_trajectories_with_the_engine(tiny_vlm_policy, tiny_vlm_dir, wait,
                                                                            triton, groups, monkeypatch):
    """A new image every turn: the engine's image features, M-RoPE positions, suppressed vision tokens and KV
    reuse give transformers' tokens and logprobs (with torch's kernels, and with the Triton ones in Triton's
    interpreter, its decode attention unsplit: the interpreter's time grows with the programs launched), in rounds,
    without them, and with each round's next requests prefilled in parts."""
    monkeypatch.setattr(attention, "multiprocessors", lambda device: 1)
    hf = image_rollouts(tiny_vlm_policy)
    policy = vlm_engine_policy(tiny_vlm_policy, tiny_vlm_dir, triton)
    engine = image_rollouts(policy, wait, groups)
    assert sum(len(t.images) for t in engine) >= 6
    for a, b in zip(hf, engine):
        first, second = a.tokens.stream(), b.tokens.stream()
        assert (first.input_ids, first.loss_mask) == (second.input_ids, second.loss_mask)
        torch.testing.assert_close(first.logprobs, second.logprobs, atol=1e-4, rtol=1e-4)
        assert (a.status, [t.reward for t in a.turns]) == (b.status, [t.reward for t in b.turns])
    assert policy.engine.stats.reused_tokens > policy.engine.stats.prefill_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_float32_tower_computes_in_the_engines_dtype_as_the_trainers_passes_do(tiny_vlm_dir, dtype):
    """Mixed-precision training keeps float32 weights and gives the engine bf16 copies of the decoder's; the tower
    has none, and the engine switches a caller's autocast off: its matrix products must still run in the engine's
    dtype (they ran in float32, several times slower on a GPU), as under the trainer's autocast."""
    policy = HFPolicy.from_config(ModelConfig(device="cpu", dtype="float32"), str(tiny_vlm_dir))
    engine = EnginePolicy(policy.model, policy.tokenizer, EngineConfig(kv_cache_gb=0.25, max_rows=4, max_seq_len=2048),
                          dtype=dtype, processor=load_processor(str(tiny_vlm_dir)))
    computed = []
    block = vision_tower(policy.model).blocks[0]
    hooks = [module.register_forward_hook(lambda module, inputs, output: computed.append(output.dtype))
             for module in (block.attn.qkv, block.mlp.down_proj)]
    with torch.autocast("cpu", enabled=False):  # a caller's setting does not reach the engine either way
        image_rollouts(engine)
    for hook in hooks:
        hook.remove()
    assert computed and set(computed) == {dtype}
    assert all(parameter.dtype == torch.float32 for parameter in block.parameters())


def test_the_encoders_digests_reuse_the_cache_as_the_hashed_pixels_do(tiny_vlm_policy, tiny_vlm_dir, monkeypatch):
    """The rollout's requests carry each image's digest from the encoder; without them the engine hashes the
    pixel values: the same trajectories, prefill and reuse either way."""
    given = vlm_engine_policy(tiny_vlm_policy, tiny_vlm_dir)
    with_digests = image_rollouts(given)
    monkeypatch.setattr(EpisodeTokens, "prompt_image_digests", lambda self, t=None: None)
    hashed = vlm_engine_policy(tiny_vlm_policy, tiny_vlm_dir)
    without = image_rollouts(hashed)
    assert [t.tokens.stream().input_ids for t in with_digests] == [t.tokens.stream().input_ids for t in without]
    stats = given.engine.stats, hashed.engine.stats
    assert stats[0].reused_tokens == stats[1].reused_tokens > stats[0].prefill_tokens == stats[1].prefill_tokens


def test_a_cached_row_is_reused_only_by_a_prompt_with_the_same_images(tiny_vlm_policy, tiny_vlm_dir):
    (trajectory,) = image_rollouts(tiny_vlm_policy)[:1]
    sample = trajectory.tokens.turn_samples()[0]
    inputs = sample.model_inputs
    other = {**inputs, "pixel_values": inputs["pixel_values"].flip(0)}
    image_token = tiny_vlm_policy.model.config.image_token_id
    first_image = sample.prompt_ids.index(image_token)

    def complete(policy, model_inputs):
        request = GenerationRequest(prompt_ids=list(sample.prompt_ids), messages=[], model_inputs=model_inputs)
        handle = policy.submit(request, SamplingConfig(temperature=0, max_new_tokens=6))
        results = {}
        while handle not in results:
            results.update(policy.poll())
        return results[handle], policy.engine.stats.reused_tokens

    policy = vlm_engine_policy(tiny_vlm_policy, tiny_vlm_dir)
    complete(policy, inputs)
    # The same tokens with other pixels: the cached row (its placeholders stand for the first image) is not
    # extended; a row is reused only by a prompt that extends all of it.
    changed, reused = complete(policy, other)
    assert reused == 0 and first_image > 0
    fresh, _ = complete(vlm_engine_policy(tiny_vlm_policy, tiny_vlm_dir), other)
    assert changed.token_ids == fresh.token_ids
    again, reused_again = complete(policy, other)  # the same images: the row is reused
    assert reused_again == len(sample.prompt_ids) - 1 and again.token_ids == changed.token_ids


def test_a_request_whose_images_do_not_fit_its_placeholders_fails_alone(tiny_vlm_policy, tiny_vlm_dir):
    (trajectory,) = image_rollouts(tiny_vlm_policy)[:1]
    sample = trajectory.tokens.turn_samples()[0]
    good = GenerationRequest(prompt_ids=list(sample.prompt_ids), messages=[], model_inputs=sample.model_inputs)
    bad = GenerationRequest(prompt_ids=list(sample.prompt_ids), messages=[], model_inputs={})
    video = GenerationRequest(prompt_ids=list(sample.prompt_ids) + [tiny_vlm_policy.model.config.video_token_id],
                              messages=[], model_inputs=sample.model_inputs)
    policy = vlm_engine_policy(tiny_vlm_policy, tiny_vlm_dir)
    completions = policy.generate([good, bad, video], SamplingConfig(temperature=0, max_new_tokens=6))
    assert completions[0].finish_reason != "error" and completions[0].token_ids
    assert completions[1].finish_reason == "error" and "image placeholders" in (completions[1].error or "")
    assert completions[2].finish_reason == "error" and "not videos" in (completions[2].error or "")


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_a_temperature_below_the_greedy_bound_is_greedy_in_both_backends(model, tiny_tokenizer, prompts,
                                                                          temperature):
    """Logits divided by 1e-40 overflow float32 (every one infinite, the softmax NaN): such a temperature
    samples greedily and scores at temperature 1, exactly as 0 does, in each backend."""
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    tiny = SamplingConfig(temperature=temperature, max_new_tokens=12)
    for policy in (HFPolicy(model, tiny_tokenizer), engine_policy(model, tiny_tokenizer)):
        expected = policy.generate(requests(prompts), greedy)
        got = policy.generate(requests(prompts), tiny)
        for a, b in zip(expected, got):
            assert a.token_ids == b.token_ids and a.text == b.text
            # Finite and at temperature 1 (the engine's second call reuses its cached prompt: float noise)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)
