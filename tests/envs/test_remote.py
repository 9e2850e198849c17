"""The remote env client on its own: the lossless value encoding, parsers that take any input, options,
and what a client does when no server answers. (With a real server: tests/serve/test_env_service.py.)"""

from __future__ import annotations

import json
import math
import time

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from turnrl.envs import make
from turnrl.envs.base import ObjectFact, StateFacts
from turnrl.envs.remote import (
    ClientOptions,
    EnvServerPool,
    NoServerError,
    RemoteEnv,
    RemoteEnvError,
    ServerUnavailableError,
    decode_facts,
    decode_item,
    decode_observation,
    decode_value,
    encode_facts,
    encode_value,
    parse_answer,
    remote_env_factory,
)


def wire(value):
    """``value`` as it arrives at the other end: encoded, dumped as strict JSON, loaded, decoded."""
    return decode_value(json.loads(json.dumps(encode_value(value), allow_nan=False)))


def same(a, b) -> bool:
    """Equality that also holds for nan, compares arrays exactly (dtype included) and tells tuples from lists."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


keys = st.one_of(st.text(max_size=6), st.integers(-5, 5), st.sampled_from(["$tuple", "$png", "$x", "$"]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=10))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_any_value_crosses_the_wire_unchanged(value):
    assert same(wire(value), value)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(st.sampled_from([np.uint8, np.int64, np.float32, np.float64, np.bool_, np.int16]),
                  hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)))
def test_any_numeric_array_crosses_the_wire_unchanged(array):
    assert same(wire(array), array)


@pytest.mark.parametrize("shape", [(5, 7, 3), (1, 1, 3), (64, 48, 3), (9, 4), (6, 6, 4)])
def test_images_travel_as_png_and_come_back_exactly(shape):
    image = np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)
    encoded = encode_value({"text": "t", "image": image[::-1]})  # a non-contiguous view, as envs may return
    assert set(encoded["image"]) == {"$png"}
    back = decode_observation(json.loads(json.dumps(encoded)))["image"]
    assert same(back, image[::-1]) and back.flags.writeable


def test_numpy_scalars_become_python_numbers():
    assert same(wire({"r": np.float32(0.5), "n": np.int64(3), "b": np.bool_(True)}), {"r": 0.5, "n": 3, "b": True})


def test_objects_json_cannot_hold_travel_as_their_repr():
    assert wire({"f": len, "s": {1, 2}}) == {"f": repr(len), "s": repr({1, 2})}


@pytest.mark.parametrize(("env_id", "settings"), [("Sokoban", {}), ("FrozenLake", {}), ("Countdown", {}),
                                                   ("Bandit", {}), ("Maze2D", {})])
def test_state_facts_of_every_builtin_env_round_trip(env_id, settings):
    env = make(env_id, **settings)
    for seed in range(5):
        env.reset(seed=seed)
        facts = env.state_facts()
        assert decode_facts(json.loads(json.dumps(encode_facts(facts)))) == facts


def test_state_facts_keep_tuples_and_types():
    facts = StateFacts(player=(1, 2), objects=(ObjectFact("box", (0, 3), "above", "right"),),
                       extra={"numbers": (1, 2), "target": 24, "ratio": float("inf")})
    back = decode_facts(json.loads(json.dumps(encode_facts(facts))))
    assert back == facts and isinstance(back.extra["numbers"], tuple) and back.player == (1, 2)


# --------------------------------------------------------------------------- parsers take anything
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["$float", "$tuple", "$dict", "$png", "$array", "$repr", "$x", "a", "text",
                                       "image", "player", "objects", "extra", "ok", "error", "observation", "info",
                                       "reward", "terminated", "truncated", "queries", "dtype", "shape", "data",
                                       "code", "message", "state_facts", "action_names"]), inner, max_size=5),
    max_leaves=15,
)


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_decoders_take_any_json_and_raise_only_value_error(data):
    for decode in (decode_value, decode_facts, decode_observation):
        try:
            decode(data)
        except ValueError:
            pass


@settings(max_examples=300, deadline=None)
@given(json_values, st.booleans())
def test_an_answer_item_of_any_shape_decodes_or_raises_a_remote_env_error(data, step):
    try:
        decode_item("http://server", data, step)
    except RemoteEnvError:
        pass


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


@pytest.mark.parametrize("bad", [
    {"$float": "1.5"}, {"$tuple": 3}, {"$dict": [[1]]}, {"$dict": [[[1], 2]]}, {"$png": "not base64!"},
    {"$png": "aGVsbG8="}, {"$array": {"dtype": "O", "shape": [1], "data": ""}},
    {"$array": {"dtype": "<f4", "shape": [3], "data": "AAAA"}}, {"$x": 1}, {"$repr": 5}, b"bytes",
])
def test_malformed_encodings_are_named(bad):
    with pytest.raises(ValueError):
        decode_value(bad)


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
    start = time.monotonic()
    with pytest.raises(NoServerError, match="turnrl serve-env") as caught:
        remote_env_factory("Sokoban", {}, urls, retries=2, backoff_s=0.01)
    assert set(caught.value.reasons) == set(urls) and all("3 tries" in r for r in caught.value.reasons.values())
    assert time.monotonic() - start < 5


def test_building_a_remote_env_never_fails_but_its_reset_says_why():
    pool = EnvServerPool([closed_port()], ClientOptions(retries=0))
    env = RemoteEnv(pool, "Sokoban")  # the rollout builds envs outside its error handling
    assert env.server is None
    with pytest.raises(RemoteEnvError, match="no env server could open"):
        env.reset(seed=0)
    with pytest.raises(RemoteEnvError, match="reset"):
        env.step("Up")


def test_retries_back_off_and_a_server_that_did_not_answer_is_tried_last():
    dead, other = closed_port(), closed_port()
    pool = EnvServerPool([dead, other], ClientOptions(retries=3, backoff_s=0.05, max_backoff_s=0.1))
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="4 tries"):
        pool.post(dead, "/v1/step", {})
    waited = time.monotonic() - start
    assert 0.05 + 0.1 + 0.1 <= waited < 3  # 0.05, then 0.1 and 0.1 (capped), each with up to 50% jitter
    assert pool.order(0) == [other, dead]
