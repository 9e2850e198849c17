"""Checkpoints: HF-format model and tokenizer plus the trainer state for exact resume.

Layout of ``RUN_DIR/checkpoints/step_000100/``:

    actor/               save_pretrained of the policy (LoRA: the adapters) and its tokenizer
    critic/              the critic's backbone and value head (PPO only)
    trainer_state.pt     optimizers, schedulers, RNG states, step

A checkpoint is written into ``step_N.tmp`` and renamed when complete, and the
``latest`` pointer is replaced atomically, so a crash mid-save never leaves a
half checkpoint that resume would pick up.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: Path,
    step: int,
    actor: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    critic: Any | None = None,
    before_publish: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and point ``latest`` at it.

    ``before_publish(tmp_dir)`` writes more into the checkpoint before it is renamed into place (the
    optimizers' shards of a distributed run).
    """
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    actor.save_pretrained(tmp / "actor")
    tokenizer.save_pretrained(tmp / "actor")
    if critic is not None:
        critic.save_pretrained(tmp / "critic")
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / "trainer_state.pt")
    if before_publish is not None:
        before_publish(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(root / "latest", final.name)
    return final


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints of a run, oldest first (unfinished ``.tmp`` saves left out)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        name = path.name
        if path.is_dir() and name.startswith("step_") and name[5:].isdigit():
            steps.append(int(name[5:]))
    return sorted(steps)


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (0 keeps all); the one ``latest`` names always stays.

    Returns:
        The deleted checkpoint directories.
    """
    if keep <= 0:
        return []
    latest = latest_checkpoint(run_dir)
    deleted = []
    for step in checkpoint_steps(run_dir)[:-keep]:
        path = run_dir / "checkpoints" / f"step_{step:06d}"
        if latest is not None and path == latest:
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a checkpoint directory ``step_000039`` (39)."""
    return int(checkpoint.name.removeprefix("step_"))


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = pointer.parent / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    # Our own file: optimizer states and RNG states need full unpickling.
    return torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
