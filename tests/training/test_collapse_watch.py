"""Collapse diagnostics on the tiny model: the cross log-prob matrix against a full forward of every (x_j, z_i)
pair, the metrics of a step against the plain references, how pairs are cut, drawn and laid out, the early stops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.algorithms.test_collapse import ref_information, ref_retrieval, ref_zscore
from tests.training.trainer_runs import config, records, step_records
from turnrl.agent.formats import get_format
from turnrl.rollout.context import EpisodeTokens
from turnrl.rollout.trajectory import Trajectory
from turnrl.training import collapse_watch as collapse_module
from turnrl.training.packed_attention import ATTENTION
from turnrl.training.collapse_watch import (
    FIRST_TURN,
    MULTI_TURN,
    CollapseDiagnostics,
    EarlyStops,
    ReasoningPair,
    columns_by_group,
    cross_logprobs,
    draw_turns,
    episode_pairs,
    reasoning_tokens,
)
from turnrl.training.commands import train
from turnrl.training.train_config import CollapseConfig, TrainConfig
from turnrl.training.ppo import MicroBatching, batched_logprobs
from turnrl.training.seeding import step_seed
from turnrl.training.step_episodes import StepOutput
from turnrl.training.trainer import Trainer

RAGEN = get_format("ragen")
"""The prompt ends with <think> and the model writes the rest (RAGEN's ``ctx_manager``)."""
THINK = get_format("free_think")
"""The model writes its <think> itself: the hand-made responses below."""


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    # The trainer's attention, so that packed passes (algorithm.micro_batch_tokens) run too.
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                attn_implementation=ATTENTION).eval()


