"""The metrics log: each record on the disk before the run goes on, so a checkpoint never outlives the records of
the steps it covers."""

from __future__ import annotations

import json
import os
from pathlib import Path

from turnrl.training.logger import MetricsLogger


def test_each_record_is_on_the_disk_when_log_returns(tmp_path, monkeypatch):
    """A checkpoint is saved after its step's record is logged, and is flushed to the disk; a power loss after it
    would lose records that were only in the page cache (ext4 stores them up to 30 s later), records of steps the
    resumed run does not run again. The file and its name in the run's folder are flushed before :meth:`log`
    returns."""
    flush, flushed = os.fsync, []

    def recorded(fd):
        flushed.append((Path(os.readlink(f"/proc/self/fd/{fd}")), os.fstat(fd).st_size))
        flush(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    for resume_step in (None, 1):  # a new run's log, then a resumed run's
        logger = MetricsLogger(tmp_path, tensorboard=False, resume_step=resume_step)
        assert tmp_path in [path for path, _ in flushed]  # the name of the file, made in it
        for step in (1, 2) if resume_step is None else (2,):
            logger.log(step, {"rollout/success": 0.5})
            size = (tmp_path / "metrics.jsonl").stat().st_size
            assert flushed[-1] == (tmp_path / "metrics.jsonl", size)  # every byte written so far
        logger.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
