"""docs/metrics.md against what a run writes: every key of ``metrics.jsonl`` has a row there, and a few keys that
every run writes are documented under the names the run uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.training.test_commands import config, records
from turnrl.training.commands import train

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"

ALWAYS_WRITTEN = ["step", "time", "rollout/success", "rollout/reward_mean", "rollout/zero_variance_groups",
                  "rollout/in_group_reward_std", "filter/kept_ratio", "val/success", "actor/entropy",
                  "actor/grad_norm", "losses/policy", "batch/trained_tokens", "timing/step_s",
                  "throughput/generated_tokens_per_s", "startup/models_s"]
"""Keys a short GRPO run on the CPU writes, which a reader of the page looks up first."""

_KEY = re.compile(r"`([^`]+)`")
_PLACEHOLDER = re.compile(r"<[^>]+>|\{[^}]+\}")


def documented_keys(page: str) -> list[str]:
    """The keys of the page's table rows: in each row's first cell, keys or patterns in backticks."""
    cells = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    return [key for cell in cells for key in _KEY.findall(cell)]


def key_pattern(row: str) -> re.Pattern[str]:
    """A row's key as a regex: each ``<name>`` or ``{tag}`` stands for one part of a key, without a slash."""
    parts = _PLACEHOLDER.split(row)
    return re.compile("[^/]+".join(re.escape(part) for part in parts))


def undocumented(keys: set[str], rows: list[str]) -> list[str]:
    """The keys that match no row, sorted."""
    patterns = [key_pattern(row) for row in rows]
    return sorted(key for key in keys if not any(pattern.fullmatch(key) for pattern in patterns))


def test_a_pattern_row_stands_for_one_part_of_a_key():
    assert key_pattern("rollout/env_<name>").fullmatch("rollout/env_deadlocked")
    assert key_pattern("rewards/<reward>/judge_calls").fullmatch("rewards/grounding/judge_calls")
    assert not key_pattern("rewards/<reward>/judge_calls").fullmatch("rewards/a/b/judge_calls")
    assert not key_pattern("rollout/success").fullmatch("rollout/successes")
    assert undocumented({"val/success", "val/new_figure"}, ["val/success"]) == ["val/new_figure"]


@pytest.fixture(scope="module")
def written_keys(tiny_model_dir, tmp_path_factory) -> set[str]:
    """Every key of the ``metrics.jsonl`` of a one-step GRPO run of the tiny model (validation before and after)."""
    out = tmp_path_factory.mktemp("metrics_doc")
    train(config(tiny_model_dir, out, "run.steps=1"))
    return {key for record in records(out / "run") for key in record}


def test_every_key_a_run_writes_has_a_row_in_the_metrics_page(written_keys):
    missing = undocumented(written_keys, documented_keys(PAGE.read_text()))
    assert not missing, f"add a row to {PAGE.name} for each of: {', '.join(missing)}"


@pytest.mark.parametrize("key", ALWAYS_WRITTEN)
def test_a_key_every_run_writes_is_documented_under_its_name(key, written_keys):
    assert key in written_keys, f"the run wrote no {key!r}: rename its row in {PAGE.name} (and here)"
    assert key in documented_keys(PAGE.read_text()), f"{PAGE.name} has no row `{key}`"
