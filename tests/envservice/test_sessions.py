"""The env server's env calls: closing an env, the worker threads, a request's calls on several threads."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from tests.envs.toy_envs import Corridor, CorridorWithExtras
from turnrl.envservice import sessions
from turnrl.envservice.protocol import APIError
from turnrl.envservice.sessions import CallBatch, EnvThreads, close_env, run_with_deadline


def test_closing_a_session_closes_its_env_where_it_offers_close():
    env = CorridorWithExtras()
    close_env(env)
    close_env(Corridor())  # offers none: nothing to do, and no error
    assert env.closed == 1


def test_the_failed_calls_remembered_for_retries_are_bounded(monkeypatch):
    """An env that always raises must not grow the server's records of failed calls without bound."""
    from turnrl.envservice import sessions as module

    monkeypatch.setattr(module, "RECENTLY_FAILED", 3)
    table = module.SessionTable()
    for k in range(10):
        session = module.Session(id=f"s{k}", env_id="Corridor", settings={}, owner="me", env=Corridor())
        table.add(session)
        table.failed[session.id] = module.Applied("step", 1, "{}", {"ok": False})
        table.remove(session, "env_error")
    assert list(table.failed) == ["s7", "s8", "s9"] and len(table.closed) == 10


# --------------------------------------------------------------------------- worker threads
def test_env_threads_replace_a_thread_written_off_and_let_it_end_when_its_call_returns():
    threads = EnvThreads(1, name="probe")
    release, inside = threading.Event(), threading.Event()
    holder: list[threading.Thread] = []

    def hang() -> str:
        holder.append(threading.current_thread())
        inside.set()
        release.wait()
        return "late"

    stuck = threads.submit(hang)
    assert inside.wait(5)
    queued = threads.submit(lambda: "next")  # the one thread is stuck: this waits for it
    assert not queued.done() and threads.stuck == 0
    threads.write_off(holder[0])
    assert queued.result(timeout=5) == "next" and threads.stuck == 1
    exiting = threads.submit(sys.exit, 3)
    with pytest.raises(RuntimeError, match="an env call raised SystemExit: 3"):
        exiting.result(timeout=5)
    release.set()
    assert stuck.result(timeout=5) == "late"
    holder[0].join(timeout=5)
    assert not holder[0].is_alive() and threads.stuck == 0 and holder[0].daemon
    threads.shutdown(wait=True)
    with pytest.raises(RuntimeError, match="shut down"):
        threads.submit(lambda: None)


def test_a_call_batch_answers_in_order_and_hands_an_abandoned_call_to_late_on_its_own_thread():
    release = threading.Event()
    hung_on: list[str] = []
    late: list[tuple[int, str, dict]] = []

    def call(k: int) -> dict:
        if k == 2:
            hung_on.append(threading.current_thread().name)
            release.wait()
        time.sleep(0.01 * (k % 3))
        return {"k": k}

    batch = CallBatch([lambda k=k: call(k) for k in range(8)],
                      late=lambda k, answer: late.append((k, threading.current_thread().name, answer)),
                      settled=lambda: None)
    threads = EnvThreads(3)
    for _ in range(3):
        threads.submit(batch.run)
    deadline = time.monotonic() + 5
    while sum(a is None for a in batch.answers) > 1 and time.monotonic() < deadline:  # the others answer meanwhile
        time.sleep(0.01)
    assert not batch.is_done() and batch.first_start() is not None
    assert batch.abandon_overdue(time.monotonic(), threads.write_off) == [2]
    assert batch.is_done() and threads.stuck == 1
    assert [a["k"] if a else None for a in batch.answers] == [0, 1, None, 3, 4, 5, 6, 7]
    release.set()
    deadline = time.monotonic() + 5
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    # Its answer goes to late() on its own thread (to close what it built), never into the batch's answers.
    assert late == [(2, hung_on[0], {"k": 2})] and batch.answers[2] is None
    settled = threading.Event()
    quick = CallBatch([lambda k=k: {"k": k} for k in range(5)], late=lambda k, answer: None, settled=settled.set)
    threads.submit(quick.run)
    threads.submit(quick.run)
    assert settled.wait(5) and [a["k"] for a in quick.answers if a] == [0, 1, 2, 3, 4]
    threads.shutdown(wait=True)


def test_a_shutdown_stops_a_batch_and_hands_each_answer_made_to_unused_or_late():
    """On one thread: call 0 answers, call 1 hangs, call 2 waits for the thread. At shutdown the batch raises a 503
    within a second; call 0's answer goes to ``unused`` (a build's env, to be closed), call 1's to ``late`` on its
    thread when it returns, and call 2 is never made."""
    release, inside = threading.Event(), threading.Event()
    made: list[int] = []

    def call(k: int) -> int:
        made.append(k)
        if k == 1:
            inside.set()
            release.wait()
        return 10 + k

    async def scenario() -> tuple[list[int], list[tuple[int, int]]]:
        threads = EnvThreads(1)
        unused: list[int] = []
        late: list[tuple[int, int]] = []
        calls = [lambda k=k: call(k) for k in range(3)]
        batch = asyncio.ensure_future(run_with_deadline(threads, 1, float("inf"), calls, unused=unused.append,
                                                        late=lambda k, answer: late.append((k, answer))))
        assert await asyncio.to_thread(inside.wait, 5)
        threads.shutdown(wait=False, cancel_futures=True)
        with pytest.raises(APIError, match="shutting down"):
            await asyncio.wait_for(batch, 5)
        release.set()
        deadline = time.monotonic() + 5
        while not late and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return unused, late

    unused, late = asyncio.run(scenario())
    assert unused == [10] and late == [(1, 11)] and made == [0, 1]


def test_a_batch_of_quick_calls_stays_on_one_thread_and_one_of_slow_calls_spreads_over_all(monkeypatch):
    """Pure-Python calls of about 50 us each (Sokoban steps) ran on every thread of the pool, which handed the
    interpreter lock between them and made the batch slower than one thread; calls that wait (a simulator) still
    spread over the pool once one has run ``SPREAD_AFTER_S``."""
    def quick() -> str:
        deadline = time.perf_counter() + 50e-6
        while time.perf_counter() < deadline:
            pass
        return threading.current_thread().name

    def slow() -> str:
        time.sleep(0.03)
        return threading.current_thread().name

    async def threads_used(call, n: int) -> int:
        threads = EnvThreads(16)
        try:
            names = await run_with_deadline(threads, 16, 30.0, [call] * n, late=lambda k, answer: None)
            return len(set(names))
        finally:
            threads.shutdown(wait=True)

    assert asyncio.run(threads_used(slow, 32)) > 4  # at the module's SPREAD_AFTER_S
    # A call the OS pauses for 2 ms spreads its batch, and a machine running the tests beside other work pauses
    # threads that long: the quick batch is timed against 100 ms, which no 50 us call reaches but by such a pause
    # (and one try in three on one thread is enough).
    monkeypatch.setattr(sessions, "SPREAD_AFTER_S", 0.1)
    assert min(asyncio.run(threads_used(quick, 400)) for _ in range(3)) == 1
