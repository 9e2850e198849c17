"""Metrics to ``metrics.jsonl``, TensorBoard and (when configured) Weights & Biases."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Writes one JSON line per call of :meth:`log`, and the same scalars to TensorBoard.

    Metric names use namespaces (``rollout/success``, ``losses/policy``,
    ``timing/generate_s``); non-finite values are written as null in JSON.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict[str, Any] | None = None, resume: bool = False) -> None:
        self.path = run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a" if resume else "w")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, name=run_dir.name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record: dict[str, Any] = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            value = float(value)
            record[key] = value if math.isfinite(value) else None
            if self._writer is not None and math.isfinite(value):
                self._writer.add_scalar(key, value, step)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)

    def close(self) -> None:
        self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
