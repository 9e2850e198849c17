"""The expert's reasoning fields: ground truth before and after its planned actions."""

from __future__ import annotations

import copy

from tests.envs.toy_envs import CorridorWithExtras
from turnrl.agent.expert import expert_fields
from turnrl.envs import StateFacts, make


def test_expert_think_holds_the_observation_when_the_format_has_no_observation_tag():
    env = make("FrozenLake")
    env.reset(seed=2)
    fields = expert_fields(env, ["Right"], ("think", "answer"))
    assert fields["think"].startswith(env.state_facts().describe())
    assert "Right" in fields["think"]


def test_expert_prediction_stops_at_the_end_of_the_episode():
    env = make("FrozenLake")
    env.reset(seed=2)
    plan = env.solve()
    assert len(plan) == 1
    fields = expert_fields(env, [*plan, "Left", "Left"], ("prediction",))
    solved = copy.deepcopy(env)
    solved.step(plan[0])
    assert fields["prediction"] == solved.state_facts().describe()


def test_an_env_without_state_text_or_facts_gets_empty_fields_not_an_error():
    class Bare:
        def state_facts(self):
            from turnrl.envs import StateFacts

            return StateFacts(player=None)

        def step(self, action):
            return {"text": "x"}, 0.0, True, False, {}

    fields = expert_fields(Bare(), ["go"], ("observation", "prediction"))
    assert fields == {"observation": "", "prediction": ""}


def test_an_env_whose_facts_say_nothing_is_described_by_its_text():
    class Factless(CorridorWithExtras):
        def state_facts(self):
            return StateFacts(player=None)

    env = Factless()
    env.reset(seed=0)
    fields = expert_fields(env, ["Right"], ("observation", "prediction"))
    assert fields == {"observation": "___P_", "prediction": "____P"}


def test_an_action_off_the_solvers_plan_is_not_called_the_shortest_way():
    env = make("FrozenLake")
    env.reset(seed=2)
    plan = env.solve()
    assert plan == ["Right"]
    fields = expert_fields(env, ["Left"], ("think", "answer"), planned=plan)
    assert "shortest" not in fields["think"]
    assert fields["think"].endswith("I try Left.")
    # Where the solver has no plan, a stand-in action is only tried too.
    assert expert_fields(env, ["Up"], ("reasoning",), planned=[])["reasoning"] == "I try Up."


def test_only_the_actions_that_follow_the_plan_are_called_the_shortest_way():
    env = make("FrozenLake")
    env.reset(seed=2)
    fields = expert_fields(env, ["Right", "Up"], ("reasoning",), planned=["Right", "Down"])
    assert fields["reasoning"] == "The shortest way to the goal starts with Right; then I try Up."
    followed = expert_fields(env, ["Right"], ("reasoning",), planned=["Right", "Down"])
    assert followed["reasoning"] == "The shortest way to the goal starts with Right."


def test_think_of_a_state_without_text_has_no_leading_space():
    class Bare:
        def state_facts(self):
            return StateFacts(player=None)

    fields = expert_fields(Bare(), ["go"], ("think",))
    assert fields["think"] == "The shortest way to the goal starts with go."
