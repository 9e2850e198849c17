"""The env-server batch benchmark: its quick mode starts real servers and shows the pool's speed-up."""

from __future__ import annotations

from benchmarks import env_service_batch
from turnrl.envservice.options import ServerLimits


def test_the_quick_mode_times_both_servers_and_the_sleeping_env_gains_from_the_pool(capsys):
    """16 sessions of an env that sleeps 20 ms a step: at least 320 ms a request on one thread (about 20 ms on the
    default 16: the script's figure, not asserted here, where a busy machine would move it)."""
    rows = env_service_batch.main(["--quick", "--requests", "3"])
    pool = ServerLimits().workers
    assert [row.name for row in rows] == [workload.name for workload in env_service_batch.WORKLOADS]
    assert all(set(row.ms) == {1, pool} and row.sessions == 16 for row in rows)
    sleeping = rows[0]
    assert sleeping.ms[1] >= 16 * 20 and sleeping.ms[pool] > 0, sleeping
    out = capsys.readouterr().out
    assert f"--workers {pool} ms" in out and "sleep 20 ms a step" in out and "x\n" in out
