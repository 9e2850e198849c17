"""Ranks: how the processes of a host share it."""

from turnrl.training import ranks


def test_processes_of_a_host_share_its_cores(monkeypatch):
    """torchrun leaves each process one thread (OMP_NUM_THREADS=1); a run gives each its share of the host."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks.threads_per_process() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert ranks.threads_per_process() == 1
