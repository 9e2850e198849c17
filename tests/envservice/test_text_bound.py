"""An env that lives on an env server answers ``max_text_length()`` as a query of the contract: its bound on an
observation's text crosses to the client, and a rollout against the remote env plays the long texts it allows."""

from __future__ import annotations

import pytest

from tests.envservice.env_helpers import FAST, PROBE, ProbeEnv, env_server, open_one, post
from tests.rollout.test_runner import TextPolicy, answer, play
from turnrl.envs.contract import MAX_TEXT_LENGTH, max_text_length_of
from turnrl.envservice.client import remote_env_factory
from turnrl.envservice.protocol import decode_queries
from turnrl.rollout.runner import EpisodeSlot
from turnrl.rollout.trajectory import TRUNCATED

LONG = "tests.envservice.test_text_bound:LongPagesEnv"


class LongPagesEnv(ProbeEnv):
    """The probe whose every text carries a page of 20,000 characters, under a bound of its own."""

    def max_text_length(self) -> int:
        return 32_768

    def text(self) -> str:
        return f"{super().text()} {'#' * 20_000}"


@pytest.fixture(scope="module")
def long_server():
    with env_server(envs=[LONG, PROBE]) as url:
        yield url


@pytest.mark.parametrize(("env_id", "bound"), [(LONG, 32_768), (PROBE, MAX_TEXT_LENGTH)], ids=["own", "default"])
def test_the_server_answers_the_bound_as_a_query(long_server, env_id, bound):
    session = open_one(long_server, env_id)
    reply = post(long_server, "/v1/query", {"items": [{"session": session, "queries": ["max_text_length"]}]})
    assert reply.status_code == 200, reply.text
    (item,) = reply.json()["items"]
    assert decode_queries(long_server, item["queries"]) == {"max_text_length": bound}


def test_a_remote_envs_bound_reaches_the_rollout_which_plays_its_long_texts(long_server):
    remote = remote_env_factory(LONG, {}, [long_server], **FAST)()
    remote.reset(seed=0)
    assert max_text_length_of(remote) == 32_768
    (trajectory,) = play(TextPolicy(answer("inc")), [EpisodeSlot(env=remote, seed=0)], max_turns=2)
    assert trajectory.error is None and trajectory.status == TRUNCATED and len(trajectory.turns) == 2
    assert all("#" * 20_000 in turn.observation for turn in trajectory.turns)
    remote.close()


def test_a_prefetched_bound_comes_with_the_reset(long_server):
    """Asked once an episode right after its reset, the bound can travel with the reset's answer: no request of its
    own."""
    remote = remote_env_factory(LONG, {}, [long_server], **FAST, prefetch=("max_text_length",))()
    paths: list[str] = []
    remote.pool.http.event_hooks["request"].append(lambda request: paths.append(request.url.path))
    remote.reset(seed=0)
    assert max_text_length_of(remote) == 32_768
    assert "/v1/query" not in paths and "/v1/reset" in paths
    remote.close()