def decoder(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def scorer(model, batching: MicroBatching | None = None, temperature=1.0):
    return lambda batch: batched_logprobs(model, batch, batching or MicroBatching(2), temperature)


@torch.no_grad()
def full_forward_logprob(model, prompt: list[int], reasoning: list[int], temperature: float = 1.0) -> float:
    """log p(z | x): one forward of [x | z] alone, full logits, log-softmax, the z tokens summed."""
    ids = torch.tensor([prompt + reasoning])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return float(logprobs[len(prompt) - 1 :].sum())


def reference_matrices(model, pairs, prompts, temperature=1.0):
    """(n, c) per-token and per-sequence cross log-probs, each pair scored alone."""
    sequence = [[full_forward_logprob(model, x.prompt_ids, z.reasoning_ids, temperature) for x in prompts]
                for z in pairs]
    token = [[value / len(z.reasoning_ids) for value in row] for row, z in zip(sequence, pairs)]
    return token, sequence


# --------------------------------------------------------------------------- cutting a response
def test_reasoning_tokens_are_the_sampled_tokens_between_the_think_tags(tiny_tokenizer):
    encode = lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    head, middle = encode("<think>"), encode("The box is left of me, so I push it.")
    ids = head + middle + encode("</think><answer>Left</answer>") + [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert reasoning_tokens(ids, THINK, decoder(tiny_tokenizer)) == (len(head), len(head) + len(middle))
    assert reasoning_tokens(encode("<answer>Left</answer>"), THINK, decoder(tiny_tokenizer)) is None
    assert reasoning_tokens(encode("<think>unfinished"), THINK, decoder(tiny_tokenizer)) is None


def test_the_reasoning_of_a_response_that_continues_the_prompts_think_is_found(tiny_tokenizer):
    # RAGEN's prompt ends with <think>: the sampled response starts inside the reasoning.
    encode = lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    middle = encode("The box is left of me, so I push it.")
    ids = middle + encode("</think><answer>Left</answer>") + [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert reasoning_tokens(ids, RAGEN, decoder(tiny_tokenizer)) == (0, len(middle))
    assert reasoning_tokens(encode("unfinished"), RAGEN, decoder(tiny_tokenizer)) is None
    # The episode's pair: x is the prompt, which ends with <think>; z the sampled reasoning.
    tokens = EpisodeTokens(tiny_tokenizer, response_prefix="<think>")
    tokens.start("Push the box.", "Box left.")
    tokens.add_response(ids)
    trajectory = Trajectory(env_id="Sokoban", seed=0, group=0, sample=0, tokens=tokens)
    (pair,), answered = episode_pairs(trajectory, 0, RAGEN, decoder(tiny_tokenizer))
    assert answered == 1 and pair.reasoning_ids == middle
    assert pair.prompt_ids == tokens.prompt_ids(0) and decoder(tiny_tokenizer)(pair.prompt_ids).endswith("<think>")


def test_tokens_straddling_a_tag_stay_out_of_the_reasoning():
    vocab = {1: "<think", 2: ">I", 3: " go", 4: " left", 5: ".</", 6: "think>", 7: "<answer>Left</answer>"}
    decode = lambda ids: "".join(vocab[i] for i in ids)  # noqa: E731
    # ">I" ends the tag and starts the reasoning: the prompt side takes it; ".</" runs into </think>: left out.
    assert reasoning_tokens([1, 2, 3, 4, 5, 6, 7], THINK, decode) == (2, 4)


# --------------------------------------------------------------------------- the cross log-prob matrix
def pairs_of(tokenizer, prompts: list[str], reasonings: list[str]) -> list[ReasoningPair]:
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return [ReasoningPair(encode(p), encode(r), episode=i, turn=0, group=i)
            for i, (p, r) in enumerate(zip(prompts, reasonings))]


PROMPTS = ["<|im_start|>user\nThe box is left.<|im_end|>\n<|im_start|>assistant\n<think>",
           "<|im_start|>user\nA hole lies below, the goal right of it.<|im_end|>\n<|im_start|>assistant\n<think>",
           "<|im_start|>user\nUp.<|im_end|>\n<|im_start|>assistant\n<think>"]
REASONINGS = ["I push it left.", "Go right, never down into the hole below me.", "Up"]


@pytest.mark.parametrize("batching, temperature, rows_per_call", [
    (MicroBatching(2), 1.0, 256), (MicroBatching(4), 0.7, 4), (MicroBatching(1, tokens=64), 1.0, 5)])
def test_cross_logprobs_equal_a_full_forward_of_every_pair(model, tiny_tokenizer, monkeypatch, batching, temperature,
                                                           rows_per_call):
    monkeypatch.setattr(collapse_module, "ROWS_PER_CALL", rows_per_call)  # a few columns per scorer call
    pairs = pairs_of(tiny_tokenizer, PROMPTS, REASONINGS)
    token, sequence = cross_logprobs(pairs, pairs, scorer(model, batching, temperature), tiny_tokenizer.pad_token_id)
    expected_token, expected_sequence = reference_matrices(model, pairs, pairs, temperature)
    assert token.shape == sequence.shape == (3, 3)
    assert torch.allclose(sequence, torch.tensor(expected_sequence, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(token, torch.tensor(expected_token, dtype=torch.float64), atol=1e-4)


# --------------------------------------------------------------------------- a step's measurement
def episode(tokenizer, group: int, first_user: str, responses: list[str], observations: list[str]) -> Trajectory:
    """An episode as the rollout records it: the token-exact context of its turns."""
    tokens = EpisodeTokens(tokenizer)
    tokens.start("Push the box.", first_user)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for turn, response in enumerate(responses):
        tokens.add_response(encode(response) + [tokenizer.convert_tokens_to_ids("<|im_end|>")])
        if turn < len(observations):
            tokens.add_observation(observations[turn])
    return Trajectory(env_id="Sokoban", seed=group, group=group, sample=0, tokens=tokens)


def rollout(tokenizer) -> list[Trajectory]:
    """Three groups of two episodes; some turns without reasoning, one response with text before <think>."""
    states = ["Box left.", "Box right.", "Box up."]
    answers = ["<think>It is left: push left.</think><answer>Left</answer>",
               "<think>Right it is.</think><answer>Right</answer>",
               "<think>Up, then up again.</think><answer>Up</answer>",
               "<answer>Down</answer>"]
    return [
        episode(tokenizer, 0, states[0], [answers[0], answers[1]], ["Box up."]),
        episode(tokenizer, 0, states[0], [answers[1], answers[3]], ["Box left."]),
        episode(tokenizer, 1, states[1], [answers[3], answers[2]], ["Box up."]),
        episode(tokenizer, 1, states[1], ["So <think>Right it is.</think><answer>Right</answer>"], []),
        episode(tokenizer, 2, states[2], [answers[2], answers[0], answers[1]], ["Box left.", "Box right."]),
        episode(tokenizer, 2, states[2], [answers[2]], []),
    ]


def check(found: dict[str, float], prefix: str, token, sequence, columns, classes) -> None:
    """Every metric of a kind against the plain loops on the matrices of pairs scored one by one (a first
    measurement: no moving average of the std yet)."""
    expected = {**ref_information(token, columns), **ref_retrieval(token, columns, classes),
                **ref_zscore(token, columns, 1e-3, None)}
    expected.update({f"{k}_seq": v for k, v in ref_information(sequence, columns).items() if k != "mi_upper_bound"})
    expected.update({f"{k}_seq": v for k, v in ref_zscore(sequence, columns, 1e-3, None).items()})
    assert len(expected) == 31  # with the moving averages, the first one the std itself
    for name, value in expected.items():
        assert found[f"{prefix}/{name}"] == pytest.approx(value, rel=1e-4, abs=2e-4), name


def test_a_steps_metrics_equal_the_reference_on_pairs_scored_one_by_one(model, tiny_tokenizer):
    decode = decoder(tiny_tokenizer)
    trajectories = rollout(tiny_tokenizer)
    config = CollapseConfig(every=1, samples=0)
    diagnostics = CollapseDiagnostics(config, THINK, decode, tiny_tokenizer.pad_token_id, seed=3)
    found = diagnostics.measure(4, trajectories, scorer(model))

    pairs = [episode_pairs(t, i, THINK, decode)[0] for i, t in enumerate(trajectories)]
    assert [len(p) for p in pairs] == [2, 1, 1, 1, 3, 1]
    second = pairs[0][1]  # x: the turn's whole context (the first response in it) up to <think>; z: inside
    assert decode(second.prompt_ids) == decode(trajectories[0].tokens.prompt_ids(1)) + "<think>"
    assert "<think>It is left: push left.</think><answer>Left</answer><|im_end|>" in decode(second.prompt_ids)
    assert decode(second.reasoning_ids) == "Right it is." and (second.episode, second.turn, second.group) == (0, 1, 0)
    assert decode(pairs[3][0].prompt_ids).endswith("<|im_start|>assistant\nSo <think>")
    assert found["collapse/valid_thinking_rate"] == pytest.approx(9 / 11)
    assert found["collapse/first_turn_pairs_total"] == 6 and found["collapse/first_turn_pairs_valid"] == 5

    # First turns: one column per group's prompt (group 1's is the one with "So " before <think>).
    first = [p[0] for p in pairs if p and p[0].turn == 0]
    prompts = [first[0], first[2], first[3]]
    token, sequence = reference_matrices(model, first, prompts)
    assert found["collapse/first_turn/prompts"] == 3 and found["collapse/first_turn/pairs"] == 5
    check(found, f"collapse/{FIRST_TURN}", token, sequence, [0, 0, 1, 2, 2], [0, 1, 2])

    # All turns: the same draws as the step's (its seed), each pair its own column, equal prompts one class.
    generator = torch.Generator().manual_seed(step_seed(3, 4))
    drawn = draw_turns(pairs, 0, generator)
    token, sequence = reference_matrices(model, drawn, drawn)
    keys: dict = {}
    classes = [keys.setdefault(tuple(p.prompt_ids), len(keys)) for p in drawn]
    check(found, f"collapse/{MULTI_TURN}", token, sequence, list(range(len(drawn))), classes)
    assert found[f"collapse/{MULTI_TURN}/marginal_std_ema"] == found[f"collapse/{MULTI_TURN}/marginal_std"]

    again = diagnostics.measure(5, trajectories, scorer(model))  # the moving average moves
    first_std = found[f"collapse/{FIRST_TURN}/marginal_std"]
    assert again[f"collapse/{FIRST_TURN}/marginal_std_ema"] == pytest.approx(
        0.9 * first_std + 0.1 * again[f"collapse/{FIRST_TURN}/marginal_std"])
    resumed = CollapseDiagnostics(config, THINK, decode, tiny_tokenizer.pad_token_id, seed=3)
    resumed.resume([found])
    assert resumed.ema_std == {f"{kind}/{name}": found[f"collapse/{kind}/{name.replace('std', 'std_ema')}"]
                               for kind in (FIRST_TURN, MULTI_TURN) for name in ("marginal_std", "marginal_std_seq")}


def test_a_rollout_without_reasoning_reports_only_its_rate(model, tiny_tokenizer):
    trajectories = [episode(tiny_tokenizer, g, f"State {g}.", ["<answer>Up</answer>"], []) for g in range(3)]
    diagnostics = CollapseDiagnostics(CollapseConfig(every=1), THINK, decoder(tiny_tokenizer),
                                      tiny_tokenizer.pad_token_id, seed=0)
    found = diagnostics.measure(0, trajectories, scorer(model))
    assert found["collapse/valid_thinking_rate"] == 0.0 and found["collapse/first_turn_valid_rate"] == 0.0
    assert not any(key.startswith(("collapse/first_turn/", "collapse/multi_turn/")) for key in found)


def test_measurements_run_at_the_first_step_and_every_n_steps():
    diagnostics = CollapseDiagnostics(CollapseConfig(every=5), RAGEN, str, 0, seed=0)
    assert [step for step in range(20) if diagnostics.due(step)] == [0, 4, 9, 14, 19]  # RAGEN's steps 1, 5, 10, ...
    assert not any(CollapseDiagnostics(CollapseConfig(), RAGEN, str, 0, seed=0).due(s) for s in range(20))


# --------------------------------------------------------------------------- drawing and columns
def fake_pairs(counts: list[int]) -> list[list[ReasoningPair]]:
    return [[ReasoningPair([e, t], [1], episode=e, turn=t, group=e) for t in range(n)] for e, n in enumerate(counts)]


def test_turns_are_drawn_uniformly_over_episodes_then_over_their_turns():
    pairs = fake_pairs([1, 3, 0, 0])  # two episodes without reasoning: their draws are dropped
    by_episode: Counter[int] = Counter()
    by_turn: Counter[int] = Counter()
    generator = torch.Generator().manual_seed(0)
    for _ in range(2000):
        drawn = draw_turns(pairs, 64, generator)  # min(64, 4 pairs) = 4 draws
        by_episode.update(p.episode for p in drawn)
        by_turn.update(p.turn for p in drawn if p.episode == 1)
    assert sum(by_episode.values()) == pytest.approx(2000 * 4 / 2, rel=0.05)
    assert by_episode[0] == pytest.approx(by_episode[1], rel=0.1)
    assert all(count == pytest.approx(by_episode[1] / 3, rel=0.15) for count in by_turn.values())


def test_a_group_is_one_column_unless_its_prompts_differ():
    pairs = [ReasoningPair([1, 2], [5], 0, 0, group=7), ReasoningPair([1, 2], [6], 1, 0, group=7),
             ReasoningPair([1, 3], [5], 2, 0, group=7), ReasoningPair([1, 2], [5], 3, 0, group=8)]
    columns = columns_by_group(pairs)
    assert columns.of_pair.tolist() == [0, 0, 1, 2]
    assert columns.classes.tolist() == [0, 1, 0]  # group 8 asks what group 7 asked first: the same prompt
    image = {"pixel_values": torch.ones(2, 3)}
    assert ReasoningPair([1], [2], 0, 0, 0, image).prompt_key() != ReasoningPair([1], [2], 0, 0, 0).prompt_key()


# --------------------------------------------------------------------------- early stops
def step(spread: float = 1.0, skipped: bool = False, success: float | None = None) -> dict[str, float]:
    metrics = {"rollout/in_group_reward_std": spread, "filter/skipped_step": float(skipped)}
    if success is not None:
        metrics["val/success"] = success
    return metrics


def run_until_stop(stops: EarlyStops, steps: list[dict[str, float]]) -> tuple[int, str] | None:
    for index, metrics in enumerate(steps):
        stop = stops.observe(metrics)
        if stop is not None:
            assert metrics[f"early_stop/{stop.rule}"] == 1.0
            return index + 1, stop.rule
    return None


def test_reward_spread_collapse_stops_ten_training_steps_below_a_tenth_of_the_baseline():
    config = CollapseConfig(stop_on_reward_spread=True)
    steps = [step(1.0)] * 10 + [step(0.05)] * 5 + [step(0.0, skipped=True)] + [step(0.05)] * 5
    assert run_until_stop(EarlyStops(config), steps) == (21, "reward_spread_collapse")  # the empty step not counted
    metrics = step(0.05)
    stops = EarlyStops(config, history=steps[:12])
    stops.observe(metrics)
    assert metrics["collapse/reward_spread_baseline"] == 1.0 and metrics["collapse/reward_spread_threshold"] == 0.1
    assert run_until_stop(EarlyStops(CollapseConfig(every=5)), steps) is None  # watched, not a stop


def test_low_validation_success_stops_after_five_validations_under_one_percent():
    config = CollapseConfig(stop_on_low_success=True)
    steps = [step(success=0.0 if i != 3 else 0.5) if i % 2 else step() for i in range(20)]
    # Validations at steps 2, 4 (0.5: resets), 6, 8, 10, 12, 14: the fifth low one in a row is at step 14.
    assert run_until_stop(EarlyStops(config), steps) == (14, "low_validation_success")


def test_empty_filter_steps_stop_the_run_and_a_resumed_run_remembers_them():
    config = CollapseConfig(stop_after_empty_steps=3)
    steps = [step(skipped=True)] * 2 + [step()] + [step(skipped=True)] * 3
    assert run_until_stop(EarlyStops(config), steps) == (6, "empty_filter_steps")
    resumed = EarlyStops(config, history=steps[:5])
    assert resumed.fired is None and resumed.stopped_before is None
    assert run_until_stop(resumed, steps[5:]) == (1, "empty_filter_steps")
    ended = EarlyStops(config, history=steps)  # resumed from the checkpoint the stop saved: the run had ended there
    assert ended.fired is None and ended.stopped_before is not None and ended.stopped_before.rule == "empty_filter_steps"
    assert resumed.summary(6) == {"stopped_by": "early_stop", "early_stop": {
        "rule": "empty_filter_steps", "reason": "the group filter kept nothing to train on for 3 steps in a row",
        "step": 6}}


def test_early_stops_stay_quiet_when_nothing_is_turned_on():
    stops, metrics = EarlyStops(CollapseConfig()), step(0.0, skipped=True, success=0.0)
    assert all(stops.observe(metrics) is None for _ in range(30))
    assert set(metrics) == {"rollout/in_group_reward_std", "filter/skipped_step", "val/success"}
    assert EarlyStops(CollapseConfig()).summary(3) == {}



# --------------------------------------------------------------------------- in a run
def test_the_trainer_scores_pairs_with_its_actor_before_the_update(model, tiny_model_dir, tmp_path):
    trainer = Trainer(config(tiny_model_dir, tmp_path, "agent.format=free_think", "collapse.every=2",
                             "collapse.samples=0", "algorithm.micro_batch_size=3"))
    assert [s for s in range(6) if trainer.collapse.due(s)] == [0, 1, 3, 5]
    trajectories = rollout(trainer.tokenizer)
    output = StepOutput({"rollout/success": 0.0}, trajectories)
    trainer.measure_collapse(3, output)
    plain = CollapseDiagnostics(CollapseConfig(every=2, samples=0), THINK, decoder(trainer.tokenizer),
                                trainer.tokenizer.pad_token_id, seed=trainer.config.seeds.seed)
    expected = plain.measure(3, trajectories, scorer(model))
    assert expected.keys() == output.metrics.keys() - {"rollout/success"}
    for key, value in expected.items():
        if not key.startswith("timing/"):
            assert output.metrics[key] == pytest.approx(value, abs=1e-4), key
    assert trainer.timings["collapse_s"] == output.metrics["timing/collapse_s"]
    trainer.close()


@pytest.mark.parametrize("trainer", [[], ["distributed.async_rollout=true", "distributed.max_staleness=0"]],
                         ids=["synchronous", "asynchronous"])
def test_a_run_logs_collapse_metrics_at_the_measured_steps(tiny_model_dir, tmp_path, trainer):
    train(config(tiny_model_dir, tmp_path, "agent.format=ragen", "collapse.every=2", "run.steps=3", *trainer))
    steps = step_records(tmp_path / "run")
    # The untrained model writes no <think>: the rate is measured, there is no pair to score.
    assert [s for s, r in steps.items() if "collapse/valid_thinking_rate" in r] == [1, 2]
    assert all(r.get("collapse/valid_thinking_rate", 0.0) == 0.0 and "collapse/empty_filter_steps" in r
               for r in steps.values())


def assert_stopped_early(run: Path, console: str, step: int, rule: str, reason: str) -> None:
    """The run ended after ``step`` as a finished one, and says why in the console, the summary, the metrics and
    the report: validated after its last step, its checkpoint saved, no step past it."""
    said = f"early stop after step {step}: {reason}"
    assert said in " ".join(console.split()), console[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == step and summary["stopped_by"] == "early_stop"
    assert summary["early_stop"] == {"rule": rule, "step": step, "reason": reason}
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"step_{step:06d}"
    assert (checkpoints / f"step_{step:06d}" / "actor").is_dir()
    logged = records(run)
    assert [r["step"] for r in logged if f"early_stop/{rule}" in r] == [step]
    assert max(r["step"] for r in logged) == step
    assert logged[-1]["step"] == step and "val/success" in logged[-1]  # validated after the last step run
    assert f"after step {step}: {reason}" in (run / "report.html").read_text()


def test_empty_filter_steps_end_the_run_with_validation_a_checkpoint_the_summary_and_the_report(tiny_model_dir,
                                                                                              tmp_path, capsys):
    # The untrained model never writes an action: every group's rewards are equal, and the filter drops them all.
    empty = ["algorithm.filter.drop_zero_variance=true", "collapse.stop_after_empty_steps=3"]
    summary = train(config(tiny_model_dir, tmp_path, *empty, "run.steps=2"))
    assert summary["steps"] == 2 and "early_stop" not in summary  # 2 empty steps: not yet
    assert "early stop" not in capsys.readouterr().out
    run = tmp_path / "run"
    summary = train(config(tiny_model_dir, tmp_path, *empty, "run.steps=6", f"resume={run}"))
    # The resumed run remembers its 2 empty steps: the third stops it.
    assert summary["steps"] == 3 and summary["early_stop"]["rule"] == "empty_filter_steps"
    assert_stopped_early(run, capsys.readouterr().out, 3, "empty_filter_steps",
                         "the group filter kept nothing to train on for 3 steps in a row")
    assert [r["collapse/empty_filter_steps"] for r in records(run) if "filter/skipped_step" in r] == [1, 2, 3]
    # Resumed again (as after a kill between the stop's checkpoint and its summary): it ends where it ended.
    (run / "summary.json").unlink()
    summary = train(config(tiny_model_dir, tmp_path, *empty, "run.steps=6", f"resume={run}"))
    assert summary["steps"] == 3 and summary["early_stop"] == {
        "rule": "empty_filter_steps", "reason": "the group filter kept nothing to train on for 3 steps in a row",
        "step": 3}
    assert "early stop after step 3 (before this resume)" in capsys.readouterr().out
    assert max(r["step"] for r in records(run)) == 3 and json.loads((run / "summary.json").read_text()) == summary


def varied_reward(turns: list, until_seed: int) -> list[float]:
    """A reward that differs between the samples of a group (a function of the sampled text) on env seeds below
    ``until_seed``, and is 0 on the others: a spread that collapses once the steps reach those seeds."""
    return [zlib.crc32(turn.response.encode()) % 4 / 3 if turn.seed < until_seed else 0.0 for turn in turns]


def test_reward_spread_collapse_ends_the_run_and_says_why(tiny_model_dir, tmp_path, capsys):
    # RAGEN's rule as configured by default: the first 10 steps (2 groups a step: seeds 10000-10019) have a
    # spread, the next 10 none; the 10th step below 0.1x the baseline, step 20, stops the run.
    spread = ["rewards.extra=[{name: varied, fn: 'tests.training.test_collapse_watch:varied_reward', "
              "settings: {until_seed: 10020}}]", "seeds.train_start=10000", "collapse.stop_on_reward_spread=true",
              "run.steps=30", "run.trajectories_every=0", "validation.episodes=1", "sampling.max_new_tokens=4"]
    summary = train(config(tiny_model_dir, tmp_path, *spread))
    run = tmp_path / "run"
    steps = step_records(run)
    spreads = [steps[s]["rollout/in_group_reward_std"] for s in sorted(steps)]
    baseline = sum(spreads[:10]) / 10
    assert baseline > 0 and spreads[10:] == [0.0] * 10
    assert steps[11]["collapse/reward_spread_baseline"] == pytest.approx(baseline)
    assert steps[11]["collapse/reward_spread_threshold"] == pytest.approx(0.1 * baseline)
    assert summary["early_stop"]["rule"] == "reward_spread_collapse"
    assert_stopped_early(run, capsys.readouterr().out, 20, "reward_spread_collapse",
                         f"the in-group reward std stayed below 0.1 x its baseline {baseline:.4g} (the mean of the "
                         "first 10 training steps) for 10 training steps in a row")


def test_low_validation_success_ends_the_run_and_says_why(tiny_model_dir, tmp_path, capsys):
    # RAGEN's rule as configured by default (5 validations under 0.01). The untrained model never reaches the
    # goal: the validations after steps 1 to 5 all fail, and the fifth stops the run.
    low = ["validation.every=1", "collapse.stop_on_low_success=true", "run.steps=8", "run.trajectories_every=0",
           "sampling.max_new_tokens=4"]
    summary = train(config(tiny_model_dir, tmp_path, *low))
    run = tmp_path / "run"
    assert summary["early_stop"]["rule"] == "low_validation_success"
    counts = [r["collapse/low_success_validations"] for r in records(run) if "filter/skipped_step" in r]
    assert counts == [1, 2, 3, 4, 5]
    assert_stopped_early(run, capsys.readouterr().out, 5, "low_validation_success",
                         "validation success stayed below 0.01 for 5 validations in a row")


FSDP_SCRIPT = """
import json, sys
import torch
from turnrl.config import load_config
from turnrl.training import ranks
from turnrl.training.train_config import TrainConfig
from turnrl.training.step_episodes import StepOutput
from turnrl.training.trainer import Trainer
from tests.training.test_collapse_watch import rollout

torch.set_num_threads(1)
config = load_config(TrainConfig, None, sys.argv[2:])
ranks.init_process_group("cpu", 120)
trainer = Trainer(config)  # under torchrun: FSDP2 and sharded rollouts
output = StepOutput({}, rollout(trainer.tokenizer))
trainer.measure_collapse(0, output)
if ranks.is_main():
    open(sys.argv[1], "w").write(json.dumps(output.metrics))
trainer.close()
ranks.close_process_group()
ranks.end_process(0)  # as a run's processes leave: gloo's threads can abort an interpreter's teardown
"""


@pytest.mark.slow
def test_two_fsdp_processes_score_the_pairs_as_one_process(model, tiny_model_dir, tmp_path):
    """Each process scores its rows of the cross batch with the sharded actor; the gathered matrix gives the
    single process's metrics."""
    overrides = [f"model.path={tiny_model_dir}", "model.device=cpu", "model.dtype=float32", "run.tensorboard=false",
                 f"run.output_dir={tmp_path}", "run.name=fsdp", "agent.format=ragen", "collapse.every=1",
                 "collapse.samples=0", "algorithm.micro_batch_size=2"]
    script, out = tmp_path / "fsdp_collapse.py", tmp_path / "metrics.json"
    script.write_text(FSDP_SCRIPT)
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(out)]
    done = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = CollapseDiagnostics(CollapseConfig(every=1, samples=0), RAGEN, decoder(tokenizer), tokenizer.pad_token_id,
                                seed=TrainConfig().seeds.seed)
    expected = plain.measure(0, rollout(tokenizer), scorer(model))
    assert found.keys() == expected.keys() and any(key.startswith("collapse/multi_turn/") for key in found)
    for key, value in expected.items():
        if not key.startswith("timing/"):
            assert found[key] == pytest.approx(value, abs=1e-4), key

