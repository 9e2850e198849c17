"""Ranks: how the processes of a host share it, and how one ends."""

import subprocess
import sys

from turnrl.training import ranks


def test_processes_of_a_host_share_its_cores(monkeypatch):
    """torchrun leaves each process one thread (OMP_NUM_THREADS=1); a run gives each its share of the host."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks.threads_per_process() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert ranks.threads_per_process() == 1


def test_a_process_that_ends_runs_its_exit_handlers_flushes_its_output_and_exits_with_its_status(tmp_path):
    """How a torchrun process leaves after its run (its exit skips the interpreter's teardown, during which gloo's
    threads can abort it: a race that no test can start on demand)."""
    handler_ran = tmp_path / "handler_ran"
    code = (
        "import atexit, sys\n"
        "from turnrl.training import ranks\n"
        f"atexit.register(open, {str(handler_ran)!r}, 'w')\n"
        "sys.stdout.write('buffered')\n"
        "ranks.end_process(3)\n"
        "print('not reached')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (3, "buffered", "")
    assert handler_ran.is_file()


GATHER = """
import sys, numpy as np, torch, torch.distributed as dist
from pathlib import Path
from turnrl.training import ranks
dist.init_process_group("gloo")
rank = dist.get_rank()
value = {"rank": rank, "pixels": torch.arange(1000 * (rank + 1), dtype=torch.float32),
         "image": np.full((rank * 37, 3), rank, dtype=np.uint8), "text": "x" * (rank * 5000)}
plain = [None] * dist.get_world_size()
dist.all_gather_object(plain, value)
for chunk in (999, 5000, 2**26):
    got = ranks.all_gather_objects(value, chunk_bytes=chunk)
    assert [g["rank"] for g in got] == [0, 1, 2]
    for g, p in zip(got, plain):
        assert torch.equal(g["pixels"], p["pixels"]) and np.array_equal(g["image"], p["image"])
        assert g["text"] == p["text"]
assert ranks.any_rank(rank == 2) and not ranks.any_rank(False) and ranks.max_over_ranks(rank * 3) == 6
Path(sys.argv[1], f"gathered{rank}").write_text("ok")  # printed lines of processes can interleave
dist.destroy_process_group()
"""


def test_objects_gathered_a_chunk_at_a_time_are_what_torch_gathers_whole(tmp_path):
    """Three processes' pickles of different sizes, through buffers smaller than any of them, larger than all,
    and between: what ``all_gather_object`` returns."""
    script = tmp_path / "gather.py"
    script.write_text(GATHER)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                             "--standalone", str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.glob("gathered*")) == ["gathered0", "gathered1", "gathered2"]
