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
