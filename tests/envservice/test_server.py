"""The env server with its client over real loopback HTTP: the same trajectories as in process, bad input as
4xx, limits and lost answers (envs that fail or hang, load and a killed server: test_server_faults.py; the
command and env.remote in eval and train: test_server_command.py)."""

from __future__ import annotations

import asyncio
import base64
import copy
import gc
import json
import time
import uuid

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.envservice.env_helpers import (
    ECHO,
    FAST,
    PROBE,
    EchoEnv,
    LoseAnswers,
    ProbeEnv,
    SpoilAnswers,
    env_server,
    open_one,
    opened,
    post,
    step_items,
)
from tests.rollout.trajectory_checks import same_trajectory
from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, SamplingConfig
from turnrl.envs import check_env, make
from turnrl.envs.contract import observation_key
from turnrl.envservice.client import (
    ClientOptions,
    EnvServerPool,
    RemoteEnv,
    RemoteEnvBatch,
    remote_env_factory,
)
from turnrl.envservice.http_guards import is_loopback
from turnrl.envservice.options import ServerLimits
from turnrl.envservice.protocol import (
    CLIENT_HEADER,
    APIError,
    EnvRaisedError,
    EnvSpecError,
    LimitError,
    NoServerError,
    RemoteEnvError,
    SessionLostError,
    answer_query,
    decode_item,
    encode_value,
)
from turnrl.envservice.request_bodies import (
    OpenBody,
    ResetBody,
    ResetItem,
    SessionsBody,
    StepBody,
    StepItem,
)
from turnrl.envservice.server import EnvServer, build_app, exposure_warning
from turnrl.policy.scripted import ExpertPolicy
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import DONE


# --------------------------------------------------------------------------- the server without HTTP
def test_the_server_class_answers_without_http():
    async def scenario() -> None:
        server = EnvServer([PROBE], limits=ServerLimits(max_sessions_per_client=2))
        server.start()
        try:
            assert (await server.open_sessions(OpenBody(env_id=PROBE, ids=["a"]), "me"))["sessions"] == ["a"]
            reset = await server.reset(ResetBody(items=[ResetItem(session="a", seq=1, seed=3, queries=["text"])]))
            local = ProbeEnv()
            obs, _ = local.reset(seed=3)
            result = decode_item("here", reset["items"][0], step=False)
            assert result.observation == obs and result.queries["text"] == local.text()
            step = await server.step(StepBody(items=[StepItem(session="a", seq=2, action="inc")]))
            again = await server.step(StepBody(items=[StepItem(session="a", seq=2, action="inc")]))
            assert again == step and server.metrics.steps == 1  # a retried step is answered, not applied again
            assert decode_item("here", step["items"][0], step=True).observation == local.step("inc")[0]
            with pytest.raises(APIError, match="unknown session") as caught:
                await server.step(StepBody(items=[StepItem(session="b", action="inc")]))
            assert caught.value.status == 404
            with pytest.raises(APIError, match="this client holds 1 sessions of at most 2"):
                await server.open_sessions(OpenBody(env_id=PROBE, count=2), "me")
            assert server.authorize("", "me", "10.0.0.1") == "me" and server.authorize("", None, None) == "unknown"
            assert (await server.close(SessionsBody(sessions=["a", "b"]))) == {"closed": ["a"], "unknown": ["b"]}
            assert server.health()["sessions"] == 0 and "image" in server.envs()["queries"]
        finally:
            server.shutdown()

    asyncio.run(scenario())


def test_the_server_class_checks_the_token():
    server = EnvServer([PROBE], token="s3cret")
    assert server.authorize("Bearer s3cret", None, "10.0.0.1") == "10.0.0.1"
    for header, words in (("", "bearer token"), ("Bearer guess", "wrong token"), ("Basic s3cret", "bearer token")):
        with pytest.raises(APIError, match=words):
            server.authorize(header, None, None)
    server.shutdown()


@pytest.fixture(scope="module")
def token_server():
    server = EnvServer([PROBE], token="s3cret")
    yield server
    server.shutdown()


_ANY_TEXT = st.text(st.characters(exclude_categories=()))  # lone surrogates too


@settings(max_examples=100, deadline=None)
@given(authorization=st.one_of(_ANY_TEXT, _ANY_TEXT.map("Bearer ".__add__), st.just("bearer  s3cret\t")),
       client=st.none() | _ANY_TEXT, peer=st.none() | st.just("10.0.0.1"))
