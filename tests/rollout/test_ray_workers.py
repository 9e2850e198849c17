"""Rollout workers on Ray: the same greedy trajectories as in process, weights that follow the trainer's, and a
dead worker that stops the batch with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, ModelConfig, SamplingConfig
from turnrl.engine.weights import model_checksum
from turnrl.envs import make
from turnrl.envs.seeds import SeedSplits
from turnrl.models.loading import load_model
from turnrl.policy.hf import HFPolicy
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.ray_workers import (
    EnvSpec,
    RayRollout,
    RolloutHost,
    RolloutWorkerError,
    WorkerRewardMetrics,
    WorkerSpec,
    model_files,
    policy_weights,
    split_groups,
)
from turnrl.rollout.runner import EpisodeSlot, Rollout

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
AGENT = AgentConfig(format="free_think", max_turns=2, max_actions_per_episode=4)
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12)
RAY_BUDGET_S = 600.0
"""How long a worker may take to start or answer before the test fails: a guard against a hang, met by a CI
machine whose cores other jobs hold (two workers loading torch on two busy cores took over 120 s)."""


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    """The trainer's model (changed by a test: module scope, not the session's shared policy)."""
    return load_model(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def workers(cluster, tiny_model_dir, tiny_tokenizer):
    spec = WorkerSpec(model_files(tiny_model_dir), ModelConfig(device="cpu", dtype="float32"), AGENT,
                      EnvSpec("Sokoban"), max_batch_size=8, torch_threads=1)
    rollout = RayRollout(spec, workers=2, tokenizer=tiny_tokenizer, timeout_s=RAY_BUDGET_S)
    yield rollout
    rollout.close()


def slots(step: int) -> list[EpisodeSlot]:
    return EnvGroups(lambda: make("Sokoban"), n_groups=3, group_size=2, seeds=SeedSplits()).train_slots(step)


def in_process(model, tokenizer, batch: list[EpisodeSlot]):
    fmt = get_format(AGENT.format)
    return Rollout(HFPolicy(model, tokenizer, max_batch_size=8), fmt, AGENT, "Sokoban").run(batch, GREEDY)


def same(a, b) -> None:
    assert (a.seed, a.group, a.sample, a.status, a.error, a.system_prompt) == (
        b.seed, b.group, b.sample, b.status, b.error, b.system_prompt)
    assert [(t.observation, t.response, t.response_ids, t.actions, t.reward) for t in a.turns] == [
        (t.observation, t.response, t.response_ids, t.actions, t.reward) for t in b.turns]
    for x, y in zip(a.turns, b.turns):
        assert x.response_logprobs == pytest.approx(y.response_logprobs, abs=1e-4)
    assert a.tokens.stream().input_ids == b.tokens.stream().input_ids  # the driver reads the worker's contexts


@pytest.mark.slow  # the same path runs in tests/training/backends/test_ray_rollout.py's Ray run
def test_workers_play_the_greedy_trajectories_of_the_same_policy_in_process_and_follow_new_weights(
        workers, actor, tiny_tokenizer):
    assert workers.set_weights(actor, version=0) and not workers.set_weights(actor, version=0)
    batch = slots(0)
    there = workers.run(batch, GREEDY)
    here = in_process(actor, tiny_tokenizer, batch)
    assert [t.group for t in there] == [0, 0, 1, 1, 2, 2]
    for a, b in zip(there, here):
        same(a, b)
    assert [len(r.trajectories) for r in workers.last_results] == [4, 2]  # whole groups per worker
    assert workers.timings.generate_s > 0

    # An update changes the weights: the workers play what the changed policy plays, not the old one.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in actor.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    assert workers.set_weights(actor, version=1)
    changed = workers.run(batch, GREEDY)
    for a, b in zip(changed, in_process(actor, tiny_tokenizer, batch)):
        same(a, b)
    assert [t.turns[0].response_ids for t in changed] != [t.turns[0].response_ids for t in there]


def test_a_killed_worker_raises_a_rollout_worker_error_naming_it(workers, actor):
    workers.set_weights(actor, version=100)
    ray.kill(workers.workers[1])
    # "died", not "did not finish within": found dead at once, not after the wait's budget ran out.
    with pytest.raises(RolloutWorkerError, match="rollout worker 1 .* died during run.*resume") as error:
        workers.run(slots(1), GREEDY)
    assert error.value.worker == 1


def test_slots_split_by_whole_groups_in_order():
    make_slots = lambda groups: [EpisodeSlot(None, 0, group=g) for g in groups]  # noqa: E731
    assert split_groups(make_slots([0, 0, 1, 1, 2, 2]), 2) == [[0, 1, 2, 3], [4, 5]]
    assert split_groups(make_slots([0, 0, 1, 1, 2, 2, 3, 3]), 3) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert split_groups(make_slots([5]), 3) == [[0], [], []]


def test_reward_metrics_are_the_mean_over_the_workers_that_report_them():
    metrics = WorkerRewardMetrics([{"judge/calls": 2.0, "state/match": 1.0}, {"judge/calls": 4.0}]).metrics()
    assert metrics == {"judge/calls": 3.0, "state/match": 1.0}


def test_lora_weights_travel_merged_as_the_plain_model_holds_them(tiny_model_dir):
    peft = pytest.importorskip("peft")
    model = load_model(tiny_model_dir)
    plain = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    weights = policy_weights(lora)
    assert set(weights) == set(plain)
    changed = [name for name in plain if not torch.equal(weights[name], plain[name])]
    assert changed and all("q_proj" in name for name in changed)
    lora.merge_adapter()  # peft's merge in place: the adapters now live in the base weights
    assert all(torch.equal(tensor, policy_weights(lora)[name])
               for name, tensor in weights.items() if "q_proj" not in name)
    assert all(torch.allclose(tensor, policy_weights(lora)[name]) for name, tensor in weights.items())  # not twice
    merged = lora.merge_and_unload()
    assert all(torch.allclose(weights[name], tensor) for name, tensor in merged.state_dict().items())


def test_a_worker_answers_new_weights_with_the_checksum_of_what_it_computes_with(tiny_model_dir):
    """In process (the body of the Ray actor): the checksum a worker returns is the trainer's actor's, LoRA
    adapters merged, and weights sent without their adapters (LoRA that never reaches the rollout) do not agree."""
    peft = pytest.importorskip("peft")
    host = RolloutHost(WorkerSpec(model_files(tiny_model_dir), ModelConfig(device="cpu", dtype="float32",
                                                                           backend="engine"),
                                  AGENT, EnvSpec("Sokoban"), max_batch_size=4, torch_threads=1))
    lora = peft.get_peft_model(load_model(tiny_model_dir), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                           init_lora_weights=False))
    taken = host.set_weights(3, policy_weights(lora))
    assert taken is not None and taken.agrees(model_checksum(lora, torch.float32))
    assert host.rollout.policy.weights_version == 3  # the worker's turns record it
    without_adapters = host.set_weights(4, policy_weights(load_model(tiny_model_dir)))  # the base alone
    assert without_adapters is not None and not without_adapters.agrees(model_checksum(lora, torch.float32))


def test_a_workers_vision_tower_is_prepared_as_a_loaded_ones(tiny_vlm_dir):
    """A rollout worker (or pool process) builds its model from the config, not through ``load_model``: its vision
    tower must still attend through the chunked kernels (flash, efficient or math, never cuDNN's planning per
    shape) rather than transformers' call per image."""
    from turnrl.models.loading import vision_tower
    from turnrl.models.vision_attention import VISION_ATTENTION
    from turnrl.rollout.ray_workers import build_model

    built = build_model(tiny_vlm_dir, True, torch.float32, torch.device("cpu"))
    assert vision_tower(built).config._attn_implementation == VISION_ATTENTION
    assert vision_tower(load_model(tiny_vlm_dir)).config._attn_implementation == VISION_ATTENTION
