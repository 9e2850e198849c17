"""Envs behind the server that raise, hang, exit or never return; many clients at once; a server killed mid-episode
under a rollout: each fails its own session or episode, and the server and the other sessions go on."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.envservice.env_helpers import (
    EXITING,
    FAST,
    GATE,
    GATED,
    IN_GATE,
    PROBE,
    ProbeEnv,
    ServerProcess,
    close_gate,
    env_server,
    open_one,
    opened,
    post,
    step_items,
)
from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs.seeds import SeedSplits
from turnrl.envservice.client import (
    ClientOptions,
    EnvServerPool,
    RemoteEnv,
    RemoteEnvBatch,
    remote_env_factory,
)
from turnrl.envservice.options import ServerLimits
from turnrl.envservice.protocol import (
    APIError,
    EnvRaisedError,
    RemoteEnvError,
)
from turnrl.envservice.request_bodies import (
    OpenBody,
    QueryBody,
    QueryItem,
)
from turnrl.envservice.server import EnvServer
from turnrl.policy.scripted import ExpertPolicy
from turnrl.rollout.groups import EnvGroups
from turnrl.rollout.runner import Rollout
from turnrl.rollout.trajectory import DONE, ERROR


# --------------------------------------------------------------------------- envs that fail or hang
def test_an_env_that_raises_ends_its_session_only(server):
    pool = EnvServerPool([server], ClientOptions(**FAST))
    batch = RemoteEnvBatch(pool, PROBE, {}, 3)
    assert not any(isinstance(r, RemoteEnvError) for r in batch.reset([0, 1, 2]))
    results = batch.step(["inc", "explode", "inc"])
    assert results[0].error is None and results[2].error is None
    assert isinstance(results[1].error, EnvRaisedError) and "the probe exploded" in str(results[1].error)
    gone = post(server, "/v1/step", {"items": [{"session": batch.ids[1], "action": "inc"}]})
    assert gone.status_code == 404 and "its env raised" in gone.json()["error"]["message"]
    again = batch.step(["inc", "inc", "inc"])
    assert again[0].error is None and again[2].error is None and "reset first" in str(again[1].error)
    assert not any(isinstance(r, RemoteEnvError) for r in batch.reset([0, 1, 2]))  # a new session for the second
    assert all(r.error is None for r in batch.step(["inc", "inc", "inc"]))
    # Through RemoteEnv: the error is the episode's; the next reset opens a fresh session.
    env = RemoteEnv(pool, PROBE)
    env.reset(seed=0)
    with pytest.raises(EnvRaisedError, match="exploded"):
        env.step("explode")
    assert env.reset(seed=0)[0]["text"] == ProbeEnv().reset(seed=0)[0]["text"]


def test_a_slow_env_does_not_hold_up_other_sessions(server):
    make_env = remote_env_factory(PROBE, {"delay_s": 2.0}, [server], **FAST)
    slow, fast = make_env(), make_env()
    slow.reset(seed=0)
    fast.reset(seed=0)
    finished: dict[str, float] = {}

    def slow_step() -> None:
        slow.step("slow")
        finished["slow"] = time.monotonic()

    start = time.monotonic()
    thread = threading.Thread(target=slow_step)
    thread.start()
    time.sleep(0.1)
    for _ in range(20):
        fast.step("inc")
    finished["fast"] = time.monotonic()
    thread.join()
    assert finished["fast"] < finished["slow"] and finished["slow"] - start >= 2.0, finished


@pytest.mark.parametrize("field", ["idle_timeout_s", "step_timeout_s"])
def test_a_timeout_that_is_not_a_number_is_refused(field):
    """``--idle-timeout nan`` compared false with every time, so idle sessions were never closed."""
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        ServerLimits(**{field: float("nan")})


def test_a_batch_steps_its_sessions_at_once_and_answers_as_one_thread_does():
    """16 sessions of an env that sleeps 50 ms a step (a 3D simulator): one request steps them on 16 threads at once
    (one thread took 16 x 50 ms), and every answer, errors included, is what the same steps one after another
    give, in the request's order (not the order the sessions are locked in)."""
    ids = [f"s{k:02d}" for k in (5, 3, 14, 0, 9, 11, 1, 7, 15, 2, 12, 6, 10, 4, 13, 8)]
    actions = ["slow"] * 12 + ["inc", "win", "explode", "slow"]

    async def step_once(workers: int) -> tuple[dict, float, set[str]]:
        server = EnvServer([PROBE], limits=ServerLimits(workers=workers))
        server.start()
        try:
            await opened(server, PROBE, ids, {"delay_s": 0.05})
            ProbeEnv.slow_threads.clear()
            start = time.monotonic()
            answer = await server.step(step_items(ids, actions))
            return answer, time.monotonic() - start, set(ProbeEnv.slow_threads)
        finally:
            server.shutdown()

    one, one_s, one_threads = asyncio.run(step_once(1))
    many, _, many_threads = asyncio.run(step_once(16))
    assert many == one
    assert [item["session"] for item in many["items"]] == ids
    assert [item["ok"] for item in many["items"]] == [True] * 14 + [False, True]
    # One thread slept through the 13 slow steps one after another; sixteen shared them.
    assert one_s >= 13 * 0.05 and len(one_threads) == 1 and len(many_threads) > 3, (one_threads, many_threads)


