"""Every recipe in configs/ loads, starts with the command that runs it, and trains a step.

The recipes are sized for real models; here each runs one step on the tiny
built-in model with small batches, which exercises its own estimator, format,
sample mode, filter and env settings end to end.
"""

import json
from pathlib import Path

import pytest

from turnrl.config import load_config
from turnrl.training.commands import train
from turnrl.training.memory import rows_shorter_than_episodes
from turnrl.training.train_config import TrainConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
SHRINK = [
    "run.steps=1",  # validation runs before and after the one step (never during it): validation.every stays
    "run.tensorboard=false",
    "run.trajectories_every=0",
    "run.save_every=0",
    "groups.n_groups=2",
    "groups.group_size=2",
    "validation.episodes=2",
    "sampling.max_new_tokens=12",
    "agent.max_turns=2",
    "sft.episodes=4",
    "sft.epochs=1",
    "sft.batch_size=4",
    "sft.micro_batch_size=4",
    "algorithm.mini_batch_size=4",
    "algorithm.micro_batch_size=4",
]


def test_every_recipe_is_found():
    assert {c.stem for c in CONFIGS} >= {"quickstart", "ragen_sokoban", "vagen_frozenlake", "grpo_bandit",
                                         "vlm_quickstart", "vagen_sokoban_visual", "visgym_maze",
                                         "vagen_full_frozenlake", "vagen_full_sokoban", "vagen_full_sokoban_visual",
                                         "sokoban_quickstart",
                                         "navigation", "primitive_skill", "svg", "ragen_spatial"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipe_header_names_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first == f"# turnrl train --config configs/{path.name}" or first.startswith(
        f"# turnrl train --config configs/{path.name} "
    )


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_recipe_made_for_a_pretrained_model_declares_it(path):
    """The recipes whose command passes model.path= expect a pretrained model (and a run without one says so)."""
    command = path.read_text().splitlines()[0]
    assert load_config(TrainConfig, path).model.expects_pretrained == ("model.path=" in command)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_no_recipe_ends_its_episodes_short_of_its_own_context_budget(path):
    """An agent that may grow an episode to more tokens than an engine row holds would see its episodes end at
    the row's length, short of the recipe's own budget (a run says so at its start)."""
    assert rows_shorter_than_episodes(load_config(TrainConfig, path)) is None


# PrimitiveSkill's step takes 11-14 s on two cores (MuJoCo makes a renderer for each env, 0.15 s, and draws its
# 256x256 frames at about 40 ms); its env tests play it in the default run, and its recipe trains a step with
# the slow tests.
SLOW_RECIPES = {"primitive_skill"}


# The runs of the quickstarts (text and VLM) write their report with its PNG curves, as a real run does; the other
# recipes' runs leave the curves out (matplotlib drew them in about a second of each short run, the same curves).
DRAWN_RECIPES = {"quickstart", "vlm_quickstart"}


@pytest.mark.parametrize("path", [pytest.param(path, marks=pytest.mark.slow) if path.stem in SLOW_RECIPES else path
                                  for path in CONFIGS], ids=lambda p: p.stem)
def test_recipe_trains_a_step_on_the_tiny_model(path, tiny_model_dir, tiny_vlm_dir, tmp_path, monkeypatch):
    if path.stem not in DRAWN_RECIPES:
        from turnrl.viz import report

        monkeypatch.setattr(report, "draw_training_curves", lambda records, out_dir, sft_records=None: [])
    recipe = load_config(TrainConfig, path)
    visual = recipe.model.builtin_preset.startswith("vlm-") or "image" in str(recipe.env.settings.get("mode", ""))
    model = tiny_vlm_dir if visual else tiny_model_dir  # a recipe that sees images trains the tiny VLM
    config = load_config(TrainConfig, path, [*SHRINK, f"model.path={model}", f"run.output_dir={tmp_path}"])
    summary = train(config)
    assert "val_success_after_rl" in summary
    run_dir = tmp_path / config.run.name
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/success" in record for record in steps)
    assert (run_dir / "checkpoints" / "latest").exists()
    if path.stem in DRAWN_RECIPES:
        from turnrl.viz.report import PLOTS_DIR

        assert any((run_dir / PLOTS_DIR).glob("*.png"))


def test_vagen_recipe_puts_its_kl_in_the_reward_as_vagen_does():
    config = load_config(TrainConfig, "configs/vagen_frozenlake.yaml")
    algo = config.algorithm
    assert (algo.advantage, algo.kl_in_reward, algo.kl_coef, algo.kl_kind) == ("bilevel_gae", True, 0.001, "k1")
    assert (algo.gamma_turn, algo.gamma_token) == (0.95, 1.0)


def test_ragen_recipe_discounts_nothing():
    algo = load_config(TrainConfig, "configs/ragen_sokoban.yaml").algorithm
    assert (algo.gamma_token, algo.lambda_token, algo.gamma_turn, algo.lambda_turn) == (1.0, 1.0, 1.0, 1.0)


@pytest.mark.parametrize("recipe", [
    "ragen_sokoban", "ragen_coord_sokoban", "ragen_frozenlake", "ragen_rubiks", "ragen_spatial"])
def test_the_expert_solves_a_ragen_recipe_whose_prompts_end_with_think(recipe, tmp_path):
    # RAGEN's prompts end with <think>: the expert writes what follows it, and every turn parses well-formed.
    from turnrl.cli import main

    out = tmp_path / "eval"
    path = Path(__file__).resolve().parents[1] / "configs" / f"{recipe}.yaml"
    assert main(["eval", "--config", str(path), "--policy", "expert", "--episodes", "2",
                 "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["success_rate"] == 1.0
    for line in (out / "trajectories.jsonl").read_text().splitlines():
        for turn in json.loads(line)["turns"]:
            assert turn["response_prefix"] == "<think>" and turn["response"].startswith("<think>")
            assert turn["response"].count("<think>") == 1 and turn["format_ok"], turn["parse_errors"]
