"""The episode-length count: the update's passes line, and a recipe's episodes counted with the tiny VLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.episode_length import passes_line

ROOT = Path(__file__).resolve().parents[2]


def test_the_passes_line_counts_the_longest_sequences_a_pass_holds_and_the_budget_that_pairs_two():
    assert passes_line(4227, 8192) == ("the update's packed passes of 8192 tokens hold 1 sequence of 4227; "
                                       "8576 tokens hold two")
    assert passes_line(4227, 16384) == ("the update's packed passes of 16384 tokens hold 3 sequences of 4227; "
                                        "8576 tokens hold two")
    assert passes_line(100, 0) == "the update's passes are padded rows (algorithm.micro_batch_tokens=0); packed, 256 " \
                                  "tokens hold two"


def test_a_recipes_episodes_are_counted_to_its_budget(tiny_vlm_dir):
    """The VisGym recipe on the tiny VLM, 3 turns of 8-token responses: every episode plays its 3 turns."""
    command = [sys.executable, str(ROOT / "benchmarks" / "episode_length.py"), "--config",
               str(ROOT / "configs" / "visgym_maze.yaml"), "--episodes", "2", f"model.path={tiny_vlm_dir}",
               "agent.max_turns=3", "sampling.max_new_tokens=8"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-3].endswith("visgym_maze.yaml: responses of 8 tokens, agent.max_turns=3, agent.max_context_tokens="
                              "16384, the engine's row 16384 (model.backend=auto)")
    assert lines[-2].startswith("episodes 2: ended by {'max_turns': 2}; turns {3: 2}")
    assert lines[-1].startswith("the update's packed passes of 16384 tokens hold ")
