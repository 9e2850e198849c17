"""The env protocol, written once: what an env that lives elsewhere answers, and how its answers cross.

An env can live in another process: on a ``turnrl serve-env`` server (:mod:`turnrl.envservice.server`,
reached over HTTP by :mod:`turnrl.envservice.client`) or in a Ray actor (:mod:`turnrl.envservice.ray`). Both
sides of both transports take from here:

- **the queries**: the read-only calls such an env answers (:data:`QUERIES`, the methods the contract in
  :mod:`turnrl.envs.contract` marks as queries), those every reset and step brings back (:data:`RESET_QUERIES`,
  :data:`STEP_QUERIES`), how the place where the env lives answers one (:func:`answer_query`: optional
  methods of the contract included, with their defaults), and the proxy's side of them (:class:`QueriedEnv`);
- **the encoding** of values over HTTP (:func:`encode_value`: tuples stay tuples, non-finite floats survive,
  images travel as PNG and come back as the same ``HxWx3`` uint8 arrays), of state facts, and of the answer
  items of a reset or a step (:func:`reset_item`, :func:`step_item`, :func:`error_item`, :func:`decode_item`);
- **the errors**: what a proxy raises (:class:`RemoteEnvError` and its kinds) and what a server answers
  (:class:`APIError`);
- **the headers** and the token's environment variable.

Ray moves Python objects itself, so only the HTTP transport encodes; the queries, the answers and the errors
are the same for both.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from turnrl.envs import contract
from turnrl.envs.contract import AgentEnv, ObjectFact, StateFacts, state_key

TOKEN_ENV_VAR = "TURNRL_ENV_TOKEN"
"""Environment variable read for the bearer token when none is passed (by the server and the client)."""
CLIENT_HEADER = "x-turnrl-client"
"""Header naming the client, for the server's per-client session limit (else the peer address counts)."""

QUERIES: tuple[str, ...] = contract.QUERIES
"""The read-only calls an env that lives elsewhere answers (none changes the env's state), in order: the
methods of the env contract marked as queries (:data:`turnrl.envs.contract.QUERIES`)."""
STEP_QUERIES: tuple[str, ...] = ("action_names", "state_key")
"""Queries every step brings back: what the rollout asks each turn (``action_names`` outside its error
handling, so it must never need a request of its own)."""
RESET_QUERIES: tuple[str, ...] = ("instructions", "action_names", "state_key", "max_text_length")
"""Queries every reset brings back (the rollout asks each of these once an episode, at its reset)."""


def queries_to_bring(base: tuple[str, ...], prefetch: tuple[str, ...]) -> list[str]:
    """``base`` then ``prefetch``, each query once: what a reset or step asks to bring back."""
    return list(dict.fromkeys(base + prefetch))


def check_prefetch(prefetch: tuple[str, ...]) -> None:
    """ValueError naming the queries of ``prefetch`` that are not :data:`QUERIES`."""
    unknown = sorted(set(prefetch) - set(QUERIES))
    if unknown:
        raise ValueError(f"prefetch names unknown queries {unknown}; choose from {list(QUERIES)}")


def check_query(name: str) -> str:
    """``name`` if it is one of :data:`QUERIES`, else a ValueError that lists them."""
    if name not in QUERIES:
        raise ValueError(f"unknown query {name!r}; choose from {list(QUERIES)}")
    return name


# --------------------------------------------------------------------------- errors
class RemoteEnvError(RuntimeError):
    """A remote env cannot do what was asked; the episode in progress (if any) cannot go on."""


class EnvRaisedError(RemoteEnvError):
    """The env raised where it lives; its session there is closed (the next reset opens another)."""


class SessionLostError(RemoteEnvError):
    """The session's server died, restarted or closed it (idle too long): the episode's state is gone."""


class ServerUnavailableError(RemoteEnvError):
    """A server did not answer (refused, timed out, broken connection or 502/503/504) after every retry."""


class NoServerError(RemoteEnvError):
    """No server of the pool could open a session; ``reasons`` holds each one's error."""

    def __init__(self, message: str, reasons: dict[str, str]) -> None:
        super().__init__(message)
        self.reasons = reasons


class RequestError(RemoteEnvError):
    """The server refused a request (a 4xx): ``status``, its error ``code`` and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} (HTTP {status}, {code})")
        self.status = status
        self.code = code


class EnvSpecError(RequestError, ValueError):
    """The server refused the env id or its settings (a configuration problem, hence also a ValueError)."""


class LimitError(RequestError):
    """A server limit was reached (sessions per client or in total); another server may have room."""


class APIError(Exception):
    """What a server answers for a request it refuses or fails: an HTTP ``status``, a ``code`` and a message
    (the body is :meth:`body`; the client reads ``code`` back into the errors above)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "code", "type"}}``."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "code": self.code, "type": kind}}


