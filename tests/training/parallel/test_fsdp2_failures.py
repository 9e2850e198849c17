"""A checkpoint that rank 0 cannot write under FSDP2 (gloo processes on the CPU): every process stops the save with
rank 0's cause, and the run's checkpoints stay as they were."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.training.reference_run import failure_output
from turnrl.config import ConfigError
from turnrl.training.parallel.fsdp2 import WriteFailure, raise_failure, write_failure

# Each stage makes one of rank 0's writes fail in rank 0's process alone, saves checkpoint 2 on both processes, and
# writes what each process said and, once both have returned, what the checkpoints folder holds. The process group
# waits 20 s at most, so a process left waiting for rank 0 fails the run instead of hanging it.
FAILED_SAVES = """
import errno, resource, sys, torch
from pathlib import Path
from transformers import AutoTokenizer
from turnrl.models.loading import load_model
from turnrl.training import checkpoint, ranks
from turnrl.training.head import install_scoring_head
from turnrl.training.parallel.fsdp2 import FSDP2
from turnrl.training.parallel.strategy import CheckpointFiles, Models, Optimizers

ranks.init_process_group("cpu", timeout_s=20)
model = load_model(sys.argv[1])
install_scoring_head(model, None)
strategy = FSDP2(cpu_offload=False)
models = strategy.place(Models(model, None, None), torch.device("cpu"), torch.float32)
optimizers = Optimizers(torch.optim.AdamW(list(models.actor.parameters())), None)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
run_dir, out = Path(sys.argv[2]), Path(sys.argv[3])
files = lambda step, processor=tokenizer: CheckpointFiles(run_dir, step, processor, {}, "", 2)
strategy.save(files(1), models, optimizers)


class RefusingProcessor:
    def save_pretrained(self, path):
        raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "tokenizer.json"))


def refuse_flush(folder):  # a disk that says it is full only when the files are flushed
    raise OSError(errno.ENOSPC, "No space left on device")


def refuse_pointer(path, text):
    raise OSError(errno.EIO, "Input/output error")


unpatched = (checkpoint._sync_tree, checkpoint.atomic_write_text)
for stage in ("model", "tokenizer", "flush", "pointer"):
    processor = tokenizer
    if ranks.is_main():
        if stage == "model":  # the actor's weights (0.5 MB) reach the file-size limit
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
        processor = RefusingProcessor() if stage == "tokenizer" else tokenizer
        checkpoint._sync_tree = refuse_flush if stage == "flush" else unpatched[0]
        checkpoint.atomic_write_text = refuse_pointer if stage == "pointer" else unpatched[1]
    try:
        strategy.save(files(2, processor), models, optimizers)
        said = "saved"
    except Exception as error:
        said = f"{type(error).__name__}: {error}"
    if ranks.is_main():
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        checkpoint._sync_tree, checkpoint.atomic_write_text = unpatched
    (out / f"{stage}.said{ranks.rank()}").write_text(said)
    ranks.barrier()
    if ranks.is_main():
        root = run_dir / "checkpoints"
        (out / f"{stage}.folder").write_text(" ".join(sorted(path.name for path in root.iterdir())))
        (out / f"{stage}.latest").write_text((root / "latest").read_text())
    ranks.barrier()
strategy.save(files(3), models, optimizers)  # the processes still run their collectives in step
if ranks.is_main():
    (out / "latest").write_text((run_dir / "checkpoints" / "latest").read_text())
torch.distributed.destroy_process_group()
ranks.end_process(0)
"""

REFUSED = ("checkpoint after step 2 could not be written: {}. Free some space, raise the limit, or put "
           "run.output_dir on a larger disk, then continue from step_000001 (intact) with `turnrl train resume={}`")


def test_a_checkpoint_rank_0_cannot_write_stops_every_process_with_its_cause(tiny_model_dir, tmp_path):
    """Rank 0 fails at each of its stages of an FSDP2 checkpoint, in its process alone: before the optimizer shards
    (the actor's weights past its file-size limit, the tokenizer's files refused), and after them (the flush, the
    ``latest`` pointer). Both processes stop that save with rank 0's cause, at once (no process waits in a
    collective rank 0 never joins: the group's 20 s timeout would fail the run), no unfinished folder is left, and
    ``latest`` stays on the previous checkpoint; the next save succeeds on both."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    script = tmp_path / "failed_saves.py"
    script.write_text(FAILED_SAVES)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                             str(script), str(tiny_model_dir), str(run_dir), str(out)], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, failure_output(result)

    def said(stage: str) -> tuple[str, str]:
        return (out / f"{stage}.said0").read_text(), (out / f"{stage}.said1").read_text()

    limit = REFUSED.format("this process may write files of at most 0.1 MB (its file-size limit, `ulimit -f`)",
                           run_dir)
    full = REFUSED.format("No space left on device", run_dir)
    for stage, cause in (("model", limit), ("flush", full)):
        assert said(stage) == (f"ConfigError: {cause}", f"ConfigError: process 0: {cause}"), stage
    denied = f"PermissionError: [Errno 13] Permission denied: '{run_dir}/checkpoints/"
    assert said("tokenizer")[0].startswith(denied)
    assert said("tokenizer")[1] == (f"RuntimeError: process 0 could not write the checkpoint after step 2: "
                                    f"{said('tokenizer')[0]}")
    assert said("pointer") == ("OSError: [Errno 5] Input/output error", "RuntimeError: process 0 could not write "
                               "the checkpoint after step 2: OSError: [Errno 5] Input/output error")
    for stage in ("model", "tokenizer", "flush", "pointer"):
        assert ".tmp" not in (out / f"{stage}.folder").read_text(), stage  # the unfinished folder deleted
        assert (out / f"{stage}.latest").read_text() == "step_000001", stage
    assert (out / "latest").read_text() == "step_000003"


@pytest.mark.parametrize(("error", "raised", "message"), [
    (ConfigError("checkpoint after step 4 could not be written: No space left on device. Free some space"),
     ConfigError, "process 0: checkpoint after step 4 could not be written: No space left on device. Free some space"),
    (OSError(5, "Input/output error"), RuntimeError,
     "process 0 could not write the checkpoint after step 4: OSError: [Errno 5] Input/output error"),
])
def test_the_other_processes_raise_rank_0s_failure_as_it_said_it(error, raised, message):
    with pytest.raises(raised) as caught:
        raise_failure((0, write_failure(error)), step=4)
    assert str(caught.value) == message


def test_no_failure_raises_nothing():
    raise_failure(None, step=4)
    assert write_failure(ValueError("x")) == WriteFailure(refused=False, text="ValueError: x")
