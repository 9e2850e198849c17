"""A policy behind any OpenAI-compatible chat-completions endpoint (vLLM, SGLang, OpenAI, ``turnrl serve-policy``).

``generate`` is synchronous, like every policy; underneath it sends the batch's
requests concurrently with ``httpx`` (at most ``concurrency`` in flight) and
retries what is worth retrying: connection errors, timeouts, 408, 409, 429 and
5xx (but 501 and 505), with exponential backoff and jitter, honouring ``Retry-After``
up to a cap. A request that still fails (or gets an answer that retrying will not
change: a 4xx, a redirect, a 200 whose body is not a chat completion, a TLS
failure) becomes ``Completion(finish_reason="error", error=...)`` whose error names
the server, the status and what was wrong (the body's start, clipped); the other
requests of the batch are unaffected and ``generate`` never raises for a single
request. Nothing waits unbounded: each attempt, body included, is cut at
``timeout_s``, a body over ``max_response_bytes`` is not read further, and a
request takes at most ``max_retries + 1`` attempts with waits of at most
``max(max_backoff_s, max_retry_after_s)`` between them. A
conversation that has outgrown the model's context (the server's
``context_length_exceeded``) becomes ``Completion(finish_reason="context")``:
the rollout cuts that episode by its context budget, as it does for a local
model, rather than counting an error.

The policy is text-only (``tokenizer = None``): the rollout sends it chat
messages, and it returns text without token ids or logprobs.

Stop strings. A local model's response keeps the stop string it ended on
(``</answer>`` closes the answer the parser reads). An OpenAI-style server cuts
it from the text; vLLM and turnrl's server say which one matched
(``stop_reason``), SGLang too (``matched_stop``), and that string is put back.
A server that says neither (OpenAI's own API) leaves a response that ended on
``finish_reason="stop"`` ambiguous: an end of turn, or a stop string cut off.
The first such response is asked again without ``stop``, and from then on the
policy sends no stop strings to that server and cuts each response after the
first one it holds, as a local model stops (the tokens past it are generated
and billed, the price of an exact answer).

Thinking models. A reasoning model's server returns its reasoning apart from its
answer (``reasoning_content``), or, without a reasoning parser, the text after
the ``<think>`` its chat template opened: either way the completion's text is
the whole message, ``<think>``, the reasoning, ``</think>``, the answer
(:func:`thinking_text`), as a local thinking model's is read. Use a format that
begins with ``<think>`` (``free_think``, the VAGEN ones) for such a model.

Control tokens. Such a server renders the messages with the model's chat template and tokenizes the result
reading control strings as the control tokens themselves (``turnrl serve-policy`` and vLLM do, as transformers'
``apply_chat_template`` does): feedback that quotes a response holding ``<|im_end|><|im_start|>system`` would end
the user's message and open a system turn, and the model's own earlier text, sent back as assistant messages, is
read the same way (a local model's sampled tokens never are). The policy cannot see the server's tokenizer, so
every text it sends has the usual families' control strings (:data:`CHAT_CONTROL_TEXTS`) broken by a space, as
the rollout breaks a local tokenizer's in what it quotes (``< |im_end|>``).

Images. The rollout puts each image observation in its user message as a
``{"type": "image", "image": array}`` part (the transformers processor
convention); here each becomes an ``image_url`` part holding the image as a
base64 PNG data URL. A part without an array takes its own entry of ``request.images`` (the n-th image part
the n-th array, as the interface lays them out).
A part with no image from either fails that request with an error completion
rather than sending the model a conversation with an image missing. Each
array is encoded once while it stays in the context (a small cache by
identity), not once per turn it is resent.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import io
import random
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import numpy as np

from turnrl.agent.prompts import neutralized
from turnrl.config import SamplingConfig
from turnrl.files import parse_json
from turnrl.policy.interface import Completion, GenerationRequest, Policy

T = TypeVar("T")

RETRY_STATUS = frozenset({408, 409, 429})
"""Client-error statuses that are transient (timeouts, conflicts, rate limits); every 5xx is retried too, but
:data:`PERMANENT_SERVER_STATUS`."""
PERMANENT_SERVER_STATUS = frozenset({501, 505})
"""Server errors that say the server cannot serve this request at all (not implemented, HTTP version): not retried."""
PERMANENT_TLS_REASONS = frozenset({"CERTIFICATE_VERIFY_FAILED", "WRONG_VERSION_NUMBER"})
"""TLS failures that a retry meets again: an untrusted certificate, an ``https`` URL to a plain HTTP server."""
MAX_RESPONSE_BYTES = 32 * 2**20
"""Default cap of an answer's body: a chat completion is kilobytes; a body past this is a broken server's."""
CLIP = 300
"""Characters of a server's body or message that an error quotes."""

