"""The wire format of ``turnrl serve-policy``'s chat-completions API, in OpenAI's shape.

The request body (:class:`ChatCompletionRequest` and its messages and parts) and the response
(:class:`ChatCompletion`) as pydantic models, and the errors the server answers (:class:`APIError`, OpenAI's
``{"error": {"message", "type", "param", "code"}}``, and :func:`validation_message` for pydantic's).

Their validators refuse what pydantic can name a field for (a lone surrogate in a string, an empty stop string
or too many, a message without content), so that the 400 says which field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# --------------------------------------------------------------------------- request schema
MAX_STOP_STRINGS = 32
"""Stop strings a request may send (OpenAI takes 4; vLLM any number): enough for any format's end tags."""

MAX_STOP_CHARS = 256
"""Characters a stop string may have."""

MAX_TEMPERATURE = 1e4
"""The hottest temperature accepted: logits within +-50 of each other are then equally likely to 1%, so any
hotter is the same; a far hotter one (1e300 is infinite in float32) makes the sampler's probabilities NaN."""

MAX_MESSAGES = 100_000
"""Messages a request may send: validating them runs on the event loop, where a body of 300,000 one-word messages
held every client for over a second. A chat template writes a few tokens a message, so this many take hundreds of
thousands of tokens; the context's own bound on them is checked before the template, off the loop."""

QUOTED_CHARS = 200
"""Characters of a client's value an error message quotes (a model name, a path); the rest is left out."""

MAX_TOKENS_BOUND = 2**31 - 1
"""The most tokens a request may ask for (no context is longer): a number of thousands of digits would fail
the server's own arithmetic on it before the context check."""


def check_encodable(text: str) -> None:
    """Refuse a string UTF-8 cannot encode. JSON's ``\\udfff`` escape decodes to a lone surrogate, which no
    tokenizer (and no response) can encode: refused where pydantic names its field, rather than failing deep in
    tokenization."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"holds a lone surrogate ({text[error.start]!r} at character {error.start}), which is not "
                         "text: send valid Unicode") from None


def shortened(text: str) -> str:
    """``text`` cut to its first :data:`QUOTED_CHARS` characters, an ellipsis and its length marking the cut, so
    that an error never answers a client's 5 MB model name with all of it."""
    return text if len(text) <= QUOTED_CHARS else f"{text[:QUOTED_CHARS]}... ({len(text):,} characters)"


def quoted(text: str) -> str:
    """``text`` as an error message quotes it: its repr, of its first :data:`QUOTED_CHARS` characters at most."""
    return repr(text) if len(text) <= QUOTED_CHARS else f"{text[:QUOTED_CHARS]!r}... ({len(text):,} characters)"


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: Optional[str] = None


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(BaseModel):
    """One chat message; ``developer`` is OpenAI's newer name for ``system``."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[ContentPart], None] = None

    @field_validator("content")
    @classmethod
    def _content_encodable(cls, content: Any) -> Any:
        for text in [content] if isinstance(content, str) else [p.text for p in content or [] if p.type == "text"]:
            check_encodable(text)
        return content

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError("content is required for system, developer and user messages")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The body of ``POST /v1/chat/completions`` (the fields this server honours or refuses)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                               description="below 1e-5 (0 included) is greedy, as in vLLM")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Optional[int] = Field(None, ge=-1, description="0 or -1 disables (an extension to OpenAI's API)")
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    n: int = Field(1, ge=1, le=128)
    stop: Union[str, list[str], None] = Field(None, description=f"at most {MAX_STOP_STRINGS} strings of at most "
                                                                   f"{MAX_STOP_CHARS} characters")
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An optional parameter sent as null takes its default, as OpenAI's API (and vLLM) take it: clients that
        write every field of the request send ``"temperature": null`` or ``"n": null`` for one they leave unset."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in cls.model_fields or cls.model_fields[key].is_required()}

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: Any) -> Any:
        strings = [stop] if isinstance(stop, str) else stop or []
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        # Each set of stop strings is matched against the whole vocabulary before generation, on the one
        # generation thread every client shares: thousands of them would stall every client.
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(strings)} stop strings; at most {MAX_STOP_STRINGS} are accepted")
        longest = max(strings, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string of {len(longest)} characters; at most {MAX_STOP_CHARS} are accepted")
        for text in strings:
            check_encodable(text)
        return stop

    @field_validator("model")
    @classmethod
    def _model_encodable(cls, model: str) -> str:
        check_encodable(model)
        return model

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


# --------------------------------------------------------------------------- response schema
class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[Any] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: str
    stop_reason: Optional[str] = None
    """The stop string that ended the choice (vLLM's field); None for end of turn or length."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


# --------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A readable summary of pydantic's errors, and the first offending parameter."""
    lines: list[str] = []
    params: list[str | None] = []
    for item in error.errors():
        if item.get("type") == "json_invalid":  # its location is a character offset, not a field
            offset = item.get("loc", ("body", "?"))[-1]
            reason = (item.get("ctx") or {}).get("error", "")
            lines.append(f"the body is not valid JSON ({reason} at character {offset}); send one JSON object")
            params.append(None)
            continue
        location = shortened(".".join(str(part) for part in item.get("loc", ()) if part != "body"))
        params.append(location or None)
        lines.append(f"{location}: {pydantic_message(item)}" if location else body_fault(item))
    return one_line("invalid request: " + "; ".join(lines)), params[0] if params else None


def pydantic_message(item: dict[str, Any]) -> str:
    """Pydantic's message for one error, each long value of the client's that it quotes (a part's ``"type"`` that
    matches no part) cut as :func:`shortened` cuts it."""
    message = str(item.get("msg", "invalid"))
    for value in (item.get("ctx") or {}).values():
        if isinstance(value, str) and len(value) > QUOTED_CHARS:
            message = message.replace(value, shortened(value))
    return shortened(message) if len(message) > 4 * QUOTED_CHARS else message


_LINE_BREAKS = {ord(c): c.encode("unicode_escape").decode("ascii") for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}
"""Each character ``str.splitlines`` breaks a line at, to its escape (``"\\n"``, ``"\\u2028"``)."""


def one_line(text: str) -> str:
    """``text`` with its line breaks written as escapes. Pydantic's messages quote the client's own value (a part's
    ``"type"`` that matches no part), which may hold one: every error the server answers is one line."""
    return text.translate(_LINE_BREAKS)


def body_fault(item: dict[str, Any]) -> str:
    """What is wrong with the body as a whole. FastAPI parses a body as JSON only when its ``Content-Type`` says
    JSON: a JSON object sent without that header (``curl -d`` sends a form's) arrives as bytes, and pydantic's
    "Input should be a valid dictionary" would hide that the header is what to fix."""
    if item.get("type") == "missing":
        return "the request has no body; send one JSON object (model, messages, ...) as application/json"
    if isinstance(item.get("input"), bytes):
        return "the body was not read as JSON: send it with the header 'Content-Type: application/json'"
    return f"the body must be one JSON object (model, messages, ...): {pydantic_message(item)}"
