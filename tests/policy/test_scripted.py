"""Scripted policies: the expert (env solver) and uniform random actions, in every reasoning format."""

from __future__ import annotations

import copy
import re
from collections import Counter

import numpy as np
import pytest

from turnrl.agent.formats import format_names, get_format
from turnrl.config import SamplingConfig
from turnrl.envs import make
from turnrl.envs.catalog import env_names
from turnrl.policy.interface import GenerationRequest
from turnrl.policy.scripted import RANDOM_REASON, ExpertPolicy, RandomPolicy

# The visgym_tuple format carries one tuple literal, e.g. ('move', 0); a free-form Countdown
# equation, a pick(x,y,z) skill, an SVG document, a Spatial action sequence or a Sudoku placement has no such
# spelling, so those pairings cannot work.
NO_TUPLE_SPELLING = ("Countdown", "PrimitiveSkill", "SVG", "Spatial", "Sudoku")
PAIRS = [
    (env, fmt)
    for env in env_names()
    for fmt in format_names()
    if not (env in NO_TUPLE_SPELLING and fmt == "visgym_tuple")
]
SEPARATOR = {"PrimitiveSkill": "|", "Sudoku": "||"}
"""Envs whose actions hold the default separator: PrimitiveSkill's pick(x,y,z) holds commas (VAGEN uses |); and
free-form envs with several actions a turn, whose answers are split only on a separator given explicitly (Sudoku's
recipe gives RAGEN's ||)."""


def respond(policy, env) -> str:
    """The assistant message of the policy's response: the format's response prefix (which the prompt ends with),
    then the response."""
    (completion,) = policy.generate([GenerationRequest(prompt_ids=None, messages=[], env=env)], SamplingConfig())
    assert completion.finish_reason == "stop", completion.error
    assert completion.token_ids == [] and completion.logprobs == []
    return policy.fmt.assistant_text(completion.text)


@pytest.mark.parametrize("policy_class", [ExpertPolicy, RandomPolicy])
def test_a_response_continues_the_prompts_response_prefix_without_repeating_it(policy_class):
    # RAGEN's prompt ends with <think> (ctx_manager.py): the response starts inside the reasoning.
    fmt = get_format("ragen", max_actions_per_turn=2)
    env = make("Sokoban")
    env.reset(seed=8)
    policy = policy_class(fmt, max_actions_per_turn=2)
    (completion,) = policy.generate([GenerationRequest(prompt_ids=None, messages=[], env=env)], SamplingConfig())
    assert fmt.response_prefix == "<think>" and "<think>" not in completion.text
    parsed = fmt.parse("<think>" + completion.text, env.action_names())
    assert parsed.format_ok and parsed.actions
    assert policy.continues_response_prefix


def limit_of(fmt, env=None) -> int:
    """Actions in one expert response: a free-form answer is one action unless the separator was given."""
    free_form = env is not None and env.action_names() is None and not fmt.split_free_form
    return fmt.max_actions_per_turn if fmt.separator and not free_form else 1


@pytest.mark.parametrize(("env_name", "fmt_name"), PAIRS)
def test_expert_response_parses_to_the_solver_plan_in_every_format(env_name, fmt_name):
    fmt = get_format(fmt_name, max_actions_per_turn=3, action_separator=SEPARATOR.get(env_name))
    env = make(env_name)
    env.reset(seed=11)
    plan = env.solve()
    text = respond(ExpertPolicy(fmt, max_actions_per_turn=3), env)
    parsed = fmt.parse(text, env.action_names())
    assert parsed.format_ok, parsed.errors
    assert parsed.errors == ()
    assert list(parsed.actions) == plan[: limit_of(fmt, env)]


def test_free_form_plans_go_one_action_a_turn_unless_the_separator_is_given():
    # Spatial's plan is several action sequences, each holding commas: one per response by default, and RAGEN's
    # "A || B" when the separator is given explicitly.
    env = make("Spatial")
    env.reset(seed=2)
    plan = env.solve()
    for name in ("free_think", "ragen"):
        fmt = get_format(name, max_actions_per_turn=3)
        parsed = fmt.parse(respond(ExpertPolicy(fmt, max_actions_per_turn=3), env), env.action_names())
        assert parsed.format_ok and list(parsed.actions) == plan[:1]
    fmt = get_format("ragen", max_actions_per_turn=3, action_separator="||")
    text = respond(ExpertPolicy(fmt, max_actions_per_turn=3), env)
    assert "<answer>Actions: [Observe()] || Actions: [Rotate(90), Observe()] || " in text
    assert list(fmt.parse(text, env.action_names()).actions) == plan[:3]