CHAT_CONTROL_TEXTS = ("<|", "<\uff5c", "<start_of_turn>", "<end_of_turn>", "[INST]", "[/INST]", "<s>", "</s>")
"""Texts that the chat templates of the models these servers host read as (the start of) control tokens: every
``<|...|>`` (ChatML's ``<|im_start|>`` and ``<|im_end|>``, Qwen-VL's ``<|image_pad|>``, Llama 3's ``<|eot_id|>``,
Phi's ``<|end|>``), DeepSeek's ``<｜...｜>`` (a full-width bar), Gemma's turn markers, Mistral's and Llama 2's.
Breaking ``<|`` breaks every token that starts with it, whatever the model."""

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop", None: "stop"}
"""OpenAI finish reasons -> ours; anything else (e.g. ``content_filter``) is reported as an error."""


@dataclass
class HTTPUsage:
    """Totals over the policy's lifetime, for cost and reliability reporting."""

    requests: int = 0
    """Requests completed successfully."""
    failures: int = 0
    """Requests that ended as error completions."""
    retries: int = 0
    """Attempts repeated after a transient failure."""
    prompt_tokens: int = 0
    """Prompt tokens the server reported."""
    completion_tokens: int = 0
    """Completion tokens the server reported."""


class RequestFailed(Exception):
    """A request that cannot succeed (bad response, 4xx, unresolvable image); not retried."""


class ContextFull(RequestFailed):
    """The server's answer that the conversation no longer fits the model's context window."""


CONTEXT_FULL_CODES = ("context_length_exceeded",)
"""The ``error.code`` of OpenAI (and ``turnrl serve-policy``) for a prompt longer than the model's context."""
CONTEXT_FULL_WORDS = ("maximum context length",)
"""How servers that leave the code out say it (vLLM: "This model's maximum context length is N tokens")."""


def is_context_full(response: httpx.Response) -> bool:
    """Whether a 400 answer says the prompt no longer fits the model's context."""
    if response.status_code != 400:
        return False
    try:
        error = parse_json(response.content).get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict):
        return False
    message = str(error.get("message") or "").lower()
    return error.get("code") in CONTEXT_FULL_CODES or any(words in message for words in CONTEXT_FULL_WORDS)


class _Retryable(Exception):
    """A transient failure; ``retry_after`` is the server's requested wait in seconds, if any."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# --------------------------------------------------------------------------- helpers
_UNNAMED = object()
"""A response that names no matched stop string (neither ``stop_reason`` nor ``matched_stop``)."""


def cut_after_stop(text: str, stops: Sequence[str]) -> str | None:
    """``text`` up to and including the stop string that ends first in it (as a model sampling token by token
    would stop), or None when it holds none."""
    ends = [found + len(stop) for stop in stops if stop and (found := text.find(stop)) >= 0]
    return text[: min(ends)] if ends else None


def chat_completions_url(base_url: str) -> str:
    """``base_url`` + ``/chat/completions``; a bare ``http://host:port`` gets the usual ``/v1`` prefix."""
    base = base_url.rstrip("/")
    if urlsplit(base).path in ("", "/"):
        base += "/v1"
    return base + "/chat/completions"


