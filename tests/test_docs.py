"""The code in the docs runs: each Python block of docs/extending.md executes, and its env passes check_env."""

import re
from pathlib import Path

import pytest

from gymnasium.utils.env_checker import check_env

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.fixture(scope="module")
def namespace() -> dict:
    """What the Python blocks of docs/extending.md define, run once in order."""
    names: dict = {}
    for block in python_blocks(DOCS / "extending.md"):
        exec(compile(block, "extending.md", "exec"), names)
    return names


def test_extending_examples_run(namespace):
    env = namespace["CorridorEnv"]()
    check_env(env, skip_render_check=True)
    env.reset(seed=3)
    for action in env.solve():
        _, _, terminated, _, info = env.step(action)
    assert terminated and info["success"]
    fmt = namespace["plan_then_act"]
    parsed = fmt.parse(fmt.render(["Left", "Right"]), ["Left", "Right"])
    assert parsed.format_ok and parsed.actions == ("Left", "Right")


def test_extending_reward_example_scores_turns(namespace):
    from turnrl.agent.formats import ParsedResponse
    from turnrl.rewards import FinishedTurn, Rewards

    turns = [
        FinishedTurn(env_id="Corridor", seed=0, turn=0, observation="o", response=text, response_tokens=1,
                     finish_reason="stop", parsed=ParsedResponse((), {}, True), actions=(), actions_valid=(),
                     env_reward=0.0, format_reward=0.0, terminated=False, success=False)
        for text in ("short", "x" * 500)
    ]
    scores = Rewards(extra={"brevity": namespace["brevity"]}).score(turns)
    assert [s.rewards["brevity"] for s in scores] == [0.0, -1.0]


def test_extending_estimator_example_is_chosen_by_the_config_and_runs(namespace):
    from turnrl.config import load_config
    from turnrl.training.advantages import compute_advantages
    from turnrl.training.batch import Sample, collate
    from turnrl.training.config import TrainConfig

    config = load_config(TrainConfig, None, ["algorithm.advantage=batch_baseline",
                                             "algorithm.estimator_params.batch_baseline.scale=0.5"])
    batch = collate([Sample([5, 5], [0, 1], [0.0, 0.0], [1], [reward], episode=e, group=0)
                     for e, reward in enumerate((1.0, 3.0))], pad_id=0)
    out = compute_advantages(batch, config.algorithm)
    assert out.advantages[:, 1].tolist() == [-0.5, 0.5]
    assert out.metrics == {"actor/batch_return_mean": 2.0}
