"""The request bodies of ``turnrl serve-env``, as pydantic models: one per endpoint that takes a body.

Unknown fields are refused, session ids must match :data:`SESSION_ID_PATTERN` and query names must be
:data:`~turnrl.envservice.protocol.QUERIES`, so that a bad request is a 400 that names its field
(:func:`validation_message` writes pydantic's errors as one message). Values inside (settings, options) stay
in the tagged encoding of :func:`turnrl.envservice.protocol.encode_value`: the server decodes them. The errors
the server answers are :class:`~turnrl.envservice.protocol.APIError`.
"""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Optional

from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr

from turnrl.envservice.protocol import check_query, decode_value

SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


# --------------------------------------------------------------------------- request schema
SessionId = Annotated[StrictStr, Field(pattern=SESSION_ID_PATTERN)]
Query = Annotated[StrictStr, AfterValidator(check_query)]
"""A name of :data:`~turnrl.envservice.protocol.QUERIES`."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EnvSpec(_Body):
    env_id: StrictStr = Field(min_length=1, max_length=512)
    settings: Any = Field(default_factory=dict)
    """Encoded settings (a dict)."""


class OpenBody(EnvSpec):
    count: Optional[StrictInt] = Field(None, ge=1)
    ids: Optional[list[SessionId]] = Field(None, min_length=1)


class ResetItem(_Body):
    session: SessionId
    seq: Optional[StrictInt] = Field(None, ge=1)
    seed: Optional[StrictInt] = Field(None, ge=0)
    options: Any = None
    queries: list[Query] = Field(default_factory=list)


class StepItem(_Body):
    session: SessionId
    seq: Optional[StrictInt] = Field(None, ge=1)
    action: StrictStr
    queries: list[Query] = Field(default_factory=list)


class QueryItem(_Body):
    session: SessionId
    queries: list[Query] = Field(min_length=1)


class ResetBody(_Body):
    items: list[ResetItem] = Field(min_length=1)


class StepBody(_Body):
    items: list[StepItem] = Field(min_length=1)


class QueryBody(_Body):
    items: list[QueryItem] = Field(min_length=1)


class SessionsBody(_Body):
    sessions: list[SessionId] = Field(min_length=1)


class ForkBody(SessionsBody):
    ids: Optional[list[SessionId]] = None


def validation_message(error: RequestValidationError) -> str:
    """A readable summary of pydantic's errors (malformed JSON included), on one line: a location may be a
    client's own key (an unknown field's name), which may hold a line break."""
    lines = []
    for item in error.errors()[:10]:
        location = ".".join(str(part) for part in item.get("loc", ()) if part != "body")
        if item.get("type") == "json_invalid":
            lines.append(f"the body is not valid JSON ({item.get('ctx', {}).get('error', 'parse error')})")
        else:
            lines.append(f"{location or 'body'}: {item.get('msg', 'invalid')}")
    return " ".join(("invalid request: " + "; ".join(lines)).split())


# --------------------------------------------------------------------------- values inside the bodies
def decode_request_value(data: Any) -> Any:
    """A client's encoded settings or options, decoded; ValueError for what cannot be (one nested too deep for
    Python's recursion included, which JSON's parser let through)."""
    try:
        return decode_value(data)
    except RecursionError:
        raise ValueError("it is nested too deep; send plain settings") from None


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong, _SHORT.maxlevel = 120, 60, 40, 4


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to a line: a client's settings in an error may be a huge number, array or string."""
    return _SHORT.repr(value).replace("\n", " ")