@pytest.mark.parametrize("fmt_name", ["grounding", "worldmodeling", "grounding_worldmodeling", "visgym_tuple"])
def test_expert_reasoning_fields_come_from_state_facts(fmt_name):
    fmt = get_format(fmt_name, max_actions_per_turn=2)
    env = make("Sokoban")
    env.reset(seed=4)
    before = env.state_facts().describe()
    plan = env.solve()
    actions = plan[: limit_of(fmt)]
    after_env = copy.deepcopy(env)
    for action in actions:
        after_env.step(action)
    after = after_env.state_facts().describe()
    assert before and after and before != after

    fields = fmt.parse(respond(ExpertPolicy(fmt, max_actions_per_turn=2), env), env.action_names()).fields
    if "observation" in fmt.tag_names:
        assert fields["observation"] == before
    if "prediction" in fmt.tag_names:
        assert fields["prediction"] == after
    reasoning = fields.get("reasoning") or fields.get("justification")
    assert ", ".join(actions) in reasoning
    # Predicting works on a copy: the env the expert looked at did not move.
    assert env.state_facts().describe() == before


def test_expert_solves_an_episode_turn_by_turn():
    fmt = get_format("ragen", max_actions_per_turn=2)
    policy = ExpertPolicy(fmt, max_actions_per_turn=2)
    env = make("Sokoban")
    env.reset(seed=8)
    for _ in range(50):
        actions = fmt.parse(respond(policy, env), env.action_names()).actions
        assert 1 <= len(actions) <= 2
        for action in actions:
            _, _, terminated, _, info = env.step(action)
            if terminated:
                break
        if terminated:
            break
    assert info["success"]


def test_random_action_share_replaces_that_share_of_expert_actions():
    fmt = get_format("no_think")
    env = make("FrozenLake")
    env.reset(seed=3)
    names = env.action_names()
    best = env.solve()[0]
    n = 4000
    counts = {}
    for share in (0.0, 0.4, 1.0):
        policy = ExpertPolicy(fmt, seed=5, random_action_share=share)
        actions = [fmt.parse(respond(policy, env), names).actions[0] for _ in range(n)]
        counts[share] = Counter(actions)
    assert counts[0.0] == Counter({best: n})
    # A replaced action is uniform over the names, so it differs from the expert's with prob 3/4.
    off = n - counts[0.4][best]
    expected = 0.4 * (1 - 1 / len(names))
    assert abs(off / n - expected) < 4 * np.sqrt(expected * (1 - expected) / n)
    assert set(counts[1.0]) == set(names)
    for name in names:
        assert abs(counts[1.0][name] / n - 1 / len(names)) < 0.03


def test_the_experts_completion_names_the_solvers_action_whatever_it_played():
    fmt = get_format("no_think")
    env = make("FrozenLake")
    env.reset(seed=3)
    best = env.solve()[:1]
    policy = ExpertPolicy(fmt, seed=5, random_action_share=1.0)
    request = GenerationRequest(prompt_ids=None, messages=[], env=env)
    completions = [policy.generate([request], SamplingConfig())[0] for _ in range(200)]
    played = {fmt.parse(fmt.assistant_text(c.text), env.action_names()).actions[0] for c in completions}
    assert played == set(env.action_names())  # every action played at share 1
    assert all(c.expert_actions == best for c in completions)
    # The plain response draws the same random numbers: the completion is the same answer.
    assert respond(ExpertPolicy(fmt, seed=5, random_action_share=0.5), env) == fmt.assistant_text(
        ExpertPolicy(fmt, seed=5, random_action_share=0.5).generate([request], SamplingConfig())[0].text)


def test_a_random_action_of_a_noisy_demo_is_not_called_the_shortest_way():
    """At 45% random actions, the demos' reasoning called every random action the start of the shortest way:
    SFT taught a true description of the state beside a false plan."""
    fmt = get_format("free_think")
    env = make("FrozenLake")
    env.reset(seed=2)
    (best,) = env.solve()[:1]
    policy = ExpertPolicy(fmt, seed=5, random_action_share=1.0)
    for _ in range(40):
        parsed = fmt.parse(respond(policy, env), env.action_names())
        (action,) = parsed.actions
        think = parsed.fields["think"]
        assert (f"The shortest way to the goal starts with {action}." in think) == (action == best), think
        assert action == best or f"I try {action}." in think