# --------------------------------------------------------------------------- the wire format of values
_TAGS = ("$float", "$tuple", "$dict", "$png", "$array", "$repr")


def _png(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    # Level 1: PNG is lossless at every level; the lowest costs least time for nearly the same size.
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _is_png_image(array: np.ndarray) -> bool:
    """Arrays PNG stores exactly and gives back with the same shape: ``HxW`` and ``HxWx3`` (``x4``) uint8."""
    if array.dtype != np.uint8 or array.size == 0:
        return False
    return array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))


def encode_value(value: Any) -> Any:
    """A JSON-ready form of ``value`` that :func:`decode_value` turns back into an equal value.

    Kept exactly: None, bools, ints, strs, floats (``nan`` and infinities as ``{"$float": "nan"}``),
    lists, tuples (``{"$tuple": [...]}``), dicts (with any encodable keys; a dict whose keys are not all
    plain strs, or that has a key starting with ``$``, as ``{"$dict": [[key, value], ...]}``), numpy
    scalars (as Python numbers) and numpy arrays: uint8 images as PNG (``{"$png": base64}``), other
    numeric arrays as raw bytes with dtype and shape. Anything else travels as its ``repr`` (a str).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # an IntEnum would otherwise dump by name in some encoders
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, np.generic):
        return encode_value(value.item())
    if isinstance(value, np.ndarray):
        return _encode_array(value)
    if isinstance(value, tuple):
        return {"$tuple": [encode_value(item) for item in value]}
    if isinstance(value, list):
        return [encode_value(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {key: encode_value(item) for key, item in value.items()}
        return {"$dict": [[encode_value(key), encode_value(item)] for key, item in value.items()]}
    return {"$repr": repr(value)}


def _encode_array(array: np.ndarray) -> Any:
    if _is_png_image(array):
        return {"$png": _png(np.ascontiguousarray(array))}
    if array.dtype.kind in "biufc" and array.dtype.byteorder in "=<|":
        data = base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
        return {"$array": {"dtype": array.dtype.str, "shape": list(array.shape), "data": data}}
    return {"$repr": repr(array)}


def decode_value(data: Any) -> Any:
    """The value :func:`encode_value` encoded; ValueError for anything it cannot have written."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(item) for item in data]
    if not isinstance(data, dict):
        raise ValueError(f"not an encoded value: a {type(data).__name__}")
    if len(data) == 1:
        (tag, body), = data.items()
        if tag in _TAGS:
            return _decode_tagged(tag, body)
    if any(key.startswith("$") for key in data):
        raise ValueError(f"unknown tag in {sorted(data)[:3]}: plain dict keys never start with '$'")
    return {key: decode_value(item) for key, item in data.items()}


def _decode_tagged(tag: str, body: Any) -> Any:
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError(f"$float takes 'nan', 'inf' or '-inf', got {body!r}")
        return float(body)
    if tag == "$tuple":
        if not isinstance(body, list):
            raise ValueError("$tuple takes a list")
        return tuple(decode_value(item) for item in body)
    if tag == "$dict":
        if not isinstance(body, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in body):
            raise ValueError("$dict takes a list of [key, value] pairs")
        out = {}
        for key, item in body:
            key = decode_value(key)
            try:
                out[key] = decode_value(item)
            except TypeError as error:  # an unhashable key
                raise ValueError(f"$dict key {key!r} cannot be a key: {error}") from None
        return out
    if tag == "$png":
        return _decode_png(body)
    if tag == "$array":
        return _decode_array(body)
    if not isinstance(body, str):
        raise ValueError("$repr takes a str")
    return body


MAX_PNG_PIXELS = 4096 * 4096
"""Pixels a ``$png`` value may have, checked from its header before it is decoded: an env's frame or an image
setting is far smaller, and a small file can decode to gigabytes (a 12000 x 12000 PNG of one colour is 580 KB)."""