@example(authorization="Bearer \ud800", client=None, peer=None)  # was UnicodeEncodeError (the token as UTF-8)
def test_any_authorization_and_client_header_is_a_client_name_or_a_401(token_server, authorization, client, peer):
    """The header values, any text (non-ASCII, control characters, lone surrogates, which HTTP's latin-1 never
    makes but a caller in process may): the client's name, or the server's 401, never another exception."""
    try:
        name = token_server.authorize(authorization, client, peer)
    except APIError as error:
        assert error.status == 401 and error.code == "unauthorized", error
        return
    assert authorization.partition(" ")[2].strip() == "s3cret"
    assert name == (client[:128] if client else peer or "unknown")


@pytest.mark.parametrize("token", ["clé", "", "trailing "])
def test_a_token_no_client_could_send_is_refused(token):
    """HTTP reads a header's bytes as latin-1 and strips its ends: such a token could never match."""
    with pytest.raises(ValueError, match="the token must be printable ASCII"):
        EnvServer([PROBE], token=token)


# --------------------------------------------------------------------------- the same env, here or there
@pytest.mark.parametrize(("env_id", "settings"), [
    ("Sokoban", {"mode": "image"}), ("FrozenLake", {"mode": "image"}), ("Countdown", {}), ("Bandit", {}),
    ("Maze2D", {"mode": "image"}),
])
def test_a_served_env_passes_the_env_checker(server, env_id, settings):
    env = remote_env_factory(env_id, settings, [server], **FAST)()
    check_env(env, seed=3)
    env.close()


def play(make_env, env_id: str, fmt_name: str, seeds: list[int]):
    fmt = get_format(fmt_name, max_actions_per_turn=2)
    agent = AgentConfig(format=fmt_name, max_actions_per_turn=2, max_turns=6, max_actions_per_episode=12)
    rollout = Rollout(ExpertPolicy(fmt, max_actions_per_turn=2, seed=0, random_action_share=0.3), fmt, agent, env_id)
    slots = [EpisodeSlot(env=make_env(), seed=seed, group=k) for k, seed in enumerate(seeds)]
    return rollout.run(slots, SamplingConfig())


@pytest.mark.parametrize(("env_id", "mode", "fmt_name"), [
    ("Sokoban", "text", "free_think"), ("Sokoban", "image", "grounding_worldmodeling"),
    ("FrozenLake", "text", "grounding_worldmodeling"), ("FrozenLake", "image", "free_think"),
])
def test_an_env_behind_a_server_gives_the_trajectories_of_the_same_env_in_process(server, env_id, mode, fmt_name):
    settings = {"mode": mode}
    seeds = [0, 1, 2, 3, 11, 12]
    here = play(lambda: make(env_id, **settings), env_id, fmt_name, seeds)
    there = play(remote_env_factory(env_id, settings, [server], **FAST), env_id, fmt_name, seeds)
    assert {t.status for t in here} <= {DONE, "truncated"} and any(t.success for t in here)
    for a, b in zip(here, there):
        same_trajectory(a, b)
    if mode == "image":
        assert there[0].images and there[0].images[0].shape[2] == 3 and there[0].images[0].dtype == np.uint8


def test_state_facts_and_info_round_trip_through_the_server(server):
    remote = remote_env_factory(PROBE, {}, [server], **FAST)()
    local = ProbeEnv()
    for env in (remote, local):
        env.reset(seed=5)
    a, b = remote.step("inc"), local.step("inc")
    assert a[0] == b[0] and a[1:4] == b[1:4]
    assert a[4]["pair"] == (b[4]["pair"]) and isinstance(a[4]["pair"], tuple)
    assert a[4]["half"] == 0.5 and np.array_equal(a[4]["row"], b[4]["row"]) and a[4]["row"].dtype == np.int64
    assert remote.state_facts() == local.state_facts()
    assert remote.instructions() == local.instructions() and remote.solve() == local.solve()
    assert remote.text() == local.text() and remote.state_key() == local.state_key()


