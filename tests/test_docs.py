"""The code in the docs runs: each Python block of docs/extending.md executes, and its env passes check_env."""

import re
from pathlib import Path

from gymnasium.utils.env_checker import check_env

DOCS = Path(__file__).resolve().parents[1] / "docs"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_extending_examples_run():
    namespace: dict = {}
    for block in python_blocks(DOCS / "extending.md"):
        exec(compile(block, "extending.md", "exec"), namespace)
    env = namespace["CorridorEnv"]()
    check_env(env, skip_render_check=True)
    env.reset(seed=3)
    for action in env.solve():
        _, _, terminated, _, info = env.step(action)
    assert terminated and info["success"]
    fmt = namespace["plan_then_act"]
    parsed = fmt.parse(fmt.render(["Left", "Right"]), ["Left", "Right"])
    assert parsed.format_ok and parsed.actions == ("Left", "Right")