def _decode_png(body: Any) -> np.ndarray:
    if not isinstance(body, str):
        raise ValueError("$png takes base64 text")
    try:
        with Image.open(io.BytesIO(base64.b64decode(body, validate=True))) as image:
            if image.format != "PNG" or image.mode not in ("L", "RGB", "RGBA"):
                raise ValueError(f"a {image.format} image in mode {image.mode}")
            width, height = image.size
            if width * height > MAX_PNG_PIXELS:
                raise ValueError(f"{width} x {height} is more than the {MAX_PNG_PIXELS:,} pixels a $png may have; "
                                 "send a smaller image")
            return np.array(image)  # a copy, writable like an env's own array
    except ValueError as error:
        raise ValueError(f"$png is not a readable PNG: {error}") from None
    except Exception as error:  # pillow raises its own types for corrupt files
        raise ValueError(f"$png is not a readable PNG: {type(error).__name__}: {error}") from None


def _decode_array(body: Any) -> np.ndarray:
    if not (isinstance(body, dict) and isinstance(body.get("dtype"), str) and isinstance(body.get("shape"), list)
            and isinstance(body.get("data"), str)):
        raise ValueError("$array takes {dtype: str, shape: [int], data: base64}")
    try:
        dtype = np.dtype(body["dtype"])
        if dtype.kind not in "biufc":
            raise ValueError(f"dtype {dtype} is not numeric")
        shape = tuple(int(n) for n in body["shape"])
        raw = base64.b64decode(body["data"], validate=True)
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    except Exception as error:
        raise ValueError(f"$array cannot be read: {type(error).__name__}: {error}") from None


def encode_facts(facts: StateFacts) -> dict[str, Any]:
    """:class:`StateFacts` as JSON-ready data (see :func:`decode_facts`)."""
    return {
        "player": None if facts.player is None else list(facts.player),
        "objects": [[o.name, list(o.position), o.vertical, o.horizontal] for o in facts.objects],
        "extra": encode_value(facts.extra),
    }


def decode_facts(data: Any) -> StateFacts:
    """The :class:`StateFacts` that :func:`encode_facts` encoded; ValueError for anything else."""
    if not isinstance(data, dict) or not {"player", "objects", "extra"} <= set(data):
        raise ValueError("state facts take {player, objects, extra}")

    def position(value: Any) -> tuple[int, int]:
        if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value)):
            raise ValueError(f"a position is [row, col] ints, got {value!r}")
        return int(value[0]), int(value[1])

    objects = data["objects"]
    if not isinstance(objects, list):
        raise ValueError("objects must be a list")
    facts = []
    for item in objects:
        if not (isinstance(item, list) and len(item) == 4 and all(isinstance(item[k], str) for k in (0, 2, 3))):
            raise ValueError(f"an object is [name, [row, col], vertical, horizontal], got {item!r}")
        facts.append(ObjectFact(item[0], position(item[1]), item[2], item[3]))
    extra = decode_value(data["extra"])
    if not isinstance(extra, dict):
        raise ValueError("extra must be a dict")
    player = None if data["player"] is None else position(data["player"])
    return StateFacts(player=player, objects=tuple(facts), extra=extra)


def decode_observation(data: Any) -> dict[str, Any]:
    """An observation dict (``"text"``, and ``"image"`` as ``HxWx3`` uint8) from its encoding."""
    obs = decode_value(data)
    if not isinstance(obs, dict) or not isinstance(obs.get("text"), str):
        raise ValueError("an observation is a dict with a 'text' str")
    return obs


# --------------------------------------------------------------------------- queries, where the env lives
def answer_query(env: AgentEnv, name: str, last_obs: dict[str, Any]) -> Any:
    """The answer to query ``name`` of ``env``, whose latest observation is ``last_obs`` (raises what the env
    raises).

    An optional method the env does not define answers its default (:class:`~turnrl.envs.contract.OptionalMethods`):
    ``state_key`` the hash of ``last_obs`` (:func:`~turnrl.envs.contract.state_key`, as the rollout takes it),
    ``text`` ``""``, ``action_budget`` None (the caller keeps its own budget), ``image`` a NotImplementedError.
    """
    check_query(name)
    if name == "state_key":
        return state_key(env, last_obs)
    value = contract.call_query(env, name)
    if name == "state_facts" and not isinstance(value, StateFacts):
        raise TypeError(f"state_facts() returned a {type(value).__name__}, not a StateFacts")
    if name == "action_budget":
        return None if value is None else int(value)  # None: the env names no budget
    return value


def encode_answer(name: str, value: Any) -> Any:
    """An answer of :func:`answer_query` in the wire format (:func:`decode_queries` reads it back)."""
    return encode_facts(value) if name == "state_facts" else encode_value(value)


def query_failure(error: BaseException) -> str:
    """How a query that raised is reported: ``"TypeError: ..."``."""
    return f"{type(error).__name__}: {error}"


