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
