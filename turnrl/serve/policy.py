"""``turnrl serve-policy``: a transformers model behind an OpenAI-compatible chat-completions API.

Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``
and ``GET /health`` (``HEAD`` too, as health checkers ask). Any OpenAI client (or
:class:`turnrl.policy.openai_http.OpenAIPolicy`) can use it, e.g.
``openai.OpenAI(base_url="http://localhost:8000/v1", api_key="x")``.
With ``--token KEY`` (or ``$TURNRL_POLICY_TOKEN``) every request but ``GET /health``
must send ``Authorization: Bearer KEY`` (a 401 otherwise, before its body is read),
as ``serve-env`` does; without one the server checks no key.

Concurrent requests share forward passes (:mod:`turnrl.serve.batching` says how); a request that
breaks generation fails alone with a 500 and the server keeps serving. The request and response
bodies and the errors are :mod:`turnrl.serve.chat_schema`'s; :mod:`turnrl.serve.preparation` prepares each request
for the policy; this module builds its answer, and holds the app and the command.

Behaviour worth knowing:

- Preparing a request (the chat template, decoding its images, the image
  processor) runs on ``--prepare-threads`` threads (2 by default), never on the
  event loop: a slow one delays no other client, and more wait their turn.
- Prompts are the messages rendered with the tokenizer's chat template and a
  generation prompt. A VLM takes ``image_url`` parts with data URLs (each image
  processed once, its placeholder expanded to its visual tokens, as in the
  rollout's context); a text model answers a request with image parts with a
  400, and so does a VLM for an image that is not a readable data URL, or one
  whose header gives more than ``--max-image-pixels`` (4096 x 4096 by default),
  or that takes a request's images together past 4 times that: that one is
  refused before it is decoded.
- ``temperature`` below 1e-5 (0 included) is greedy, as in vLLM: dividing the
  logits by a tinier one would overflow. Above 1e4 it is a 400 (every token is
  equally likely already; a far larger one overflows float32 into NaN).
- ``max_tokens`` (and ``max_completion_tokens``) above 2**31 - 1 is a 400, and so is a request whose prompt and
  ``max_tokens`` together pass the context: the model's, or the engine's ``model.engine.max_seq_len`` where
  that is less (``context_length_exceeded``, as vLLM answers), never a completion cut short. A prompt that
  cannot fit is refused before it is tokenized where its size says so: more messages than the context has
  tokens, or more characters of text than that many of the tokenizer's longest tokens span (byte-level BPE and
  BPE with byte fallback). More than 100,000 messages are a 400 of their own.
- An optional parameter sent as ``null`` takes its default, as in OpenAI's API.
- A request body over ``--max-request-mb`` (32 MiB by default: several large images as data URLs) is a
  413, answered as soon as the bytes read pass the limit (or at once when ``Content-Length`` says so), so a
  client that sends more, or lies about its length, or streams it chunked, never has more than the limit held.
  The bodies of all requests in flight together hold at most 8 times that: past it, a request is a 503 to
  retry (clients such as openai's retry those), read no further; the bodies one client (one address) is still
  sending hold at most 2 times that, so that a client's stalled uploads leave the rest to the others. A body
  that has not arrived whole 120 s after its headers, or whose next bytes do not come for 15 s, is a 408 (its
  bytes freed, its connection closed): a body sent slowly but steadily within those is read.
- Strings must be valid Unicode: a lone surrogate (JSON's ``"\\udfff"``) in a
  message or a stop string is a 400 that names the field.
- ``n`` samples per request, ``stop`` strings (cut from the returned text as
  OpenAI does; ``stop_reason`` names the one that matched, as vLLM does),
  ``top_k`` (an extension; 0 or -1 disables), ``max_tokens`` or
  ``max_completion_tokens`` (default: what the context leaves, at most
  ``default_max_tokens``), ``logprobs: true`` (the sampled tokens' logprobs
  under ``softmax(logits / temperature)``; the end-of-turn token is not
  listed, like OpenAI; ``top_logprobs`` > 0 is refused with a 400).
- ``stream: true`` is served as a valid server-sent-event stream, but the whole
  completion arrives in one chunk once it is generated (batched generation is
  not incremental); ``stream_options.include_usage`` adds the usage chunk.
- ``seed`` is accepted and ignored: batched requests share one sampling RNG.
  Penalties, tools and JSON response formats are refused with a 400.
- Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
  for every error the server answers: 400 for invalid requests (validation
  errors and malformed JSON included), 401 without the API key, 408 for a body that
  did not arrive in time, 413 for a body over the limit, 404 for an unknown model (as OpenAI and vLLM answer) or
  path, 405 for a wrong method (``GET /v1/chat/completions``), 500 when
  generation fails, 503 once the server is shutting down.
- A client that disconnects while its request waits for generation is dropped
  from the batch (nobody would receive it). Once its batch is being generated, that ``generate`` call runs to
  its end (a policy's cannot be stopped part-way, and it holds other clients' prompts); a request of more
  prompts than ``--max-batch-size`` (``n``) runs in calls of that many, and none starts once its client has left.
- An error quotes a client's value (a model name, a path) to its first 200 characters.
- The served name is ``--served-model-name`` when given (vLLM's option), else
  what ``--model`` said; clients must send it as ``model``.
- The port is taken before the model loads, so a busy port, a model path that
  does not exist or a hub id that cannot be fetched fails in one line at once.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from turnrl.config import ConfigError, ModelConfig
from turnrl.envservice.http_guards import BodyDeadline, BodyLimit, bind_port, check_token, is_loopback
from turnrl.eval_config import EvalConfig
from turnrl.policy.factory import load_model_policy
from turnrl.policy.interface import Completion, GenerationRequest, Policy
from turnrl.serve.batching import GenerationBatcher, shutting_down
from turnrl.serve.chat_schema import (
    APIError,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    TokenLogprob,
    Usage,
    quoted,
    shortened,
    validation_message,
)
from turnrl.serve.preparation import DEFAULT_MAX_IMAGE_PIXELS, PreparedRequest, longest_token_chars, prepare

TOKEN_ENV_VAR = "TURNRL_POLICY_TOKEN"
"""Where ``turnrl serve-policy`` reads its API key when ``--token`` is not given."""

# --------------------------------------------------------------------------- body size
DEFAULT_MAX_REQUEST_MB = 32
"""The largest request body in MiB by default: a chat with several large images as base64 data URLs (a
1024 x 1024 photo is about 2 MB as PNG, a third more in base64) fits, a body meant to exhaust memory does not."""

REQUESTS_HELD = 8
"""Request bodies of the largest size that may be in flight at once (``--max-request-mb`` each): past that
many bytes together, a request is answered with a 503 to retry, read no further."""

CLIENT_REQUESTS_ARRIVING = 2
"""Request bodies of the largest size that one client (one address) may be sending at once: past that many
bytes, its next is a 503 to retry. Eight stalled uploads from one client held the whole bound above and every
other client got 503s; bodies read whole (a client's many requests waiting their turn) count in that bound
alone. Clients behind one proxy share its address, and so this share."""

DEFAULT_BODY_TIMEOUT_S = 120.0
"""Seconds a request's body may take to arrive (32 MiB at a quarter of a MiB a second) before it is a 408."""

DEFAULT_BODY_STALL_S = 15.0
"""Seconds a request's body may pause between two of its parts before it is a 408: a client that stops
sending holds its bytes (and its share of the bound) no longer than that."""


def server_busy(total_bytes: int) -> JSONResponse:
    """The 503 of a request that would take the bodies in flight past ``total_bytes``."""
    return APIError(503, f"the server holds {total_bytes / (1 << 20):g} MiB of requests in flight, its limit "
                         f"({REQUESTS_HELD} x --max-request-mb); send the request again in a moment",
                    type="server_error", code="server_busy").response()


def client_busy(client_bytes: int) -> JSONResponse:
    """The 503 of a request that would take its client's bodies still arriving past ``client_bytes``."""
    return APIError(503, f"this client is sending {client_bytes / (1 << 20):g} MiB of requests at once, its share "
                         f"({CLIENT_REQUESTS_ARRIVING} x --max-request-mb); send the request again once those have "
                         "arrived", type="server_error", code="server_busy").response()


def body_timed_out(total_s: float, stall_s: float) -> JSONResponse:
    """The 408 of a request body that did not arrive within ``total_s`` seconds, or paused over ``stall_s``."""
    return APIError(408, f"the request body did not arrive in time: this server waits {total_s:g} s at most for a "
                         f"body, and {stall_s:g} s at most for its next bytes; send the request again",
                    code="request_timeout").response()


def request_too_large(limit_bytes: int) -> JSONResponse:
    """The 413 of a request body over ``limit_bytes``, in OpenAI's error shape, saying what to do."""
    return APIError(413, f"the request body is over this server's limit of {limit_bytes / (1 << 20):g} MiB; send "
                         "fewer or smaller images, or start the server with a larger --max-request-mb",
                    code="request_too_large").response()


# --------------------------------------------------------------------------- request handling
DEFAULT_PREPARE_THREADS = 2
"""Requests prepared at once (chat template, image decoding and processing): each may hold an image's
decoded pixels, so they are few; the rest wait their turn without holding the event loop."""



def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text before the earliest stop string, and that string (OpenAI returns text without it)."""
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    if not hits:
        return text, None
    index, stop = min(hits)
    return text[:index], stop


def _byte_level_table() -> dict[str, int]:
    """GPT-2's map from byte-level BPE characters back to the bytes they stand for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes one token stands for: exact for byte-level BPE (Qwen, Llama-3, GPT-2), else its decoded text."""
    from tokenizers import decoders

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if isinstance(decoder, decoders.ByteLevel) and token_id not in tokenizer.all_special_ids:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _token_logprobs(completion: Completion, tokenizer: Any, end_ids: set[int]) -> ChoiceLogprobs:
    """OpenAI's ``logprobs.content``: one entry per sampled token, the end-of-turn token left out.

    A token that is part of a multi-byte character is named ``bytes:\\xNN...`` (as
    OpenAI does); ``bytes`` always holds its exact bytes for byte-level tokenizers.
    """
    pairs = list(zip(completion.token_ids, completion.logprobs))
    if pairs and pairs[-1][0] in end_ids:
        pairs = pairs[:-1]
    entries = []
    for token_id, logprob in pairs:
        raw = token_bytes(tokenizer, token_id)
        try:
            token = raw.decode("utf-8")
        except UnicodeDecodeError:
            token = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        entries.append(TokenLogprob(token=token, logprob=float(logprob), bytes=list(raw)))
    return ChoiceLogprobs(content=entries)


def build_response(body: ChatCompletionRequest, prepared: PreparedRequest, completions: list[Completion],
                   policy: Policy, model_name: str) -> ChatCompletion:
    end_ids = set(policy.eos_ids)
    choices = []
    for index, completion in enumerate(completions):
        text, stop_reason = completion.text, None
        if completion.finish_reason == "stop" and prepared.sampling.stop:
            text, stop_reason = _cut_at_stop(text, prepared.sampling.stop)
        logprobs = _token_logprobs(completion, policy.tokenizer, end_ids) if body.logprobs else None
        choices.append(Choice(index=index, message=AssistantMessage(content=text), logprobs=logprobs,
                              finish_reason=completion.finish_reason, stop_reason=stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in completions)
    usage = Usage(prompt_tokens=len(prepared.prompt_ids), completion_tokens=completion_tokens,
                  total_tokens=len(prepared.prompt_ids) + completion_tokens)
    return ChatCompletion(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name,
                          choices=choices, usage=usage)


def stream_events(response: ChatCompletion, include_usage: bool) -> list[str]:
    """A finished completion as server-sent events of ``chat.completion.chunk`` objects, ``[DONE]`` last."""
    head = {"id": response.id, "object": "chat.completion.chunk", "created": response.created, "model": response.model}
    events = []
    for choice in response.choices:
        logprobs = choice.logprobs.model_dump() if choice.logprobs is not None else None
        deltas = [
            ({"role": "assistant", "content": ""}, None, None, None),
            ({"content": choice.message.content}, logprobs, None, None),
            ({}, None, choice.finish_reason, choice.stop_reason),
        ]
        for delta, chunk_logprobs, finish, stop_reason in deltas:
            chunk = {**head, "choices": [{"index": choice.index, "delta": delta, "logprobs": chunk_logprobs,
                                          "finish_reason": finish, "stop_reason": stop_reason}]}
            events.append(f"data: {json.dumps(chunk)}\n\n")
    if include_usage:
        events.append(f"data: {json.dumps({**head, 'choices': [], 'usage': response.usage.model_dump()})}\n\n")
    events.append("data: [DONE]\n\n")
    return events


# --------------------------------------------------------------------------- the app
CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client left before the answer (logged; nobody receives it)."""

T = TypeVar("T")


async def unless_client_leaves(work: Coroutine[Any, Any, T], request: Request) -> T | None:
    """``work``'s result, or None once the client has disconnected; ``work`` is then cancelled, so that the
    batcher drops a request nobody waits for instead of generating it."""
    task = asyncio.ensure_future(work)

    async def until_disconnected() -> None:
        # The body is read: the next message the server sends the app is the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(until_disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


def bearer_error(authorization: str, token: str) -> str | None:
    """What is wrong with an ``Authorization`` header that must carry ``Bearer <token>``; None when it does."""
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return ("this server needs an API key: send 'Authorization: Bearer <key>' (turnrl eval sends "
                f"${EvalConfig.api_key_env}, or the variable its api_key_env names)")
    if not secrets.compare_digest(given.strip().encode(), token.encode()):
        return "wrong API key"
    return None


def create_app(
    policy: Policy,
    model_name: str,
    *,
    batch_window_s: float = 0.005,
    max_batch_size: int | None = None,
    default_max_tokens: int = 1024,
    token: str | None = None,
    prepare_threads: int = DEFAULT_PREPARE_THREADS,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_request_mb: float = DEFAULT_MAX_REQUEST_MB,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    body_stall_s: float = DEFAULT_BODY_STALL_S,
) -> FastAPI:
    """An OpenAI-compatible app serving ``policy`` under the name ``model_name``.

    Args:
        policy: a model policy (one with a ``tokenizer``): the transformers backend or the engine.
        model_name: the ``model`` clients must name.
        batch_window_s: how long a request waits for others to share its forward pass.
        max_batch_size: prompts per ``generate`` call; default the policy's own ``max_batch_size`` (else 32).
        default_max_tokens: completion budget when a request names none (the context may leave less).
        token: the API key every request but ``GET /health`` must send as ``Authorization: Bearer <key>``;
            None: no key is checked.
        prepare_threads: requests prepared at once at most (chat template, image decoding and processing, on
            threads of their own so that the event loop keeps answering); the others wait their turn.
        max_image_pixels: an image with more pixels (read from its header) is refused with a 400, undecoded.
        max_request_mb: a request body over this many MiB is refused with a 413, read no further.
        body_timeout_s: a request body that has not arrived whole this many seconds after its headers is a 408.
        body_stall_s: so is one whose next bytes do not come for this many seconds.
    """
    check_token(token)
    if prepare_threads < 1:
        raise ValueError(f"prepare_threads must be >= 1, got {prepare_threads}")
    if max_image_pixels < 1:
        raise ValueError(f"max_image_pixels must be >= 1, got {max_image_pixels}")
    if not max_request_mb > 0:
        raise ValueError(f"max_request_mb must be > 0, got {max_request_mb}")
    batch_size = max_batch_size or policy.max_batch_size or 32
    max_token_chars = longest_token_chars(policy.tokenizer)  # once: a vocabulary of 150,000 entries
    batcher = GenerationBatcher(policy, max_batch_size=batch_size, window_s=batch_window_s)
    preparer = ThreadPoolExecutor(max_workers=prepare_threads, thread_name_prefix="turnrl-prepare")
    preparing = 0  # requests in preparation or waiting for a preparation thread (reported by /health)
    created = int(time.time())

    closing = False

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal closing
        batcher.start()
        yield
        closing = True
        await batcher.stop()
        # Preparations already queued finish (a few seconds at most) and meet the stopped batcher's 503; cancelled,
        # their requests would end without an answer.
        preparer.shutdown(wait=False)

    app = FastAPI(title="turnrl policy server", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.model_name = model_name
    # Added before the key check, so that it runs inside it: a request without the key is refused unread.
    limit_bytes = int(max_request_mb * (1 << 20))
    held_bytes, arriving_bytes = REQUESTS_HELD * limit_bytes, CLIENT_REQUESTS_ARRIVING * limit_bytes
    deadline = BodyDeadline(body_timeout_s, body_stall_s, timed_out=lambda: body_timed_out(body_timeout_s,
                                                                                          body_stall_s))
    app.add_middleware(BodyLimit, limit=limit_bytes, too_large=lambda: request_too_large(limit_bytes),
                       total_limit=held_bytes, busy=lambda: server_busy(held_bytes), client_limit=arriving_bytes,
                       client_busy=lambda: client_busy(arriving_bytes), deadline=deadline)

    if token is not None:
        @app.middleware("http")
        async def _authorize(request: Request, call_next: Any) -> Any:
            # Before routing and body validation: without the key, nothing but /health answers (as serve-env).
            if request.url.path != "/health":
                error = bearer_error(request.headers.get("authorization", ""), token)
                if error is not None:
                    return APIError(401, error, code="invalid_api_key").response()
            return await call_next(request)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = validation_message(error)
        return APIError(400, message, param=param).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # A fault of the server, not of the request: answered in OpenAI's shape, in one line, like every other
        # error (a client's error handling reads a message, not a plain-text page).
        # uvicorn logs the traceback (starlette raises the error again once this answer is sent); the client
        # gets its type alone, not its text, which may name the server's files.
        return APIError(500, f"internal error ({type(error).__name__}); the server's log has the traceback",
                        type="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # Routing errors (an unknown path, a GET on the chat endpoint) in OpenAI's shape too, so that a
        # client's error handling sees a message rather than a bare {"detail": ...}.
        path = shortened(request.url.path)
        if error.status_code == 405:
            message = f"{request.method} is not allowed on {path}; see the server's endpoints: " \
                      "POST /v1/chat/completions, GET /v1/models, GET /health"
        elif error.status_code == 404:
            message = f"no endpoint {path}; this server serves /v1/chat/completions, /v1/models, /health"
        elif error.status_code == 400 and error.__cause__ is not None:
            # FastAPI's "There was an error parsing the body": JSON nested too deep, an integer of thousands of
            # digits, bytes that are not UTF-8. Its cause says which.
            cause = error.__cause__
            message = (f"invalid request: the body cannot be read as JSON ({type(cause).__name__}: {cause}); send "
                       "one JSON object in UTF-8")
        else:
            message = str(error.detail)
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        response = APIError(error.status_code, message, type=kind).response()
        for key, value in (error.headers or {}).items():  # e.g. Allow on a 405
            response.headers[key] = value
        return response

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "turnrl"}

    @app.api_route("/health", methods=["GET", "HEAD"])  # health checkers ask with HEAD too
    async def health() -> dict[str, Any]:
        stats = batcher.stats
        return {"status": "ok", "model": model_name, "preparing": preparing, "pending": batcher.pending,
                "generating": batcher.generating,
                "requests": stats.requests, "prompts": stats.prompts, "generate_calls": stats.generate_calls}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"model {quoted(model_id)} does not exist; this server serves {quoted(model_name)}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Any:
        nonlocal preparing
        if closing:
            raise shutting_down()
        preparing += 1
        try:
            prepared = await asyncio.get_running_loop().run_in_executor(
                preparer, prepare, body, policy, model_name, default_max_tokens, max_image_pixels, max_token_chars)
        finally:
            preparing -= 1
        request = GenerationRequest(prompt_ids=prepared.prompt_ids, messages=[], max_new_tokens=prepared.max_tokens,
                                    model_inputs=prepared.model_inputs, image_digests=prepared.image_digests)
        completions = await unless_client_leaves(batcher.submit([request] * body.n, prepared.sampling), http_request)
        if completions is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        response = build_response(body, prepared, completions, policy, model_name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(response, include_usage)
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return response

    return app


def load_policy(model_path: str, device: str = "auto", max_batch_size: int = 32,
                served_model_name: str | None = None, model_config: ModelConfig | None = None) -> tuple[Policy, str]:
    """The policy for ``model_path`` and its served name: a model directory, ``builtin`` (the default
    built-in model) or ``builtin:<preset>`` (e.g. ``builtin:vlm-tiny``, a built-in VLM). On a GPU a
    Llama-family text model is served by the engine, which keeps each conversation's KV cache between
    its requests (a request that extends an earlier one prefills only the new tokens).

    Args:
        served_model_name: the name clients send as ``model``; None serves it as ``model_path``.
        model_config: dtype, backend, pixel bounds, ...; None takes the defaults on ``device``.

    Raises:
        ConfigError: ``model_path`` is neither a model directory nor a hub id that can be fetched.
    """
    config = model_config if model_config is not None else ModelConfig(device=device)
    path = model_path
    if model_path == "builtin" or model_path.startswith("builtin:"):
        from turnrl.models.builtin import builtin_model_path

        if ":" in model_path:
            config.builtin_preset = model_path.split(":", 1)[1]
        path = str(builtin_model_path(config))
    else:
        from turnrl.models.loading import locate_model

        locate_model(model_path, "--model")  # a missing directory or an unreachable hub id: one line, at once
    return load_model_policy(config, path, max_batch_size=max_batch_size), served_model_name or model_path


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8000, device: str = "auto",
          max_batch_size: int = 32, served_model_name: str | None = None,
          model_config: ModelConfig | None = None, token: str | None = None,
          prepare_threads: int = DEFAULT_PREPARE_THREADS, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
          max_request_mb: float = DEFAULT_MAX_REQUEST_MB, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
          body_stall_s: float = DEFAULT_BODY_STALL_S) -> None:
    """Load ``model_path`` and serve it until interrupted; clients name it ``served_model_name``, else as
    ``model_path`` (e.g. ``builtin``). ``token``, ``prepare_threads``, ``max_image_pixels`` and
    ``max_request_mb``, ``body_timeout_s`` and ``body_stall_s`` are :func:`create_app`'s.

    Raises:
        ConfigError: before the model loads, when the port cannot be had, the model cannot be found or the token
            cannot be sent.
    """
    import uvicorn
    from PIL import Image

    try:
        check_token(token)
    except ValueError as error:
        raise ConfigError(str(error)) from None

    # Pillow's own bomb check (a warning past the limit, an error past twice it) agrees with the server's, for
    # images opened anywhere in this process.
    Image.MAX_IMAGE_PIXELS = max_image_pixels
    sock = bind_port(host, port, "serve-policy")
    try:
        policy, name = load_policy(model_path, device=device, max_batch_size=max_batch_size,
                                   served_model_name=served_model_name, model_config=model_config)
        placed = next(policy.model.parameters()).device if policy.model is not None else "?"
        backend = type(policy).__name__
        if token is None and not is_loopback(host):
            print(f"warning: serving on {host} without an API key: anyone who can reach this port can use this "
                  f"model and this machine's accelerator; pass --token or set {TOKEN_ENV_VAR}", flush=True)
        print(f"serving model {name!r} ({backend}) on {placed} at http://{host}:{sock.getsockname()[1]}/v1 "
              f"(max batch {max_batch_size}, API key {'required' if token else 'off'})", flush=True)
        app = create_app(policy, name, max_batch_size=max_batch_size, token=token, prepare_threads=prepare_threads,
                         max_image_pixels=max_image_pixels, max_request_mb=max_request_mb,
                         body_timeout_s=body_timeout_s, body_stall_s=body_stall_s)
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info")).run(sockets=[sock])
    finally:
        sock.close()
