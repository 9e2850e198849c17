"""The env server's env calls: closing an env, the worker threads, a request's calls on several threads."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from tests.envs.toy_envs import Corridor, CorridorWithExtras
from turnrl.envservice.sessions import CallBatch, EnvThreads, close_env


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