def test_every_query_of_the_protocol_is_answered_over_http_as_in_process(server):
    remote = remote_env_factory(PROBE, {"mode": "image"}, [server], **FAST)()
    local = ProbeEnv(mode="image")
    for env in (remote, local):
        env.reset(seed=5)
        env.step("inc")
    assert np.array_equal(remote.image(), local.image()) and remote.action_budget() == local.action_budget()
    assert remote.action_names() == local.action_names()
    remote.close()


def test_a_deep_copy_forks_the_session_with_its_state(server):
    env = remote_env_factory(PROBE, {}, [server], **FAST)()
    env.reset(seed=1)
    env.step("inc")
    count = int(env.text().split("=")[1])
    twin = copy.deepcopy(env)
    assert twin.session_id != env.session_id
    twin.step("inc")
    twin.step("inc")
    assert twin.text() == f"count={count + 2}" and env.text() == f"count={count}"
    assert env.step("inc")[0]["text"] == f"count={count + 1}"


def test_a_collected_env_sends_nothing_then_and_its_session_closes_at_the_next_open(server):
    requests: list[str] = []

    def record(request: httpx.Request) -> None:
        requests.append(request.url.path)

    pool = EnvServerPool([server], ClientOptions(**FAST))
    pool.http.event_hooks["request"].append(record)
    env = RemoteEnv(pool, PROBE)
    env.reset(seed=0)
    gone = env.session_id
    del env
    gc.collect()
    # The garbage collector may run in the middle of one of this pool's requests: its finalizer must not send one.
    assert requests[-1] == "/v1/reset"
    other = RemoteEnv(pool, PROBE)
    other.reset(seed=0)
    assert "/v1/sessions/close" in requests
    closed = post(server, "/v1/step", {"items": [{"session": gone, "action": "inc"}]})
    assert closed.status_code == 404 and "closed by its client" in closed.json()["error"]["message"]
    assert other.step("inc")[0]["text"].startswith("count=")


def test_closing_a_factory_closes_every_session_its_envs_forks_and_batches_hold():
    with env_server() as url:  # a server of its own: its session count is this test's alone
        factory = remote_env_factory(PROBE, {}, [url], **FAST)
        envs = [factory() for _ in range(3)]
        for seed, env in enumerate(envs):
            env.reset(seed=seed)
        twin = copy.deepcopy(envs[0])  # forked on the server
        batch = RemoteEnvBatch(factory.pool, PROBE, {}, 4)
        batch.reset([0, 1, 2, 3])
        envs[1].close()  # closed already: closing it again is harmless
        assert httpx.get(url + "/health").json()["sessions"] == 3 - 1 + 1 + 4
        factory.close()
        assert httpx.get(url + "/health").json()["sessions"] == 0
        assert twin.session_id is not None  # the env object lives on; its session does not


def test_an_open_retried_while_the_first_still_builds_gets_the_same_session_and_one_env():
    opened: list[int] = []
    # NaN (not equal to itself) as a client sends it: a retry must still read as the same open.
    body = {"env_id": PROBE, "settings": encode_value({"build_s": 0.3, "delay_s": float("nan")}), "ids": ["s1"]}
    app = build_app([PROBE], limits=ServerLimits(max_sessions_per_client=2))

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         headers={CLIENT_HEADER: "alice"}) as client:
                first, again = await asyncio.gather(*(client.post("/v1/sessions", json=body) for _ in range(2)))
                assert first.status_code == again.status_code == 200, again.text
                assert first.json()["sessions"] == again.json()["sessions"] == ["s1"]
                server = app.state.server
                assert len(server.table) == 1 and server.table.per_owner == {"alice": 1}
                opened.append(server.metrics.sessions_opened)
                # Retried after it is done.
                retried = await client.post("/v1/sessions", json=body)
                assert retried.status_code == 200 and retried.json()["sessions"] == ["s1"], retried.text
                await client.post("/v1/sessions/close", json={"sessions": ["s1"]})
                assert server.table.per_owner == {}
                two = await client.post("/v1/sessions", json={"env_id": PROBE, "count": 2})
                assert two.status_code == 200, two.text  # the client's quota is whole again

    asyncio.run(scenario())
    assert opened == [1]


