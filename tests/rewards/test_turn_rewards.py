"""The reward seam: named rewards, weights, loading reward functions by name, failures as data."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from tests.rollout.test_runner import CounterEnv, TextPolicy, answer
from turnrl.agent.formats import ParsedResponse, get_format
from turnrl.config import AgentConfig, ConfigError, RewardsConfig, RewardSpec, SamplingConfig
from turnrl.envs.contract import StateFacts
from turnrl.rewards import FinishedTurn, Rewards, load_reward_fn
from turnrl.rewards.shaping import OverlongPenalty
from turnrl.rollout.metrics import rollout_metrics
from turnrl.rollout.runner import EpisodeSlot, Rollout


def finished(response: str = "r", env_reward: float = 0.0, format_reward: float = 0.0, tokens: int = 3) -> FinishedTurn:
    return FinishedTurn(
        env_id="Counter", seed=0, turn=0, observation="o", response=response, response_tokens=tokens,
        finish_reason="stop", parsed=ParsedResponse((), {}, True), actions=(), actions_valid=(),
        env_reward=env_reward, format_reward=format_reward, terminated=False, success=False,
    )


# --------------------------------------------------------------------------- reward functions of the tests
CALLS: list[int] = []


def response_length(turns: Sequence[FinishedTurn], scale: float = 1.0) -> list[float]:
    """A reward function: the response's length in characters, times ``scale``."""
    CALLS.append(len(turns))
    return [scale * len(turn.response) for turn in turns]


def explodes(turns: Sequence[FinishedTurn]) -> list[float]:
    raise RuntimeError("judge unreachable")


def no_turns() -> list[float]:
    return []


def needs_a_setting(turns: Sequence[FinishedTurn], *, scale: float) -> list[float]:
    return [scale for _ in turns]


class Unscored:
    """A class whose instances cannot score turns (no ``__call__``)."""

    def __init__(self, bonus: float = 1.0) -> None:
        self.bonus = bonus


class Counted:
    """A reward class that sees state facts: 1 when the counter went up."""

    needs_state_facts = True

    def __init__(self, bonus: float = 1.0) -> None:
        self.bonus = bonus
        self.seen: list[tuple[StateFacts | None, StateFacts | None]] = []

    def __call__(self, turns):
        self.seen.extend((turn.facts_before, turn.facts_after) for turn in turns)
        return [self.bonus * float(turn.facts_before != turn.facts_after) for turn in turns]


# --------------------------------------------------------------------------- scoring
def test_turn_reward_is_the_weighted_sum_of_named_rewards():
    config = RewardsConfig(env_weight=0.8, format_weight=0.2, extra=[
        RewardSpec(name="length", fn="tests.rewards.test_turn_rewards:response_length", weight=0.5, settings={"scale": 2.0})])
    (scores,) = Rewards(config).score([finished("abcd", env_reward=1.0, format_reward=0.5)])
    assert scores.rewards == {"env": 1.0, "format": 0.5, "length": 8.0}
    assert scores.reward == pytest.approx(0.8 * 1.0 + 0.2 * 0.5 + 0.5 * 8.0)
    assert scores.errors == []