def test_the_envs_of_one_open_are_built_at_once():
    """16 sessions of an env that takes 100 ms to build, opened in one request (``RemoteEnvBatch``): built one
    after another they took 1.6 s (a simulator that starts in seconds outlasted the client's timeout)."""
    async def scenario() -> float:
        server = EnvServer([PROBE], limits=ServerLimits(workers=16))
        server.start()
        try:
            start = time.monotonic()
            ids = [f"s{k}" for k in range(16)]
            opened = await server.open_sessions(OpenBody(env_id=PROBE, settings={"build_s": 0.1}, ids=ids), "me")
            assert opened["sessions"] == ids and len(server.table) == 16
            return time.monotonic() - start
        finally:
            server.shutdown()

    assert asyncio.run(scenario()) < 0.8


def test_a_step_that_hangs_fails_its_session_past_the_deadline_and_the_server_serves_the_others():
    """A step that never returns (a simulator deadlocked) is answered after ``--step-timeout`` with an error that
    names the session and the option; its session is closed and its thread replaced, so more hung envs than
    threads still leave the server stepping the others. The stuck envs are closed when their calls return, never
    under them."""
    close_gate()

    async def scenario() -> None:
        server = EnvServer([GATED], limits=ServerLimits(workers=2, step_timeout_s=0.3))
        server.start()
        ids = ["a", "b", "c", "d", "e", "f"]
        try:
            await opened(server, GATED, ids)
            envs = {i: server.table.sessions[i].env for i in ids}
            body = step_items(["a", "b"], ["wait-inc", "inc"])
            first = await asyncio.wait_for(server.step(body), 10)
            hung, fine = first["items"]
            assert (hung["ok"], hung["error"]["code"], fine["ok"]) == (False, "env_timeout", True)
            assert "session a: tests.envservice.env_helpers:GatedEnv step still ran after 0.3 s" in (
                hung["error"]["message"]) and "larger --step-timeout" in hung["error"]["message"]
            assert await server.step(body) == first  # a retry: a's answer from the record, b's replayed
            with pytest.raises(APIError, match=r"session a is closed \(env_timeout: its step ran past"):
                await server.step(step_items(["a"], ["inc"], seq=None))
            # More hung sessions than threads: each stuck thread is replaced.
            more = await asyncio.wait_for(server.step(step_items(["c", "d", "e"], ["wait-inc", "wait-inc", "inc"])), 10)
            assert [item["ok"] for item in more["items"]] == [False, False, True]
            after = await asyncio.wait_for(server.step(step_items(["f"], ["inc"])), 10)  # no thread waits for it
            assert after["items"][0]["ok"]
            assert server.health()["stuck_calls"] == 3 and server.metrics.errors["env_timeout"] == 3
            metrics = server.prometheus()
            assert 'turnrl_env_sessions_closed_total{reason="env_timeout"} 3' in metrics
            assert "turnrl_env_stuck_calls 3" in metrics
            await asyncio.sleep(0.1)
            assert not any(envs[i].closes for i in "acd")  # never closed under a call that runs
            GATE.set()
            deadline = time.monotonic() + 10
            while server.health()["stuck_calls"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert server.health()["stuck_calls"] == 0 and all(len(envs[i].closes) == 1 for i in "acd")
            assert not any(envs[i].closes for i in "bef")
        finally:
            GATE.set()
            server.shutdown()

    asyncio.run(scenario())


def test_a_query_that_hangs_fails_its_item_and_closes_its_session():
    close_gate()

    async def scenario() -> None:
        server = EnvServer([GATED], limits=ServerLimits(step_timeout_s=0.3))
        server.start()
        try:
            await opened(server, GATED, ["a", "b"], {"gate_solve": True})
            body = QueryBody(items=[QueryItem(session="a", queries=["solve"]),
                                    QueryItem(session="b", queries=["text"])])
            hung, fine = (await asyncio.wait_for(server.query(body), 10))["items"]
            assert hung["error"]["code"] == "env_timeout" and "session a: " in hung["error"]["message"]
            assert fine["ok"] and fine["queries"]["text"]
            with pytest.raises(APIError, match=r"session a is closed \(env_timeout: its queries ran past"):
                await server.query(body)
        finally:
            GATE.set()
            server.shutdown()

    asyncio.run(scenario())


def test_a_hung_step_reaches_the_client_as_an_error_naming_the_session_and_the_option():
    close_gate()
    try:
        with env_server(limits=ServerLimits(step_timeout_s=0.3), envs=[GATED]) as url:
            make_env = remote_env_factory(GATED, {}, [url], **FAST)
            env = make_env()
            env.reset(seed=0)
            with pytest.raises(EnvRaisedError, match=f"session {env.session_id}: .* still ran after 0.3 s.*"
                                                     "larger --step-timeout"):
                env.step("wait-inc")
            assert env.reset(seed=0)[0]["text"] == ProbeEnv().reset(seed=0)[0]["text"]  # a new session
            make_env.close()
    finally:
        GATE.set()


def test_a_retry_that_waited_for_the_first_attempt_whose_env_raised_gets_each_item_not_a_404():
    """A client retries a batch (its first answer was lost) while the server still runs it; the env of one
    session raises meanwhile and closes it. The retry, waiting for the sessions, gets that item's error and the
    others' answers, as a retry that comes later does; a 404 for the whole request lost the other steps."""
    close_gate()

    async def scenario() -> None:
        server = EnvServer([GATED])
        server.start()
        try:
            await opened(server, GATED, ["a", "b"])
            body = step_items(["a", "b"], ["wait-explode", "inc"])
            first = asyncio.ensure_future(server.step(body))
            assert await asyncio.to_thread(IN_GATE.acquire, timeout=10)  # a's step is under way
            retry = asyncio.ensure_future(server.step(body))
            await asyncio.sleep(0.05)  # the retry waits for the sessions' locks
            GATE.set()
            answer = await asyncio.wait_for(first, 10)
            assert answer["items"][0]["error"]["code"] == "env_error" and answer["items"][1]["ok"]
            assert await asyncio.wait_for(retry, 10) == answer
            assert server.metrics.steps == 2  # the retry applied nothing
        finally:
            GATE.set()
            server.shutdown()

    asyncio.run(scenario())


def test_an_env_that_calls_sys_exit_fails_its_item_and_the_server_stays_up():
    """SystemExit raised on a worker thread reached the event loop and stopped the server."""
    with env_server(envs=[EXITING]) as url:
        session = open_one(url, EXITING)
        assert post(url, "/v1/reset", {"items": [{"session": session, "seed": 0}]}).status_code == 200
        stepped = post(url, "/v1/step", {"items": [{"session": session, "action": "exit"}]})
        assert stepped.status_code == 200, stepped.text
        item = stepped.json()["items"][0]
        assert item["error"]["code"] == "env_error" and "step() raised SystemExit: 3" in item["error"]["message"]
        built = post(url, "/v1/sessions", {"env_id": EXITING, "settings": {"exit_on_build": True}})
        assert built.status_code == 500 and "raised SystemExit: the simulator failed to start" in built.text
        assert httpx.get(url + "/health", timeout=5).json()["sessions"] == 0


def test_an_env_whose_reset_returns_the_bare_observation_is_told_so():
    """It answered Python's "not enough values to unpack (expected 2, got 1)" from the server's own unpacking."""
    bare = "tests.envs.toy_envs:BrokenBareReset"
    with env_server(envs=[bare]) as url:
        session = open_one(url, bare)
        item = post(url, "/v1/reset", {"items": [{"session": session, "seed": 0}]}).json()["items"][0]
        assert item["error"]["code"] == "env_error"
        assert "reset() raised TypeError: reset() must return (observation, info), got a dict: {'text': " in \
            item["error"]["message"]


# --------------------------------------------------------------------------- load
def run_clients(url: str, clients: int, steps: int) -> list[float]:
    """``clients`` threads, each stepping its own session ``steps`` times; checks every count; latencies (s)."""
    make_env = remote_env_factory(PROBE, {}, [url], **FAST)

    def one(k: int) -> list[float]:
        env = make_env()
        obs, _ = env.reset(seed=k)
        count = int(obs["text"].split("=")[1])
        latencies = []
        for i in range(steps):
            start = time.perf_counter()
            obs, reward, *_ = env.step("inc")
            latencies.append(time.perf_counter() - start)
            assert obs["text"] == f"count={count + i + 1}" and reward == 1.0  # none lost, none doubled
        env.close()
        return latencies

    with ThreadPoolExecutor(clients) as pool:
        return [lat for part in pool.map(one, range(clients)) for lat in part]


def report(label: str, latencies: list[float], seconds: float) -> str:
    p50, p99 = np.percentile(latencies, [50, 99]) * 1e3
    return f"{label}: {len(latencies)} steps in {seconds:.1f} s ({len(latencies) / seconds:,.0f}/s), " \
           f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"


def test_concurrent_clients_lose_and_double_no_step(server, capsys):
    before = httpx.get(server + "/health").json()["steps"]
    start = time.perf_counter()
    latencies = run_clients(server, clients=16, steps=60)
    line = report("16 clients x 60 steps, server in process", latencies, time.perf_counter() - start)
    assert httpx.get(server + "/health").json()["steps"] - before == 16 * 60
    with capsys.disabled():
        print("\n" + line)


@pytest.mark.slow
def test_64_clients_of_500_steps_against_one_server_process(capsys):
    with ServerProcess() as served:
        start = time.perf_counter()
        latencies = run_clients(served.url, clients=64, steps=500)
        line = report("64 clients x 500 steps, server in a subprocess", latencies, time.perf_counter() - start)
        assert httpx.get(served.url + "/health").json()["steps"] == 64 * 500
    with capsys.disabled():
        print("\n" + line)


# --------------------------------------------------------------------------- a server killed under a rollout
class KillingPolicy(ExpertPolicy):
    """The expert, which after its ``at``-th batch of responses runs ``then`` (kills a server)."""

    def __init__(self, fmt, at: int, then) -> None:
        super().__init__(fmt, max_actions_per_turn=1)
        self.at, self.then, self.calls = at, then, 0

    def generate(self, requests, sampling):
        out = super().generate(requests, sampling)
        self.calls += 1
        if self.calls == self.at:
            self.then()
        return out


def test_a_server_killed_mid_episode_ends_its_episodes_as_errors_and_the_batches_go_on():
    fmt = get_format("free_think")
    agent = AgentConfig(format="free_think", max_turns=12, max_actions_per_episode=12)
    with ServerProcess() as doomed, env_server() as steady:
        make_env = remote_env_factory("Sokoban", {}, [doomed.url, steady], **FAST)
        groups = EnvGroups(make_env, n_groups=2, group_size=2, seeds=SeedSplits())

        # 1. SIGKILL after the first turn: the episodes on that server end as errors; the others finish.
        rollout = Rollout(KillingPolicy(fmt, 1, doomed.kill), fmt, agent, "Sokoban")
        first = rollout.run(groups.train_slots(0), SamplingConfig())
        doomed_at = [env.start % 2 == 0 for env in groups._envs]  # the k-th env prefers server k mod 2
        assert doomed_at == [True, False, True, False]
        assert [t.status for t, lost in zip(first, doomed_at) if lost] == [ERROR, ERROR]
        assert all("SessionLostError" in t.error and doomed.url in t.error for t, lost in zip(first, doomed_at) if lost)
        assert all(t.status == DONE and t.success for t, lost in zip(first, doomed_at) if not lost)

        # 2. The next batch: its resets fail over to the live server; every episode succeeds.
        second = Rollout(ExpertPolicy(fmt), fmt, agent, "Sokoban").run(groups.train_slots(1), SamplingConfig())
        assert all(t.status == DONE and t.success for t in second)
        assert {env.server for env in groups._envs} == {steady}

        # 3. Restarted (same port) mid-episode: the new server never knew the sessions, and says so.
        doomed.start()
        time.sleep(0.6)  # past the client's cooldown for a server that did not answer
        fresh = EnvGroups(make_env, n_groups=2, group_size=1, seeds=SeedSplits())

        def restart() -> None:
            doomed.kill()
            doomed.start()

        third = Rollout(KillingPolicy(fmt, 1, restart), fmt, agent, "Sokoban").run(fresh.train_slots(0),
                                                                                    SamplingConfig())
        lost = [env.start % 2 == 0 for env in fresh._envs]
        assert lost == [True, False]
        assert third[0].status == ERROR and "restarted" in third[0].error
        assert third[1].status == DONE
        assert Rollout(ExpertPolicy(fmt), fmt, agent, "Sokoban").run(fresh.train_slots(1), SamplingConfig())[0].success