def test_concurrent_forks_keep_to_the_session_limit_and_a_retried_fork_gets_its_copies_again():
    app = build_app([PROBE], limits=ServerLimits(max_sessions=3))

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         headers={CLIENT_HEADER: "alice"}) as client:
                (source,) = (await client.post("/v1/sessions", json={"env_id": PROBE})).json()["sessions"]
                fork = {"sessions": [source], "ids": ["twin"]}
                answers = await asyncio.gather(*(client.post("/v1/sessions/fork", json=fork) for _ in range(2)))
                assert [a.json()["sessions"] for a in answers] == [["twin"], ["twin"]]  # one copy, answered twice
                server = app.state.server
                assert len(server.table) == 2 and server.table.per_owner == {"alice": 2}
                more = await asyncio.gather(*(client.post("/v1/sessions/fork", json={"sessions": [source]})
                                              for _ in range(3)))
                assert sorted(a.status_code for a in more) == [200, 429, 429]
                assert len(server.table) == 3 == server.limits.max_sessions
                taken = await client.post("/v1/sessions/fork", json={"sessions": ["twin"], "ids": [source]})
                assert taken.status_code == 400  # an id in use that is no copy of this session

    asyncio.run(scenario())


def test_many_sessions_step_in_one_request(server):
    pool = EnvServerPool([server], ClientOptions(**FAST))
    batch = RemoteEnvBatch(pool, PROBE, {"mode": "image"}, 8)
    local = [ProbeEnv(mode="image") for _ in range(8)]
    seeds = list(range(8))
    for env, seed, got in zip(local, seeds, batch.reset(seeds)):
        assert not isinstance(got, RemoteEnvError)
        want = env.reset(seed=seed)[0]
        assert got[0]["text"] == want["text"] and np.array_equal(got[0]["image"], want["image"])
    for _ in range(5):
        for env, got in zip(local, batch.step(["inc"] * 8)):
            obs, reward, terminated, truncated, info = env.step("inc")
            assert got.error is None and (got.observation["text"], got.reward, got.terminated) == (
                obs["text"], reward, terminated)
            assert np.array_equal(got.observation["image"], obs["image"])
    batch.close()
    assert all("reset first" in str(r.error) for r in batch.step(["inc"] * 8))
    with pytest.raises(SessionLostError, match="closed by its client"):
        batch.reset(seeds)


# --------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def guarded():
    limits = ServerLimits(max_body_bytes=4096, max_batch=4, max_sessions_per_client=3, max_sessions=5)
    with env_server(token="s3cret", limits=limits) as url:
        yield url


AUTH = {"authorization": "Bearer s3cret"}