class QueriedEnv:
    """The read-only half of the env contract for an env that lives elsewhere (an env server, a Ray actor):
    each query of the contract (:data:`QUERIES`) is a method here, whose answer comes from ``_query(name)``,
    which asks where the env lives (or a cache of its answers). Where that env does not define an optional
    one, the answer is the default (``state_key``: the hash of its observation, taken where it lives; ``image``:
    a RemoteEnvError that says so). A test checks that these methods are exactly the contract's queries."""

    def _query(self, name: str) -> Any:
        raise NotImplementedError

    def instructions(self) -> str:
        return self._query("instructions")

    def action_names(self) -> list[str] | None:
        return self._query("action_names")

    def state_facts(self) -> StateFacts:
        return self._query("state_facts")

    def solve(self) -> list[str] | None:
        return self._query("solve")

    def state_key(self) -> str | None:
        return self._query("state_key")

    def text(self) -> str:
        return self._query("text")

    def image(self) -> np.ndarray:
        return self._query("image")

    def action_budget(self) -> int | None:
        return self._query("action_budget")

    def max_text_length(self) -> int:
        return self._query("max_text_length")


# --------------------------------------------------------------------------- answer items
def reset_item(session: str, obs: dict[str, Any], info: dict[str, Any], queries: dict[str, Any]) -> dict[str, Any]:
    """A session's part of a reset answer; ``queries`` already encoded."""
    return {"session": session, "ok": True, "observation": encode_value(obs), "info": encode_value(info),
            "queries": queries}


def step_item(session: str, obs: dict[str, Any], reward: float, terminated: bool, truncated: bool,
              info: dict[str, Any], queries: dict[str, Any]) -> dict[str, Any]:
    """A session's part of a step answer; ``queries`` already encoded."""
    return {"session": session, "ok": True, "observation": encode_value(obs), "reward": encode_value(reward),
            "terminated": bool(terminated), "truncated": bool(truncated), "info": encode_value(info),
            "queries": queries}


def error_item(session: str, message: str, code: str = "env_error") -> dict[str, Any]:
    """A session's part of an answer where its env raised (``code`` ``env_error``)."""
    return {"session": session, "ok": False, "error": {"code": code, "message": message}}


@dataclass
class ItemResult:
    """One env's reset or step answer: from a server (one session's part of an answer, decoded) or from a Ray
    env worker."""

    observation: dict[str, Any]
    info: dict[str, Any]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    queries: dict[str, Any] = field(default_factory=dict)
    """Query name -> its result, or a :class:`RemoteEnvError` when the query raised where the env lives."""


def decode_item(url: str, item: Any, step: bool) -> ItemResult:
    """An item of a reset or step answer; EnvRaisedError where the env raised, RemoteEnvError where the item
    is malformed."""
    if not isinstance(item, dict):
        raise RemoteEnvError(f"env server {url} answered a malformed item: {str(item)[:200]}")
    if item.get("ok") is not True:
        error = item.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(error, dict) and error.get("code") == "unknown_session":
            raise SessionLostError(f"env server {url}: {message}")
        raise EnvRaisedError(f"env server {url}: {message or 'the env failed'}")
    try:
        result = ItemResult(observation=decode_observation(item.get("observation")),
                            info=decode_value(item.get("info", {})))
        if not isinstance(result.info, dict):
            raise ValueError("info must be a dict")
        if step:
            reward = decode_value(item.get("reward"))
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise ValueError(f"reward must be a number, got {reward!r}")
            terminated, truncated = item.get("terminated"), item.get("truncated")
            if not isinstance(terminated, bool) or not isinstance(truncated, bool):
                raise ValueError("terminated and truncated must be bools")
            result.reward, result.terminated, result.truncated = float(reward), terminated, truncated
        result.queries = decode_queries(url, item.get("queries", {}))
    except ValueError as error:
        raise RemoteEnvError(f"env server {url} answered a malformed item: {error}") from None
    return result


def decode_queries(url: str, data: Any) -> dict[str, Any]:
    """Query results keyed by name; a query that raised on the server becomes a RemoteEnvError value."""
    if not isinstance(data, dict):
        raise ValueError("queries must be an object")
    out: dict[str, Any] = {}
    for name, value in data.items():
        if name not in QUERIES:
            raise ValueError(f"unknown query {name!r}")
        if isinstance(value, dict) and set(value) == {"error"}:
            out[name] = RemoteEnvError(f"env server {url}: {name}() failed: {value['error']}")
        elif name == "state_facts":
            out[name] = decode_facts(value)
        else:
            out[name] = decode_value(value)
    return out