def image_data_url(image: Any) -> str:
    """An ``HxWx3`` uint8 array (or PIL image) as a ``data:image/png;base64,...`` URL."""
    from PIL import Image

    picture = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def clipped(text: str, limit: int = CLIP) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was when cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_retry_after(headers: httpx.Headers) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP date); None when absent."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_message(response: httpx.Response) -> str:
    """The server's error message (OpenAI's ``{"error": {"message": ...}}`` or FastAPI's ``detail``), clipped; a
    redirect says where to."""
    status = response.status_code
    if 300 <= status < 400:
        where = clipped(response.headers.get("location", "nowhere said"))
        return (f"HTTP {status}: redirected to {where}; redirects are not followed (a POST is not sent elsewhere): "
                "give the final URL as base_url")
    try:
        body = parse_json(response.content)
    except ValueError:
        return f"HTTP {status}: {clipped(response.text)}"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return f"HTTP {status}: {clipped(str(error['message']))}"
        if body.get("detail"):
            return f"HTTP {status}: {clipped(str(body['detail']))}"
    return f"HTTP {status}: {clipped(str(body))}"


def _not_json(response: httpx.Response) -> str:
    """Why a 200 answer cannot be read: its content type (a stream nobody asked for, a login page) and its start."""
    kind = response.headers.get("content-type", "none said")
    stream = "; a stream, though none was asked" if kind.startswith("text/event-stream") else ""
    return (f"the server answered 200 with a body that is not JSON (content-type {clipped(kind, 80)}{stream}): "
            f"{clipped(response.text)!r}")


def _transport_failure(error: Exception) -> str:
    """A connection's failure in one line; an exception without a message says what kind of failure it was."""
    timed_out = isinstance(error, (httpx.TimeoutException, asyncio.TimeoutError))
    detail = str(error) or ("timed out" if timed_out else "the connection failed or broke mid-answer")
    return f"{type(error).__name__}: {detail}"


def permanent_tls_failure(error: BaseException) -> ssl.SSLError | None:
    """The TLS error under a connection error that a retry would meet again (:data:`PERMANENT_TLS_REASONS`)."""
    cause: BaseException | None = error
    for _ in range(8):  # httpx -> httpcore -> ssl: a short chain; bounded against a cyclic one
        if cause is None:
            return None
        if isinstance(cause, ssl.SSLError) and cause.reason in PERMANENT_TLS_REASONS:
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def message_text(content: Any) -> str | None:
    """A response message's text: its content string, or the text of its text parts joined (the content-parts
    form some servers answer in); "" for no content; None for content that is neither."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type") == "text"]
        if all(isinstance(text, str) for text in texts):
            return "".join(texts)
    return None


REASONING_FIELDS = ("reasoning_content", "reasoning")
"""Where servers return a thinking model's reasoning apart from its answer: vLLM's and SGLang's reasoning parsers
and DeepSeek's API (``reasoning_content``), newer vLLM and OpenRouter (``reasoning``)."""


def thinking_text(message: dict[str, Any], content: str) -> str:
    """The assistant message as a thinking model wrote it after its prompt, which its chat template ended with
    ``<think>\\n``: the reasoning, ``</think>``, then the answer. The parser reads it so, as it reads a local thinking
    model's (:meth:`~turnrl.agent.formats.ResponseFormat.under_template`).

    A server with a reasoning parser returns the reasoning apart (:data:`REASONING_FIELDS`): it is put back in front
    of ``content``. A server without one returns what the model wrote, which then closes a ``</think>`` that nothing
    in it opened: the template's ``<think>\\n`` is put back. Any other ``content`` is the message as it is.
    """
    reasoning = next((value for field in REASONING_FIELDS if isinstance(value := message.get(field), str) and value),
                     None)
    if reasoning is not None and not content.strip():  # cut inside its reasoning (max tokens): no answer, no close
        return "<think>\n" + reasoning
    if reasoning is not None:
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    closing = content.find("</think>")
    if closing >= 0 and "<think>" not in content[:closing]:
        return "<think>\n" + content
    return content