def test_bad_input_is_a_4xx_that_says_what_is_wrong_and_the_server_stays_up(guarded):
    def call(path, body, headers=AUTH):
        return post(guarded, path, body, headers)

    session = open_one(guarded, headers=AUTH)
    cases = [
        (call("/v1/step", b"{not json"), 400, "not valid JSON"),
        (call("/v1/step", {"items": [{"session": "nope", "action": "inc"}]}), 404, "unknown session"),
        (call("/v1/sessions", {"env_id": "Chess"}), 400, "not served here"),
        (call("/v1/sessions", {"env_id": "Sokoban", "settings": {"size": 6, "colour": "red"}}), 400, "colour"),
        (call("/v1/sessions", {"env_id": "Sokoban", "settings": {"mode": "video"}}), 400, "unknown mode"),
        (call("/v1/step", b"[" * 5000), 413, "over 4096 bytes"),
        (call("/v1/sessions", {"env_id": PROBE}, headers={}), 401, "bearer token"),
        (call("/v1/sessions", {"env_id": PROBE}, headers={"authorization": "Bearer guess"}), 401, "wrong token"),
        (call("/v1/step", {"items": [{"session": session, "action": 3}]}), 400, "valid string"),
        (call("/v1/step", {"items": [{"session": session, "action": "inc"}]}), 409, "never reset"),
        (call("/v1/reset", {"items": [{"session": session, "seed": -1}]}), 400, "seed"),
        (call("/v1/reset", {"items": [{"session": session, "sead": 1}]}), 400, "sead"),
        (call("/v1/query", {"items": [{"session": session, "queries": ["render"]}]}), 400, "queries"),
        (call("/v1/step", {"items": [{"session": session, "action": "inc"}] * 2}), 400, "twice"),
        (call("/v1/step", {"items": [{"session": f"s{k}", "action": "inc"} for k in range(5)]}), 400, "at most 4"),
        (call("/v1/stepp", {}), 404, "/v1/stepp"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, (response.status_code, response.text)
        error = response.json()["error"]
        assert words in error["message"], error
    # A step after the episode ended, and a step numbered out of order.
    assert call("/v1/reset", {"items": [{"session": session, "seq": 1, "seed": 0}]}).status_code == 200
    assert call("/v1/step", {"items": [{"session": session, "seq": 5, "action": "inc"}]}).status_code == 409
    assert call("/v1/step", {"items": [{"session": session, "seq": 2, "action": "win"}]}).status_code == 200
    over = call("/v1/step", {"items": [{"session": session, "seq": 3, "action": "inc"}]})
    assert over.status_code == 409 and "ended" in over.json()["error"]["message"]
    health = httpx.get(guarded + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    headed = httpx.head(guarded + "/health")  # health checkers ask with HEAD: it answered 405
    assert headed.status_code == 200 and headed.content == b""
    metrics = httpx.get(guarded + "/metrics", headers=AUTH).text
    assert 'turnrl_env_errors_total{code="unauthorized"} 2' in metrics
    assert httpx.get(guarded + "/metrics").status_code == 401


def test_the_client_sends_the_token_from_its_options_or_the_environment(guarded, monkeypatch):
    monkeypatch.delenv("TURNRL_ENV_TOKEN", raising=False)
    with pytest.raises(NoServerError, match="bearer token"):
        remote_env_factory(PROBE, {}, [guarded], **FAST)
    with pytest.raises(NoServerError, match="wrong token"):
        remote_env_factory(PROBE, {}, [guarded], token="guess", **FAST)
    env = remote_env_factory(PROBE, {}, [guarded], token="s3cret", **FAST)()
    assert env.reset(seed=1)[0] == ProbeEnv().reset(seed=1)[0]
    env.close()
    monkeypatch.setenv("TURNRL_ENV_TOKEN", "s3cret")
    env = remote_env_factory(PROBE, {}, [guarded], **FAST)()
    assert env.reset(seed=1)[0] == ProbeEnv().reset(seed=1)[0]
    env.close()


def test_the_client_names_a_refused_env_or_setting_as_a_value_error(server):
    with pytest.raises(EnvSpecError, match="not served here"):
        remote_env_factory("Chess", {}, [server], **FAST)
    with pytest.raises(ValueError, match="colour"):
        remote_env_factory("Sokoban", {"colour": "red"}, [server], **FAST)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                   lambda inner: st.lists(inner, max_size=3)
                                   | st.dictionaries(st.sampled_from(["items", "session", "action", "seq", "env_id",
                                                                      "settings", "queries", "sessions"]), inner,
                                                     max_size=4),
                                   max_leaves=12).map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(["/v1/reset", "/v1/step", "/v1/query", "/v1/sessions", "/v1/sessions/close",
                             "/v1/sessions/fork", "/v1/validate"]))
def test_any_body_on_any_endpoint_is_answered_without_a_server_error(fuzz_client, body, path):
    response = fuzz_client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    assert fuzz_client.get("/health").status_code == 200


@pytest.fixture(scope="module")
def fuzz_client():
    with TestClient(build_app(["Bandit"], limits=ServerLimits(max_sessions=50))) as client:
        yield client


def test_hostile_settings_and_options_get_a_one_line_400_and_the_server_stays_up(fuzz_client, default_recursion_limit):
    """Settings nested deeper than Python's recursion (JSON's parser lets 700 levels through), a lone surrogate
    as a setting's name (quoted in the error, which UTF-8 cannot write), an infinite setting (``int(inf)`` raises
    OverflowError) and a large array setting (quoted whole, over many lines) are each a 400 of one short line."""
    session = fuzz_client.post("/v1/sessions", json={"env_id": "Bandit"}).json()["sessions"][0]
    array = {"$array": {"dtype": "uint8", "shape": [300, 300], "data": base64.b64encode(bytes(90_000)).decode()}}
    cases = [
        ("/v1/sessions", b'{"env_id": "Bandit", "settings": {"a": ' + b"[" * 700 + b"]" * 700 + b"}}",
         "settings cannot be read: it is nested too deep"),
        ("/v1/reset", b'{"items": [{"session": "' + session.encode() + b'", "options": {"a": ' + b"[" * 700
         + b"]" * 700 + b"}}]}", "options cannot be read: it is nested too deep"),
        ("/v1/sessions", b'{"env_id": "Bandit", "settings": {"\\udfff": 1}}', "no setting \\udfff"),
        ("/v1/validate", b'{"env_id": "Bandit", "settings": {"max_steps": Infinity}}', "max_steps must be an int, got a float: inf"),
        ("/v1/validate", b'{"env_id": "Bandit", "a\\nb\\u2028c": 1}', "a b c: Extra inputs are not permitted"),
        ("/v1/sessions", json.dumps({"env_id": "Bandit", "settings": {"img": array}}).encode(), "has no setting img"),
    ]
    for path, body, words in cases:
        response = fuzz_client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert words in message and "\n" not in message and len(message) < 600, message
    assert fuzz_client.get("/health").status_code == 200


def test_validate_resets_the_env_so_that_what_only_a_reset_refuses_is_a_bad_setting():
    """A 2048 target that the first tiles of a 3x3 board can never make is refused at reset, not at build: the
    check a client runs before it opens sessions passed it, and every session's first reset then failed."""
    with TestClient(build_app(["Game2048"])) as client:
        refused = client.post("/v1/validate", json={"env_id": "Game2048", "settings": {"size": 3, "target_tile": 2048}})
        error = refused.json()["error"]
        assert (refused.status_code, error["code"]) == (400, "bad_settings"), refused.text
        assert "its first reset refused them: target_tile=2048 can never be made on a 3x3 board" in error["message"]
        checked = client.post("/v1/validate", json={"env_id": "Game2048", "settings": {"size": 3, "target_tile": 8}})
        assert checked.status_code == 200 and checked.json()["ok"], checked.text


def test_a_count_of_sessions_over_the_batch_limit_is_refused_before_any_id_is_made(fuzz_client, monkeypatch):
    """``count: 10**12`` once made 10**12 ids on the event loop (memory without bound) before the limit."""
    made = []
    real_uuid4 = uuid.uuid4
    monkeypatch.setattr(uuid, "uuid4", lambda: made.append(1) or real_uuid4())
    response = fuzz_client.post("/v1/sessions", json={"env_id": "Bandit", "count": 10**6})
    assert response.status_code == 400 and "1000000 sessions in one request; at most 1024" in response.text
    assert not made


def test_sessions_closed_are_counted_by_a_reason_without_punctuation():
    """The reason label read ``client:`` and ``env_error:``, not the ``client`` and ``env_error`` documented."""
    async def scenario() -> None:
        server = EnvServer([PROBE])
        server.start()
        try:
            await opened(server, PROBE, ["a", "b"])
            await server.step(step_items(["b"], ["explode"]))
            # /health counts the resets beside the steps: a run whose model finds no valid action steps nothing.
            assert {key: server.health()[key] for key in ("resets", "steps", "errors")} == \
                {"resets": 2, "steps": 1, "errors": 1}
            await server.close(SessionsBody(sessions=["a"]))
            metrics = server.prometheus()
            assert 'turnrl_env_sessions_closed_total{reason="client"} 1' in metrics
            assert 'turnrl_env_sessions_closed_total{reason="env_error"} 1' in metrics
        finally:
            server.shutdown()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- limits
def test_session_limits_answer_429_and_the_client_moves_to_a_server_with_room():
    limits = ServerLimits(max_sessions_per_client=2, max_sessions=3)
    with env_server(limits=limits) as full, env_server() as roomy:
        pool = EnvServerPool([full], ClientOptions(client_id="a", **FAST))
        held = [RemoteEnv(pool, PROBE) for _ in range(2)]  # kept: a collected env closes its session
        for env in held:
            env.reset(seed=0)
        with pytest.raises(RemoteEnvError, match="max-sessions-per-client"):
            RemoteEnv(pool, PROBE).reset(seed=0)
        other = EnvServerPool([full], ClientOptions(client_id="b", **FAST))
        held.append(RemoteEnv(other, PROBE))
        held[-1].reset(seed=0)
        with pytest.raises(RemoteEnvError, match=r"at most 3 \(--max-sessions\)"):
            RemoteEnv(other, PROBE).reset(seed=0)
        with pytest.raises(LimitError):
            other.post(full, "/v1/sessions", {"env_id": PROBE})
        both = EnvServerPool([full, roomy], ClientOptions(client_id="a", **FAST))
        env = RemoteEnv(both, PROBE)
        env.reset(seed=0)
        assert env.server == roomy


def test_idle_sessions_are_closed_and_saying_so():
    with env_server(limits=ServerLimits(idle_timeout_s=0.2)) as url:
        session = open_one(url)
        time.sleep(0.6)
        response = post(url, "/v1/reset", {"items": [{"session": session}]})
        assert response.status_code == 404 and "idle for more than 0.2 s" in response.json()["error"]["message"]
        assert 'turnrl_env_sessions_closed_total{reason="idle"} 1' in httpx.get(url + "/metrics").text
        # A RemoteEnv whose session was reaped between episodes just opens another.
        env = remote_env_factory(PROBE, {}, [url], **FAST)()
        env.reset(seed=0)
        time.sleep(0.6)
        assert env.reset(seed=2)[0] == ProbeEnv().reset(seed=2)[0]
        with pytest.raises(SessionLostError, match="idle"):
            time.sleep(0.6)
            env.step("inc")


def test_the_state_key_of_an_env_without_one_is_the_rollouts_hash_of_its_observation():
    from turnrl.rollout.runner import turn_state_key

    obs = {"text": "a board", "image": np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)[:, ::-1]}
    assert observation_key(obs) == turn_state_key(object(), obs)  # type: ignore[arg-type]
    assert observation_key({"text": "x"}) == turn_state_key(object(), {"text": "x"})  # type: ignore[arg-type]
    assert answer_query(object(), "state_key", obs) == observation_key(obs)  # type: ignore[arg-type]