def test_each_reward_function_is_called_once_per_batch_of_turns():
    CALLS.clear()
    rewards = Rewards(extra={"length": response_length})
    rewards.score([finished("a"), finished("bb"), finished("ccc")])
    rewards.score([])
    assert CALLS == [3]


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (explodes, "RuntimeError: judge unreachable"),
        (lambda turns: [1.0], "returned 1 scores for 2 turns"),
        (lambda turns: [1.0, math.nan], "non-finite"),
        (lambda turns: ["yes", 1.0], "ValueError"),
    ],
)
def test_a_failing_reward_function_scores_on_error_and_marks_every_turn(fn, why):
    config = RewardsConfig(on_error=-0.5)
    scores = Rewards(config, extra={"judge": fn}).score([finished(env_reward=1.0), finished()])
    for turn_scores, env in zip(scores, (1.0, 0.0)):
        assert turn_scores.rewards["judge"] == -0.5
        assert turn_scores.reward == pytest.approx(env - 0.5)
        assert len(turn_scores.errors) == 1 and turn_scores.errors[0].startswith("judge: ") and why in turn_scores.errors[0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_env_reward_scores_on_error_and_marks_its_turn(bad):
    rewards = Rewards(RewardsConfig(on_error=-0.5))
    scored, fine = rewards.score([finished(env_reward=bad, format_reward=0.5), finished(env_reward=1.0)])
    assert scored.rewards == {"env": -0.5, "format": 0.5} and scored.reward == pytest.approx(0.0)
    assert scored.errors == [f"env: non-finite reward ({bad})"]
    assert fine.reward == 1.0 and fine.errors == []
    failed = rewards.base_scores(bad, 0.0)  # a turn whose env failed later in the same turn
    assert failed.reward == -0.5 and failed.errors == [f"env: non-finite reward ({bad})"]


class NanCounter(CounterEnv):
    """A counter whose ``win`` pays NaN (an env that divides by zero)."""

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, math.nan if action == "win" else reward, terminated, truncated, info


def test_a_nan_from_the_env_never_reaches_a_turn_reward_in_a_rollout():
    def inc_then_win(request):
        return "<answer>inc</answer>" if "count=0" in request.messages[-1]["content"] else "<answer>win</answer>"

    agent = AgentConfig(format="no_think", max_turns=2, format_reward=0.5)
    rollout = Rollout(TextPolicy(inc_then_win), get_format("no_think"), agent, "Counter")
    (trajectory,) = rollout.run([EpisodeSlot(env=NanCounter(), seed=0, group=0)], SamplingConfig())
    first, second = trajectory.turns
    assert first.reward == pytest.approx(0.6) and first.reward_errors == []
    assert second.reward == 0.5 and second.reward_errors == ["env: non-finite reward (nan)"]
    assert rollout_metrics([trajectory])["reward_errors"] == 1.0


def test_reward_names_must_be_unique():
    with pytest.raises(ConfigError, match="used twice"):
        Rewards(extra={"env": response_length})
    spec = RewardSpec(name="x", fn="tests.rewards.test_turn_rewards:response_length")
    with pytest.raises(ConfigError, match="used twice"):
        Rewards(RewardsConfig(extra=[spec, spec]))


# --------------------------------------------------------------------------- loading
def test_load_reward_fn_takes_functions_classes_and_builtin_names():
    fn = load_reward_fn(RewardSpec(name="n", fn="tests.rewards.test_turn_rewards:response_length", settings={"scale": 3.0}))
    assert fn([finished("ab")]) == [6.0]
    counted = load_reward_fn(RewardSpec(name="c", fn="tests.rewards.test_turn_rewards:Counted", settings={"bonus": 2.0}))
    assert isinstance(counted, Counted) and counted.bonus == 2.0
    overlong = load_reward_fn(RewardSpec(name="o", fn="overlong", settings={"max_tokens": 10, "buffer": 4}))
    assert isinstance(overlong, OverlongPenalty)


@pytest.mark.parametrize(
    ("fn", "settings", "match"),
    [
        ("overlonk", {}, r"rewards.extra\[r\].fn='overlonk' is not allowed; choose one of \['overlong', 'grounding', "
                         r"'worldmodel'\]; did you mean overlong\? or name one of your own as module:attr"),
        ("tests.rewards.nowhere:fn", {}, "cannot import module 'tests.rewards.nowhere'"),
        ("tests.rewards.test_turn_rewards:missing", {}, "has no attribute 'missing'"),
        ("tests.rewards.test_turn_rewards:response_length", {"sclae": 1.0},
         r"^rewards.extra 'r' \(tests.rewards.test_turn_rewards:response_length\) has no setting sclae; did you mean "
         r"scale\? allowed: scale=1.0$"),
        ("tests.rewards.test_turn_rewards:needs_a_setting", {}, "bad settings .* missing a required argument: 'scale'"),
        ("tests.rewards.test_turn_rewards:Counted", {"bonus": 1, "other": 2}, "has no setting other; allowed: bonus"),
        ("overlong", {"max_token": 5, "buffer": 2}, r"^rewards.extra 'r' \(overlong\) has no setting max_token; did you "
                                                    r"mean max_tokens\? allowed: max_tokens, buffer$"),
        ("tests.rewards.test_turn_rewards:CALLS", {}, "got a value of type list, which is not callable"),
        ("tests.rewards.test_turn_rewards:no_turns", {}, r"a reward \(or a class whose instances are one\) must be a "
                                                         r"function or callable object taking \(turns\).*no_turns\(\), "
                                                         "which cannot take those arguments"),
        ("tests.rewards.test_turn_rewards:Unscored", {"bonus": 2.0},
         r"rewards.extra 'r': what the class 'tests.rewards.test_turn_rewards:Unscored' builds must be a function or "
         r"callable object taking \(turns\).*got a value of type Unscored, which is not callable"),
    ],
)
def test_load_reward_fn_errors_say_what_is_wrong(fn, settings, match):
    with pytest.raises(ConfigError, match=match):
        load_reward_fn(RewardSpec(name="r", fn=fn, settings=settings))


# --------------------------------------------------------------------------- in the rollout
class FactsCounter(CounterEnv):
    def state_facts(self):
        return StateFacts(player=None, extra={"count": self.count})


def play(rewards: Rewards, respond, n: int = 3, max_turns: int = 3):
    agent = AgentConfig(format="no_think", max_turns=max_turns, format_reward=0.5)
    rollout = Rollout(TextPolicy(respond), get_format("no_think"), agent, "Counter", rewards=rewards)
    slots = [EpisodeSlot(env=FactsCounter(), seed=i, group=i) for i in range(n)]
    return rollout.run(slots, SamplingConfig())


def test_rollout_records_named_rewards_and_uses_the_weighted_sum():
    CALLS.clear()
    config = RewardsConfig(env_weight=2.0, extra=[
        RewardSpec(name="length", fn="tests.rewards.test_turn_rewards:response_length", weight=0.01)])
    trajectories = play(Rewards(config), answer("inc"))
    assert CALLS == [3, 3, 3]  # one call per round, every episode's turn at once
    for trajectory in trajectories:
        for turn in trajectory.turns:
            length = len("<answer>inc</answer>")
            assert turn.rewards == {"env": pytest.approx(0.1), "format": 0.5, "length": float(length)}
            assert turn.reward == pytest.approx(2.0 * 0.1 + 0.5 + 0.01 * length)
        # the next observation tells the weighted reward
        assert f"Last reward: {trajectory.turns[0].reward:g}." in trajectory.turns[1].observation
    metrics = rollout_metrics(trajectories)
    assert metrics["reward_length_mean"] == pytest.approx(3 * 20.0)
    assert metrics["reward_env_mean"] == pytest.approx(0.3)
    assert metrics["reward_errors"] == 0.0
    json_turn = trajectories[0].to_json()["turns"][0]
    assert json_turn["rewards"]["length"] == 20.0 and json_turn["reward"] == pytest.approx(trajectories[0].turns[0].reward)


def test_a_failing_reward_function_never_stops_the_rollout_and_is_counted():
    trajectories = play(Rewards(extra={"judge": explodes}), answer("inc"))
    assert all(t.status != "error" and len(t.turns) == 3 for t in trajectories)
    for turn in (turn for t in trajectories for turn in t.turns):
        assert turn.rewards["judge"] == 0.0
        assert turn.reward_errors == ["judge: RuntimeError: judge unreachable"]
    assert rollout_metrics(trajectories)["reward_errors"] == 9.0
    assert trajectories[0].to_json()["turns"][0]["reward_errors"] == ["judge: RuntimeError: judge unreachable"]


def test_reward_functions_that_ask_get_state_facts_before_and_after_the_steps():
    counted = Counted()
    trajectories = play(Rewards(extra={"went_up": counted}), lambda r: "<answer>inc</answer>" if "count=0" in
                        r.messages[-1]["content"] else "<answer>jam</answer>", n=2, max_turns=2)
    assert len(counted.seen) == 4
    assert [(before.extra["count"], after.extra["count"]) for before, after in counted.seen] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    # turn 1: inc changes the count; turn 2: jam is rejected, nothing changes
    assert [turn.rewards["went_up"] for turn in trajectories[0].turns] == [1.0, 0.0]


def test_without_reward_functions_no_state_facts_are_asked():
    class NoFacts(CounterEnv):
        def state_facts(self):
            raise AssertionError("state_facts called although no reward needs it")

    agent = AgentConfig(format="no_think", max_turns=2)
    rollout = Rollout(TextPolicy(answer("inc")), get_format("no_think"), agent, "Counter")
    (trajectory,) = rollout.run([EpisodeSlot(env=NoFacts(), seed=0)], SamplingConfig())
    assert trajectory.status != "error" and len(trajectory.turns) == 2
    assert all(turn.reward_errors == [] for turn in trajectory.turns)  # a facts call that failed would be here


# --------------------------------------------------------------------------- shaping
@pytest.mark.parametrize(("length", "expected"), [(0, 0.0), (6, 0.0), (7, -0.25), (9, -0.75), (10, -1.0), (11, -1.0)])
def test_overlong_penalty_by_hand(length, expected):
    assert OverlongPenalty(max_tokens=10, buffer=4).penalty(length) == pytest.approx(expected)
    assert OverlongPenalty(10, 4)([finished(tokens=length)]) == [pytest.approx(expected)]


@pytest.mark.parametrize(("max_tokens", "buffer", "length", "expected"),
                         [(4, 4, 2, -0.5), (4, 4, 0, 0.0), (10, 1, 9, 0.0), (10, 1, 10, -1.0)])
def test_overlong_penalty_takes_a_buffer_from_one_token_to_the_whole_limit(max_tokens, buffer, length, expected):
    assert OverlongPenalty(max_tokens=max_tokens, buffer=buffer).penalty(length) == pytest.approx(expected)


def test_overlong_penalty_refuses_a_buffer_outside_the_limit():
    with pytest.raises(ValueError, match="buffer"):
        OverlongPenalty(max_tokens=10, buffer=0)
    with pytest.raises(ValueError, match="buffer"):
        OverlongPenalty(max_tokens=10, buffer=11)


def test_a_turn_without_state_facts_scores_on_error_alone():
    counted = Counted()
    facts = StateFacts(player=None, extra={"count": 1})
    with_facts = FinishedTurn(**{**vars(finished()), "facts_before": facts, "facts_after": facts})
    scores = Rewards(RewardsConfig(on_error=-1.0), extra={"went_up": counted}).score([with_facts, finished(), with_facts])
    assert [s.rewards["went_up"] for s in scores] == [0.0, -1.0, 0.0]
    assert scores[1].errors == ["went_up: no state facts for this turn"] and scores[0].errors == []
    assert len(counted.seen) == 2  # the function never saw the turn without facts


def test_a_turn_whose_facts_after_its_steps_are_missing_scores_on_error_alone():
    counted = Counted()
    facts = StateFacts(player=None, extra={"count": 1})
    before_only = FinishedTurn(**{**vars(finished()), "facts_before": facts})
    (scores,) = Rewards(RewardsConfig(on_error=-1.0), extra={"went_up": counted}).score([before_only])
    assert scores.rewards["went_up"] == -1.0 and scores.errors == ["went_up: no state facts for this turn"]
    assert counted.seen == []


def test_state_facts_are_asked_only_where_a_reward_function_reads_them():
    assert not Rewards().needs_state_facts
    assert not Rewards(extra={"length": response_length}).needs_state_facts
    assert Rewards(extra={"length": response_length, "went_up": Counted()}).needs_state_facts


def test_a_reward_function_that_hangs_times_out():
    import threading

    release = threading.Event()

    def hangs(turns):
        release.wait(10)
        return [1.0] * len(turns)

    try:
        (scores,) = Rewards(RewardsConfig(timeout_s=0.05, on_error=-2.0), extra={"judge": hangs}).score([finished()])
    finally:
        release.set()
    assert scores.rewards["judge"] == -2.0 and scores.errors == ["judge: timed out after 0.05 s"]
    (fast,) = Rewards(RewardsConfig(timeout_s=5.0), extra={"length": response_length}).score([finished("ab")])
    assert fast.rewards["length"] == 2.0


def test_a_reward_function_under_a_time_limit_runs_on_a_thread_that_never_holds_the_process():
    """A function that never returns is left behind on a daemon thread: the run can still exit."""
    import threading

    daemon = []

    def notes_its_thread(turns):
        daemon.append(threading.current_thread().daemon)
        return [0.0] * len(turns)

    Rewards(RewardsConfig(timeout_s=5.0), extra={"judge": notes_its_thread}).score([finished()])
    assert daemon == [True]


@pytest.mark.parametrize(
    ("override", "match"),
    [("rewards.on_error=.nan", "rewards.on_error"), ("rewards.env_weight=.inf", "rewards.env_weight"),
     ("rewards.timeout_s=0", "rewards.timeout_s")],
)
def test_rewards_config_refuses_non_finite_scores_and_weights(override, match):
    from turnrl.config import load_config
    from turnrl.training.train_config import TrainConfig

    with pytest.raises(ConfigError, match=match):
        load_config(TrainConfig, None, [override])


def test_a_reward_class_that_refuses_its_settings_is_a_config_error():
    with pytest.raises(ConfigError, match="bad settings"):
        load_reward_fn(RewardSpec(name="o", fn="overlong", settings={"max_tokens": 10, "buffer": 0}))


# --------------------------------------------------------------------------- from a user's package
def test_a_reward_from_a_users_package_is_named_module_attr_in_the_config(tmp_path, monkeypatch):
    from turnrl.config import load_config
    from turnrl.training.train_config import TrainConfig

    (tmp_path / "user_reward_ext.py").write_text(
        "def brevity(turns, max_chars=200):\n"
        "    return [-1.0 if len(turn.response) > max_chars else 0.0 for turn in turns]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(TrainConfig, None, [
        "rewards.extra=[{name: brevity, fn: 'user_reward_ext:brevity', weight: 0.5, settings: {max_chars: 3}}]"])
    scores = Rewards(config.rewards).score([finished("long answer"), finished("ok")])
    assert [s.rewards["brevity"] for s in scores] == [-1.0, 0.0]
    assert [s.reward for s in scores] == [-0.5, 0.0]
