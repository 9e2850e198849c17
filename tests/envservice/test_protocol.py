"""The env protocol on its own: the lossless value encoding, state facts, and decoders that take any input.
(The client: tests/envservice/test_client.py; with a real server: tests/envservice/test_server.py.)"""

from __future__ import annotations

import base64
import io
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image

from tests.envs.toy_envs import Corridor, CorridorWithExtras
from turnrl.envs import contract, make
from turnrl.envs.contract import ObjectFact, StateFacts, observation_key
from turnrl.envservice.protocol import (
    QUERIES,
    QueriedEnv,
    RemoteEnvError,
    answer_query,
    decode_facts,
    decode_item,
    decode_observation,
    decode_value,
    encode_facts,
    encode_value,
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


@pytest.mark.parametrize("bad", [
    {"$float": "1.5"}, {"$tuple": 3}, {"$dict": [[1]]}, {"$dict": [[[1], 2]]}, {"$png": "not base64!"},
    {"$png": "aGVsbG8="}, {"$array": {"dtype": "O", "shape": [1], "data": ""}},
    {"$array": {"dtype": "<f4", "shape": [3], "data": "AAAA"}}, {"$x": 1}, {"$repr": 5}, b"bytes",
])
def test_malformed_encodings_are_named(bad):
    with pytest.raises(ValueError):
        decode_value(bad)


def test_a_png_that_would_decode_past_the_bound_is_refused_from_its_header():
    """A PNG of one colour is tiny on the wire whatever its size: its header is read, not its pixels."""
    buffer = io.BytesIO()
    Image.new("L", (4097, 4096)).save(buffer, format="PNG")
    assert len(buffer.getvalue()) < 100_000
    with pytest.raises(ValueError, match="4097 x 4096 is more than the 16,777,216 pixels a \\$png may have"):
        decode_value({"$png": base64.b64encode(buffer.getvalue()).decode()})


def test_the_query_list_is_the_contracts_declared_queries():
    """Both transports take their query list from the env contract's one declaration: every method marked a
    query there, each optional one that takes no argument and changes nothing among them."""
    assert QUERIES == contract.QUERIES
    assert set(contract.REQUIRED_METHODS) - {"reset", "step"} <= set(QUERIES)
    assert set(contract.OPTIONAL_METHODS) - set(QUERIES) == {"canonical_action", "close"}


@pytest.mark.parametrize("name", QUERIES)
def test_a_queried_env_asks_for_every_query(name):
    class Recorder(QueriedEnv):
        def _query(self, asked):
            return f"answer to {asked}"

    assert getattr(Recorder(), name)() == f"answer to {name}"
    assert not hasattr(Recorder(), "canonical_action")  # not a query: the proxy does not offer it


def test_a_queried_envs_methods_are_exactly_the_contracts_queries():
    """The proxy's typed methods, written out, are the declared queries: a query added to the contract and not
    here (or one here the contract dropped) fails this test."""
    public = {name for name, value in vars(QueriedEnv).items() if callable(value) and not name.startswith("_")}
    assert public == set(QUERIES)


@pytest.mark.parametrize(("env", "expected"), [
    (Corridor(), {"state_key": None, "text": "", "action_budget": None}),
    (CorridorWithExtras(), {"state_key": "at 3", "text": "___P_", "action_budget": 4}),
])
def test_an_env_answers_its_own_optional_queries_or_their_defaults(env, expected):
    obs, _ = env.reset(seed=0)
    expected["state_key"] = expected["state_key"] or observation_key(obs)
    assert {name: answer_query(env, name, obs) for name in expected} == expected
    if isinstance(env, CorridorWithExtras):
        assert answer_query(env, "image", obs).shape == (2, 5, 3)
    else:
        with pytest.raises(NotImplementedError, match="offers no image"):
            answer_query(env, "image", obs)