def test_an_env_without_a_step_limit_answers_no_budget():
    """A Gymnasium env without max_episode_steps names no budget; the query passes None on, not int(None)."""
    cliff = make("gym:CliffWalking-v1")
    assert answer_query(cliff, "action_budget", {}) is None
    assert answer_query(make("gym:FrozenLake-v1"), "action_budget", {}) == 100


def test_loopback_and_the_warning_for_an_open_server_without_a_token():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("0.0.0.0", "t") is None
    assert "--token" in exposure_warning("0.0.0.0", None)


# --------------------------------------------------------------------------- exactly once
def test_a_step_whose_answer_was_lost_is_retried_and_applied_once(server):
    lossy = LoseAnswers(lambda request: request.url.path == "/v1/step" and lossy.lost < 3)
    pool = EnvServerPool([server], ClientOptions(retries=3, backoff_s=0.01), transport=lossy)
    env, local = RemoteEnv(pool, PROBE), ProbeEnv()
    assert env.reset(seed=4)[0] == local.reset(seed=4)[0]
    for _ in range(5):
        assert env.step("inc")[0] == local.step("inc")[0]
    assert lossy.lost == 3 and env.text() == local.text()


def test_a_batch_step_whose_env_raised_and_whose_answer_was_lost_gets_each_item_and_goes_on(server):
    """The retry of a batch step in which one env raised (its session then closed) answers that item with its
    error again and the others with their steps (applied once); the batch opens a new session for it after."""
    lossy = LoseAnswers(lambda request: request.url.path == "/v1/step" and lossy.lost < 1)
    pool = EnvServerPool([server], ClientOptions(retries=3, backoff_s=0.01), transport=lossy)
    batch, local = RemoteEnvBatch(pool, PROBE, {}, 3), [ProbeEnv() for _ in range(3)]
    assert [obs for obs, _ in batch.reset([0, 1, 2])] == [env.reset(seed=k)[0] for k, env in enumerate(local)]
    first, exploded, third = batch.step(["inc", "explode", "inc"])
    assert lossy.lost == 1
    assert isinstance(exploded.error, EnvRaisedError) and "the probe exploded" in str(exploded.error)
    assert first.error is None and first.observation == local[0].step("inc")[0]
    assert third.error is None and third.observation == local[2].step("inc")[0]
    assert [obs for obs, _ in batch.reset([0, 1, 2])] == [env.reset(seed=k)[0] for k, env in enumerate(local)]
    pool.close()


