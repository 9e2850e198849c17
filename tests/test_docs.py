"""The code in the docs runs: each Python block of docs/extending.md executes, and its env passes check_env;
each shell block of the README and docs/*.md holds only commands and comments."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from gymnasium.utils.env_checker import check_env

DOCS = Path(__file__).resolve().parents[1] / "docs"
README = DOCS.parent / "README.md"

PROGRAMS = {"turnrl", ".venv/bin/turnrl", "python", "make", "pip", "uv", "git", "cd", "source", "export", "torchrun",
            "ray", "curl", "bash", "tensorboard", "nvidia-smi", "ssh", "docker", "apt-get", "sudo", "touch", "kill"}
"""What a shell block's command may start with (after ``NAME=value`` assignments): the programs the docs run."""


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


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """The ``bash`` / ``sh`` / ``shell`` fenced blocks of a Markdown file, with the line each starts on."""
    text = path.read_text()
    return [(text[: match.start()].count("\n") + 2, match.group(1))
            for match in re.finditer(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.S | re.M)]


def not_commands(block: str) -> list[str]:
    """The lines of a shell block that are neither blank, a comment nor a command of :data:`PROGRAMS` (a line
    ending in a backslash continues on the next)."""
    wrong = []
    for line in re.sub(r"\\\n", " ", block).splitlines():
        words = line.split()
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$", words[0]):  # VAR=value before the command
            words.pop(0)
        if words and not words[0].startswith("#") and words[0] not in PROGRAMS:
            wrong.append(line)
    return wrong


@pytest.mark.parametrize("path", [README, *sorted(DOCS.glob("*.md"))], ids=lambda path: path.name)
def test_shell_blocks_hold_only_commands_and_comments(path):
    """Prose pasted into a command block (the README's "Use" block once held 28 lines of it between two
    commands) is caught: every line is a command, a comment or blank, and the block parses as bash."""
    for line_number, block in shell_blocks(path):
        assert not_commands(block) == [], f"{path.name}:{line_number}: a shell block holds prose"
        if shutil.which("bash"):
            parsed = subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True)
            assert parsed.returncode == 0, f"{path.name}:{line_number}: not valid bash: {parsed.stderr}"


def test_the_shell_block_check_catches_prose():
    assert not_commands("turnrl envs   # list\n\nPYTHONPATH=. python x.py \\\n  --flag\n# a comment\n") == []
    assert not_commands("turnrl eval --env X\nto `runs/eval` unless `--out` says where.\n") == [
        "to `runs/eval` unless `--out` says where."]
