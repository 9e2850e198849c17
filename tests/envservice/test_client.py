"""The remote env client on its own: answers of any shape, options, and what a client does when no server
answers. (The encoding: tests/envservice/test_protocol.py; with a real server: tests/envservice/test_server.py.)"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.envservice.test_protocol import json_values
from turnrl.envservice.client import ClientOptions, EnvServerPool, RemoteEnv, parse_answer, remote_env_factory
from turnrl.envservice.protocol import NoServerError, RemoteEnvError, ServerUnavailableError

ANSWERING = EnvServerPool(["http://server:1"])
"""Only its answer parsing is used (building a pool per example costs an SSL context each)."""


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 json_values.map(json.dumps)), st.sampled_from([200, 400, 404, 409, 429, 500]))
def test_any_answer_body_is_parsed_or_refused_with_a_remote_env_error(body, status):
    response = httpx.Response(status, content=body.encode("utf-8", "surrogatepass"))
    try:
        answer = ANSWERING._answer("http://server:1", response)
        assert isinstance(answer, dict) and status < 400
    except RemoteEnvError:
        pass
    try:
        parse_answer(response)
    except RemoteEnvError:
        pass


# --------------------------------------------------------------------------- options and dead servers
@pytest.mark.parametrize(("urls", "words"), [
    ([], "non-empty list"), ("http://a:1", "non-empty list"), (["ftp://a"], "http://host:port"),
    (["localhost:8100"], "http://host:port"), (["http://"], "http://host:port"),
])
def test_bad_server_urls_are_refused_with_the_form_to_use(urls, words):
    with pytest.raises(ValueError, match=words):
        EnvServerPool(urls)


@pytest.mark.parametrize(("options", "words"), [
    ({"timeout_s": 0}, "timeouts"), ({"retries": -1}, "retries"), ({"prefetch": ("render",)}, "render"),
])
def test_bad_options_are_refused(options, words):
    with pytest.raises(ValueError, match=words):
        ClientOptions(**options)


def test_unknown_factory_options_are_named():
    with pytest.raises(ValueError, match="timeout"):
        remote_env_factory("Sokoban", {}, ["http://127.0.0.1:9"], timeout=3)


def closed_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_no_server_answering_is_one_clear_error_listing_each_server():
    urls = [closed_port(), closed_port()]
    with pytest.raises(NoServerError, match="turnrl serve-env") as caught:
        remote_env_factory("Sokoban", {}, urls, retries=2, backoff_s=0.01)
    assert set(caught.value.reasons) == set(urls) and all("3 tries" in r for r in caught.value.reasons.values())
    assert all("ConnectError" in reason for reason in caught.value.reasons.values()), "refused, not timed out"


def test_building_a_remote_env_never_fails_but_its_reset_says_why():
    pool = EnvServerPool([closed_port()], ClientOptions(retries=0))
    env = RemoteEnv(pool, "Sokoban")  # the rollout builds envs outside its error handling
    assert env.server is None
    with pytest.raises(RemoteEnvError, match="no env server could open"):
        env.reset(seed=0)
    with pytest.raises(RemoteEnvError, match="reset"):
        env.step("Up")


def test_retries_back_off_and_a_server_that_did_not_answer_is_tried_last(monkeypatch):
    dead, other = closed_port(), closed_port()
    pool = EnvServerPool([dead, other], ClientOptions(retries=3, backoff_s=0.05, max_backoff_s=0.1))
    waits: list[float] = []
    real_sleep = time.sleep

    def recorded_sleep(seconds: float) -> None:  # still sleeps: the waits themselves are what is checked
        waits.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded_sleep)
    with pytest.raises(ServerUnavailableError, match="4 tries"):
        pool.post(dead, "/v1/step", {})
    # 0.05, then 0.1 and 0.1 (doubled, capped at max_backoff_s), each with up to 50% jitter.
    assert len(waits) == 3
    assert 0.05 <= waits[0] <= 0.075 and all(0.1 <= wait <= 0.15 for wait in waits[1:]), waits
    assert pool.order(0) == [other, dead]