def test_a_call_that_reuses_the_last_number_with_another_request_is_refused_not_answered_from_the_record(server):
    """Only a retry (the same request again) is answered from the record of the last call: a call with its number
    and another action must not get the first action's answer while its own is never applied."""
    session = open_one(server)

    def call(path: str, seq: int, **fields) -> httpx.Response:
        return post(server, path, {"items": [{"session": session, "seq": seq, **fields}]})

    assert call("/v1/reset", 1, seed=0).status_code == 200
    first = call("/v1/step", 2, action="inc")
    assert first.status_code == 200 and call("/v1/step", 2, action="inc").json() == first.json()
    other = call("/v1/step", 2, action="win")
    assert other.status_code == 409 and "another request" in other.json()["error"]["message"]
    assert call("/v1/reset", 2, seed=0).status_code == 409
    count = int(first.json()["items"][0]["observation"]["text"].split("=")[1])
    assert call("/v1/step", 3, action="inc").json()["items"][0]["observation"]["text"] == f"count={count + 1}"
    # The same for a step whose env raised (its session then closed): its retry gets its error item again.
    exploded = call("/v1/step", 4, action="explode")
    assert exploded.json()["items"][0]["ok"] is False
    assert call("/v1/step", 4, action="explode").json() == exploded.json()
    gone = call("/v1/step", 4, action="inc")
    assert gone.status_code == 404 and "its env raised" in gone.json()["error"]["message"]


