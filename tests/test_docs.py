"""The code in the docs runs: each Python block of docs/extending.md executes, and its env passes check_env;
each shell block of the README and docs/*.md holds only commands and comments; each command shown with its
output (``$ turnrl memory ...`` and the lines below it) prints that output now; each documented ``turnrl``
command's settings load, and each documented benchmark command gives only options its script has."""

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
    from turnrl.agent.formats import FormatOptions

    fmt = namespace["plan_then_act"](FormatOptions(max_actions_per_turn=3))
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
    from turnrl.training.batch import Sample, collate
    from turnrl.training.batch_advantages import compute_advantages
    from turnrl.training.train_config import TrainConfig

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


SHOWN_COMMANDS = ("turnrl memory",)
"""Commands whose output the docs show beneath them and which run anywhere in seconds (no GPU, no model built)."""


def shown_outputs(path: Path) -> list[tuple[int, str, str]]:
    """Each ``$ COMMAND`` of :data:`SHOWN_COMMANDS` in ``path`` with the output shown beneath it: ``(line, command,
    output)``. The command may go on over lines ending in a backslash; its output is the lines after it indented
    at least as far, up to a blank line or the next ``$``."""
    lines = path.read_text().splitlines()
    found = []
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)\$ (.*)$", line)
        if not match or not match.group(2).startswith(SHOWN_COMMANDS):
            continue
        indent, command, at = len(match.group(1)), match.group(2), number + 1
        while command.endswith("\\") and at < len(lines):
            command, at = command[:-1] + lines[at].strip(), at + 1
        output = []
        while at < len(lines) and lines[at].strip() and not lines[at].lstrip().startswith("$ "):
            if len(lines[at]) - len(lines[at].lstrip()) < indent:
                break
            output.append(lines[at])
            at += 1
        found.append((number + 1, command, "\n".join(output)))
    return found


def missing_from(shown: str, printed: str) -> str | None:
    """The first piece of ``shown`` that ``printed`` lacks, None when it holds them all in order: a doc's output
    cut with ``...`` and wrapped at other places than the terminal's still matches, a changed figure does not."""
    printed = " ".join(printed.split())
    at = 0
    for piece in (" ".join(part.split()) for part in shown.split("...")):
        if not piece:
            continue
        found = printed.find(piece, at)
        if found < 0:
            return piece
        at = found + len(piece)
    return None


def test_the_output_check_catches_a_changed_figure():
    printed = "2 GPUs: does not fit (actor 56.7 + critic 52.7 = 122.7 GiB of 79.2 GiB); turn on x=true"
    wrapped = "2 GPUs: does not fit (actor 56.7 ... = 122.7 GiB of\n   79.2 GiB); turn on ..."
    assert missing_from(wrapped, printed) is None
    assert missing_from("2 GPUs: does not fit (actor 56.7 ... = 119.7 GiB of 79.2 GiB) ...", printed) == \
        "= 119.7 GiB of 79.2 GiB)"
    assert missing_from("turn on x=true ... 2 GPUs", printed) == "2 GPUs", "in the order printed"


DOCUMENTED_OUTPUTS = [(path, *shown) for path in [README, *sorted(DOCS.glob("*.md"))] for shown in shown_outputs(path)]


def test_some_documented_output_is_checked():
    assert any(path.name == "distributed.md" for path, *_ in DOCUMENTED_OUTPUTS)


@pytest.mark.parametrize(("path", "line", "command", "shown"), DOCUMENTED_OUTPUTS,
                         ids=[f"{path.name}:{line}" for path, line, *_ in DOCUMENTED_OUTPUTS])
def test_documented_command_output_is_what_the_command_prints(path, line, command, shown, monkeypatch, capsys):
    """Figures pasted into the docs go stale when the estimate changes (distributed.md once showed 119.7 GiB where
    the command printed 122.7): the command runs as written and its output must hold what the doc shows. It runs
    in this process (``turnrl``'s own entry point): a new interpreter would spend most of its time on imports."""
    import torch

    from turnrl.cli import main

    assert shown.strip(), f"{path.name}:{line}: no output shown beneath `{command}`"
    words = command.split()[1:]  # after "turnrl"
    # As on the machine without a GPU the docs show (an H100's 79.2 GiB), with the allocator settings a run
    # gets by default (the margin depends on them).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(README.parent)
    capsys.readouterr()
    main(words)  # its exit status says whether every GPU count fits, which the doc's output says too
    printed = capsys.readouterr().out
    missing = missing_from(shown, printed)
    assert missing is None, (f"{path.name}:{line}: `{command}` no longer prints {missing!r}; it prints:\n"
                             f"{printed}\nregenerate the doc's block from it")