def reported_tokens(data: dict[str, Any]) -> tuple[int, int]:
    """The prompt and completion tokens a response's ``usage`` reports; 0 for what it leaves out or garbles (the
    counts are bookkeeping: a server's odd ``usage`` must not fail a batch whose answers are fine)."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        return 0, 0
    counts = []
    for key in ("prompt_tokens", "completion_tokens"):
        try:
            counts.append(max(0, int(usage.get(key) or 0)))
        except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite count (JSON's 1e400)
            counts.append(0)
    return counts[0], counts[1]


def _run_sync(coroutine: Awaitable[T]) -> T:
    """Run ``coroutine`` to completion from synchronous code, even if this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)  # type: ignore[arg-type]
    # Called from inside an event loop (a notebook, an async app): run on a fresh loop in another thread.
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = asyncio.run(coroutine)  # type: ignore[arg-type]
        except BaseException as error:  # re-raised in the caller's thread
            result["error"] = error

    thread = threading.Thread(target=target, name="openai-policy", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


# --------------------------------------------------------------------------- images
def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


class _PngCache:
    """Data URLs of recently sent arrays, keyed by identity (the arrays are held, so ids stay valid)."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._urls: OrderedDict[int, tuple[Any, str]] = OrderedDict()
        self._lock = threading.Lock()

    def url(self, image: Any) -> str:
        with self._lock:
            hit = self._urls.get(id(image))
            if hit is not None and hit[0] is image:
                self._urls.move_to_end(id(image))
                return hit[1]
        url = image_data_url(image)
        with self._lock:
            self._urls[id(image)] = (image, url)
            while len(self._urls) > self.size:
                self._urls.popitem(last=False)
        return url


# --------------------------------------------------------------------------- the policy
class OpenAIPolicy(Policy):
    """Chat completions from an OpenAI-compatible server.

    Args:
        base_url: the API root, e.g. ``http://localhost:8000/v1`` (as for the ``openai``
            client; a bare ``http://host:port`` gets ``/v1``).
        model: the model name the server serves.
        api_key: sent as ``Authorization: Bearer <key>`` when given.
        concurrency: requests in flight at once.
        timeout_s: limit of one attempt, connection to last byte.
        max_retries: attempts after the first for transient failures.
        backoff_s: first retry delay; doubles each attempt (with jitter) up to ``max_backoff_s``.
        max_backoff_s: cap of the exponential delay.
        max_retry_after_s: cap of a server's ``Retry-After`` wait.
        max_response_bytes: cap of an answer's body (decoded); a longer one fails its request unread.
        extra_body: fields added to every request body (server-specific options).
        transport: an ``httpx`` transport to send through instead of the network (tests, proxies).
        control_texts: texts broken by a space wherever a message holds them (module docstring); each of two
            characters or more, without a space among its first two.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        max_retry_after_s: float = 60.0,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        extra_body: dict[str, Any] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        control_texts: Sequence[str] = CHAT_CONTROL_TEXTS,
    ) -> None:
        neutralized("", control_texts)  # refuses here, not at the first request, a text no space can break
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.url = chat_completions_url(base_url)
        self.model_name = model
        """The model the requests name (``model`` of their bodies)."""
        self.api_key = api_key
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.max_response_bytes = max_response_bytes
        self.extra_body = dict(extra_body or {})
        self.transport = transport
        self.control_texts = tuple(control_texts)
        self.usage = HTTPUsage()
        self._usage_lock = threading.Lock()
        self._png = _PngCache()
        self.server_names_stops: bool | None = None
        """Whether the server says which stop string ended a response (None: not yet seen). False sends it no
        stop strings: the policy cuts the responses itself (module docstring)."""

    # ------------------------------------------------------------------ public
    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        """Complete every request; failures come back as ``finish_reason="error"`` completions."""
        if not requests:
            return []
        return _run_sync(self._generate_all(list(requests), sampling))

    def request_body(self, request: GenerationRequest, sampling: SamplingConfig) -> dict[str, Any]:
        """The JSON body of one chat-completions call.

        Raises:
            RequestFailed: an image placeholder has no image data.
        """
        limit = sampling.max_new_tokens
        if request.max_new_tokens is not None:
            limit = min(limit, request.max_new_tokens)
        body: dict[str, Any] = {
            "model": self.model_name,
            "messages": self._messages(request),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": limit,
        }
        if sampling.stop and self.server_names_stops is not False:
            body["stop"] = list(sampling.stop)
        if sampling.top_k:
            body["top_k"] = sampling.top_k  # not in OpenAI's API; vLLM, SGLang and turnrl's server accept it
        body.update(self.extra_body)
        return body

    # ------------------------------------------------------------------ internals
    async def _generate_all(self, requests: list[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        semaphore = asyncio.Semaphore(self.concurrency)
        timeout = httpx.Timeout(self.timeout_s)
        client = httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, transport=self.transport)
        async with client:
            return list(await asyncio.gather(*(self._complete(client, semaphore, r, sampling) for r in requests)))

    async def _complete(
        self,
        client: httpx.AsyncClient,
        semaphore: asyncio.Semaphore,
        request: GenerationRequest,
        sampling: SamplingConfig,
    ) -> Completion:
        try:
            body = self.request_body(request, sampling)
            async with semaphore:
                data = await self._post_with_retries(client, body)
            completion = self._completion(data, sampling, cut_locally="stop" not in body)
            if completion is None:  # a stop string may have been cut unnamed: ask again, cutting here
                self._count_tokens(data)
                body.pop("stop")
                async with semaphore:
                    data = await self._post_with_retries(client, body)
                completion = self._completion(data, sampling, cut_locally=True)
                assert completion is not None
        except ContextFull as full:  # the episode has outgrown the model: cut by its context budget
            return Completion(text="", finish_reason="context", error=f"{self.url}: {full}")
        except Exception as error:  # one request's failure is its own error completion
            what = str(error) if isinstance(error, RequestFailed) else f"{type(error).__name__}: {error}"
            message = f"{self.url}: {clipped(what, 4 * CLIP)}"
            with self._usage_lock:
                self.usage.failures += 1
            return Completion(text="", finish_reason="error", error=message)
        with self._usage_lock:
            if completion.finish_reason == "error":
                self.usage.failures += 1
            else:
                self.usage.requests += 1
        self._count_tokens(data)  # billed even when the answer is unusable
        return completion

    def _count_tokens(self, data: dict[str, Any]) -> None:
        prompt_tokens, completion_tokens = reported_tokens(data)
        with self._usage_lock:
            self.usage.prompt_tokens += prompt_tokens
            self.usage.completion_tokens += completion_tokens

    async def _post_with_retries(self, client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body``; retries transient failures, raises :class:`RequestFailed` when out of attempts."""
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            try:
                return await self._post_once(client, body)
            except _Retryable as failure:
                if attempt + 1 == attempts:
                    raise RequestFailed(f"gave up after {attempts} attempts; last error: {failure}") from None
                with self._usage_lock:
                    self.usage.retries += 1
                await asyncio.sleep(self._delay(attempt, failure.retry_after))
        raise AssertionError("unreachable")

    async def _post_once(self, client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        try:
            # httpx's timeout bounds each phase; wait_for bounds the whole attempt, a body that drips included.
            response = await asyncio.wait_for(self._read_answer(client, body), self.timeout_s)
        except (httpx.TransportError, asyncio.TimeoutError) as error:
            tls = permanent_tls_failure(error)
            if tls is not None:
                raise RequestFailed(f"TLS failed (not retried): {tls}") from None
            raise _Retryable(_transport_failure(error)) from None
        status = response.status_code
        if status == 200:
            try:
                data = parse_json(response.content)
            except ValueError:  # not JSON, not text, or nested deeper than Python reads
                raise RequestFailed(_not_json(response)) from None
            said = data.get("error") if isinstance(data, dict) and "choices" not in data else None
            if said:  # some gateways answer a failure with 200 and OpenAI's error body
                message = (said.get("message") or said) if isinstance(said, dict) else said
                raise RequestFailed(f"the server answered 200 with an error: {clipped(str(message))}")
            return data
        message = _error_message(response)
        if status in RETRY_STATUS or (status >= 500 and status not in PERMANENT_SERVER_STATUS):
            raise _Retryable(message, parse_retry_after(response.headers))
        raise (ContextFull if is_context_full(response) else RequestFailed)(message)

    async def _read_answer(self, client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
        """The answer to one POST, its body read whole, but no further than ``max_response_bytes``.

        Raises:
            RequestFailed: the body (as declared, or as read) is longer than that.
        """
        limit = self.max_response_bytes
        async with client.stream("POST", self.url, json=body) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit and response.headers.get("content-encoding") is None:
                raise RequestFailed(f"HTTP {response.status_code} with a body of {declared} bytes, over the "
                                    f"{limit} this client reads (max_response_bytes)")
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise RequestFailed(f"HTTP {response.status_code} with a body over the {limit} bytes this "
                                        "client reads (max_response_bytes)")
                chunks.append(chunk)
        # The body as read is already decoded: the rebuilt answer must not decode it again.
        headers = [(key, value) for key, value in response.headers.multi_items()
                   if key.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=b"".join(chunks),
                              request=response.request)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before the next attempt: the server's ``Retry-After`` if given, else jittered exponential backoff."""
        if retry_after is not None:
            return min(retry_after, self.max_retry_after_s)
        ceiling = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return random.uniform(ceiling / 2, ceiling)  # jitter spreads the retries of a batch that failed together

    def _completion(self, data: dict[str, Any], sampling: SamplingConfig, cut_locally: bool) -> Completion | None:
        """The completion of a response; None when it may have lost a stop string the server did not name
        (asked again by the caller). With ``cut_locally`` the request carried no stop strings: the text is cut
        after the first one it holds. A thinking model's reasoning comes back in front of its answer
        (:func:`thinking_text`)."""
        try:
            choice = data["choices"][0]
            message = choice["message"]
            text = message_text(message.get("content"))
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RequestFailed(f"the response has no choices[0].message: {clipped(str(data))}") from None
        if text is None:
            raise RequestFailed(f"the response's message content is not text: {clipped(str(choice['message']))}")
        reason = choice.get("finish_reason")
        if not (reason is None or isinstance(reason, str)) or reason not in FINISH_REASONS:
            why = f"{self.url}: the server stopped with finish_reason={clipped(repr(reason))}"
            return Completion(text=thinking_text(message, text), finish_reason="error", error=why)
        finish = FINISH_REASONS[reason]
        if sampling.stop and cut_locally:
            cut = cut_after_stop(text, sampling.stop)
            text, finish = (text, finish) if cut is None else (cut, "stop")
        elif sampling.stop:
            named = choice.get("stop_reason", choice.get("matched_stop", _UNNAMED))
            if named is _UNNAMED:
                self.server_names_stops = False
                if reason == "stop" and not text.endswith(tuple(sampling.stop)):
                    return None
            else:
                self.server_names_stops = True
                # The server cut the string it names; restoring it keeps the text equal to a local model's.
                if isinstance(named, str) and named in sampling.stop and not text.endswith(named):
                    text += named
        return Completion(text=thinking_text(message, text), finish_reason=finish)

    def _messages(self, request: GenerationRequest) -> list[dict[str, Any]]:
        """The request's messages as sent: their texts without control texts (``< |im_end|>``: module docstring),
        every image placeholder an ``image_url`` part."""
        images = request.images or []
        index = 0  # of the image part, over the whole conversation: request.images[index] is its array
        messages = []
        for message in request.messages:
            content = message.get("content")
            if isinstance(content, str):
                messages.append({**message, "content": neutralized(content, self.control_texts)})
                continue
            if not isinstance(content, list):
                messages.append(message)
                continue
            parts = []
            for part in content:
                if _is_text_part(part):
                    parts.append({**part, "text": neutralized(part["text"], self.control_texts)})
                    continue
                if not _is_image_part(part):
                    parts.append(part)
                    continue
                image = part.get("image")
                if image is None and index < len(images):
                    image = images[index]
                index += 1
                if image is None:
                    raise RequestFailed(
                        f"a {message.get('role')} message has an image part without image data: put the array in "
                        "the part ({'type': 'image', 'image': array}) or in request.images"
                    )
                parts.append({"type": "image_url", "image_url": {"url": self._png.url(image)}})
            messages.append({**message, "content": parts})
        return messages