def test_a_step_applied_whose_answer_failed_ends_its_episode_and_the_next_reset_starts_afresh(server):
    """A step the server applied but whose answer was a 500: the episode ends with the error, the session is
    closed at the next open, and the env resets and steps again in a new session (the old one's numbering is no
    longer known, and the server would refuse its resets as out of order)."""
    spoiled = SpoilAnswers(lambda request: request.url.path == "/v1/step" and spoiled.lost < 1)
    pool = EnvServerPool([server], ClientOptions(**FAST), transport=spoiled)
    env, local = RemoteEnv(pool, PROBE), ProbeEnv()
    env.reset(seed=4)
    first = env.session_id
    with pytest.raises(RemoteEnvError, match="HTTP 500"):
        env.step("inc")
    assert env.reset(seed=5)[0] == local.reset(seed=5)[0]
    assert env.step("inc")[0] == local.step("inc")[0] and env.session_id != first
    gone = post(server, "/v1/query", {"items": [{"session": first, "queries": ["text"]}]})
    assert gone.status_code == 404 and "closed by its client" in gone.json()["error"]["message"]
    pool.close()


def test_a_batch_resets_after_a_failed_answer_and_after_a_finished_session_went_idle():
    with env_server(limits=ServerLimits(idle_timeout_s=0.3)) as url:
        spoiled = SpoilAnswers(lambda request: request.url.path == "/v1/step" and spoiled.lost < 1)
        pool = EnvServerPool([url], ClientOptions(**FAST), transport=spoiled)
        batch, local = RemoteEnvBatch(pool, PROBE, {}, 2), [ProbeEnv() for _ in range(2)]

        def reset_both(seeds: list[int]) -> None:
            assert [obs for obs, _ in batch.reset(seeds)] == [env.reset(seed=s)[0] for env, s in zip(local, seeds)]

        # 1. The server applied a step whose answer was a 500: the next reset starts both afresh.
        reset_both([0, 1])
        with pytest.raises(RemoteEnvError, match="HTTP 500"):
            batch.step(["inc", "inc"])
        reset_both([2, 3])
        # 2. The first episode ends; the second goes on past the idle timeout, and the server closes the first.
        assert batch.step(["win", "inc"])[0].terminated
        for _ in range(8):
            time.sleep(0.1)
            assert batch.step(["inc", "inc"])[1].error is None
        reset_both([4, 5])
        assert all(got.observation == env.step("inc")[0] for got, env in zip(batch.step(["inc", "inc"]), local))
        pool.close()


def test_env_text_that_utf8_cannot_encode_crosses_as_it_is():
    """An env's text with a lone surrogate (here an action it echoes) crosses as it is: UTF-8 cannot encode it,
    and the answer of the applied step must not fail as a 500."""
    with env_server(envs=[ECHO]) as url:
        pool = EnvServerPool([url], ClientOptions(**FAST))
        env, local = RemoteEnv(pool, ECHO), EchoEnv()
        assert env.reset(seed=0)[0] == local.reset(seed=0)[0]
        for action in ["go", "x\udfff", "y"]:
            assert env.step(action)[0] == local.step(action)[0]
        pool.close()