# --------------------------------------------------------------------------- documented commands
CONFIG_COMMANDS = ("train", "sft", "eval", "memory")
"""The ``turnrl`` subcommands whose settings a documented command gives (``--config`` and ``key=value``)."""

PLACEHOLDER = re.compile(r"=([A-Z][A-Z_]*|[A-Z]_[a-z]+)(\s|$)|\[\w[^\]]*\]|my_package")
"""What marks a command as a pattern to fill in (``seeds.seed=S``, ``[one change]``, the extending guide's
``my_package``): such a command is not run as written."""


def documented_commands() -> list[tuple[str, int, list[str]]]:
    """Each command of the README's and docs' shell blocks, its continuation lines joined and its comment and
    leading ``NAME=value`` assignments dropped: ``(file, line of its block, words)``."""
    found = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        for line_number, block in shell_blocks(path):
            for line in re.sub(r"\\\n", " ", block).splitlines():
                words = line.split(" #")[0].split()
                while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$", words[0]):
                    words.pop(0)
                if words and not words[0].startswith("#"):
                    found.append((path.name, line_number, words))
    return found


DOCUMENTED = documented_commands()
CONFIG_RUNS = [(name, line, words[1:]) for name, line, words in DOCUMENTED
               if words[0].endswith("turnrl") and len(words) > 1 and words[1] in CONFIG_COMMANDS
               and not PLACEHOLDER.search(" ".join(words))]
BENCHMARK_RUNS = [(name, line, words[1:]) for name, line, words in DOCUMENTED
                  if words[0] == "python" and len(words) > 1 and words[1].startswith("benchmarks/")]


def test_documented_commands_are_found():
    assert len(CONFIG_RUNS) >= 40 and len(BENCHMARK_RUNS) >= 40, (len(CONFIG_RUNS), len(BENCHMARK_RUNS))
    assert not PLACEHOLDER.search("turnrl train --config configs/quickstart.yaml seeds.seed=0 run.name=sft_s0")
    assert PLACEHOLDER.search("turnrl train seeds.seed=S run.time_limit_minutes=T") is not None


@pytest.mark.parametrize(("name", "line", "argv"), CONFIG_RUNS, ids=[f"{n}:{line}" for n, line, _ in CONFIG_RUNS])
def test_a_documented_command_names_settings_that_exist(name, line, argv, monkeypatch):
    """A key renamed or a value no longer allowed would leave the docs' commands failing as written: each one's
    settings load as the command would load them (its config file and overrides; a file a run writes, such as a
    run's config.yaml, is not there to read)."""
    from turnrl.cli import build_parser
    from turnrl.config import load_config
    from turnrl.eval_config import EvalConfig
    from turnrl.eval_settings import training_sections
    from turnrl.training.train_config import TrainConfig

    monkeypatch.chdir(README.parent)
    args = build_parser().parse_args(argv)
    if args.config is not None and not Path(args.config).exists():
        pytest.skip(f"{args.config} is written by an earlier command")
    overrides = [o for o in args.overrides if not o.startswith("resume=")]
    if argv[0] == "eval":
        load_config(EvalConfig, args.config, overrides, skip_sections=training_sections())
    else:
        load_config(TrainConfig, args.config, overrides)


@pytest.mark.parametrize(("name", "line", "argv"), BENCHMARK_RUNS,
                         ids=[f"{n}:{line}" for n, line, _ in BENCHMARK_RUNS])
def test_a_documented_benchmark_command_gives_only_options_its_script_has(name, line, argv):
    script = README.parent / argv[0]
    assert script.exists(), f"{name}:{line}: {argv[0]} does not exist"
    source = script.read_text()
    for flag in {word.split("=")[0] for word in argv[1:] if word.startswith("--")}:
        assert f'"{flag}"' in source, f"{name}:{line}: {argv[0]} has no option {flag}"