def test_the_expert_names_no_solvers_action_where_the_solver_has_none():
    env = make("FrozenLake")
    env.reset(seed=3)
    env.solve = lambda: None  # a state the solver has no plan for: a random action stands in
    (completion,) = ExpertPolicy(get_format("no_think")).generate(
        [GenerationRequest(None, [], env=env)], SamplingConfig())
    assert completion.finish_reason == "stop", completion.error
    assert completion.text and completion.expert_actions == []


def test_random_action_share_outside_unit_interval_is_refused():
    with pytest.raises(ValueError, match="random_action_share"):
        ExpertPolicy(get_format("no_think"), random_action_share=1.5)


def test_random_policy_writes_between_one_and_max_actions_uniformly():
    fmt = get_format("ragen", max_actions_per_turn=3)
    env = make("Sokoban")
    env.reset(seed=0)
    policy = RandomPolicy(fmt, max_actions_per_turn=3, seed=1)
    parsed = [fmt.parse(respond(policy, env), env.action_names()) for _ in range(3000)]
    assert all(p.format_ok for p in parsed)
    lengths = Counter(len(p.actions) for p in parsed)
    assert set(lengths) == {1, 2, 3}
    assert all(abs(lengths[k] / 3000 - 1 / 3) < 0.04 for k in (1, 2, 3))
    names = Counter(a for p in parsed for a in p.actions)
    total = sum(names.values())
    assert set(names) == set(env.action_names())
    assert all(abs(names[a] / total - 1 / 4) < 0.03 for a in env.action_names())


def test_random_policy_is_reproducible_from_its_seed():
    fmt = get_format("free_think")
    env = make("FrozenLake")
    env.reset(seed=0)

    def responses(seed: int) -> list[str]:
        policy = RandomPolicy(fmt, seed=seed)
        return [respond(policy, env) for _ in range(20)]

    assert responses(9) == responses(9)
    assert responses(9) != responses(10)
    assert len(set(responses(9))) > 1


def test_random_policy_answers_free_form_envs_with_a_well_formed_wrong_answer():
    fmt = get_format("no_think")
    env = make("Countdown")
    env.reset(seed=0)
    parsed = fmt.parse(respond(RandomPolicy(fmt), env), env.action_names())
    assert parsed.format_ok and len(parsed.actions) == 1
    _, _, _, _, info = env.step(parsed.actions[0])
    assert not info["success"]


def test_scripted_policy_without_env_returns_an_error_completion():
    (completion,) = ExpertPolicy(get_format("no_think")).generate(
        [GenerationRequest(prompt_ids=None, messages=[])], SamplingConfig()
    )
    assert completion.finish_reason == "error" and "env" in completion.error


def test_a_failing_solver_errors_only_its_own_request():
    class Broken:
        def solve(self):
            raise RuntimeError("solver exploded")

    env = make("FrozenLake")
    env.reset(seed=0)
    good, bad = ExpertPolicy(get_format("no_think")).generate(
        [GenerationRequest(None, [], env=env), GenerationRequest(None, [], env=Broken())], SamplingConfig()
    )
    assert good.finish_reason == "stop" and good.text
    assert bad.finish_reason == "error" and "solver exploded" in bad.error


@pytest.mark.parametrize("fmt_name", [f for f in format_names() if f != "visgym_tuple"])
def test_random_policy_says_it_is_random_and_makes_up_no_plan(fmt_name):
    fmt = get_format(fmt_name)
    env = make("FrozenLake")
    env.reset(seed=0)
    text = respond(RandomPolicy(fmt, seed=0), env)
    parsed = fmt.parse(text, env.action_names())
    assert parsed.format_ok and len(parsed.actions) == 1
    assert "shortest" not in text.lower() and "goal" not in text.lower()
    for name, value in parsed.fields.items():
        if name != fmt.answer_tag:  # a field that holds others (grounding's <think>) holds only their texts
            assert set(filter(None, re.split(r"\s*<[^>]+>\s*", value))) == {RANDOM_REASON}, (name, value)
