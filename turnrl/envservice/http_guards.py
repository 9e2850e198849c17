"""What turnrl's two HTTP servers (the env server and the policy server) share in front of their routes: their
port, taken before anything is served (:func:`bind_port`), bounds on request bodies (:class:`BodyLimit`: their
size, and with a :class:`BodyDeadline` the time they take to arrive), the check of a token before it is served
(:func:`check_token`), and which hosts are this machine's alone (:func:`is_loopback`)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from turnrl.config import ConfigError


def bind_port(host: str, port: int, command: str) -> socket.socket:
    """A socket bound to ``host:port`` for the server that ``command`` (``serve-env``, ``serve-policy``) starts,
    not yet listening: uvicorn listens on it once the server is ready (the policy server's model loaded).

    Taken before the server says it is serving (and before a model loads), so that a busy port or a bad host is
    one line at once rather than uvicorn's log after the "serving" line, and no other process can take the port
    meanwhile.

    Raises:
        ConfigError: the port is in use or not allowed, or ``host`` is no address of this machine.
    """
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigError(f"--host {host!r} is not an address to listen on ({error}); give an address of this "
                          "machine, e.g. 127.0.0.1 or 0.0.0.0") from error
    sock = socket.socket(family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use (another server, or a {command} still running); "
                              "pick a free one with --port N, or stop what listens there") from error
        if error.errno == errno.EACCES:
            raise ConfigError(f"port {port} needs administrator rights here; pick one from 1024 with --port N") \
                from error
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror}; pick another --host or --port") \
            from error
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class BodyDeadline:
    """How long a request's body may take to arrive: all of it within ``total_s`` seconds of its request's headers,
    with no wait over ``stall_s`` for its next bytes. A body sent slowly but steadily within them is read whole."""

    total_s: float
    stall_s: float
    timed_out: Callable[[], Response]
    """The answer to a body that did not arrive in time (a 408); its connection is closed after it."""

    def __post_init__(self) -> None:
        if not (self.total_s > 0 and self.stall_s > 0):
            raise ValueError(f"a body's deadlines must be > 0 seconds, got {self.total_s} and {self.stall_s}")


class _Late(Exception):
    """A body whose next bytes did not come within its deadline."""


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered with ``too_large`` (and ``on_reject``
    called): at once when ``Content-Length`` says so, else the moment the bytes counted as they arrive pass it
    (a missing or lying length, chunked transfer encoding), so that at most ``limit`` bytes are ever held and
    the rest is never read. Written by hand: uvicorn bounds no body, and Starlette's
    ``RequestBodyLimitMiddleware`` is newer than the Starlette that ``fastapi>=0.110`` allows and answers in
    plain text, where each server's clients expect its own error shape.

    With ``total_limit``, the bodies of the requests in flight (read, or being read, and not yet answered)
    together hold at most that many bytes: a request that would pass it is answered with ``busy`` (a 503 to
    retry), read no further. Each body alone is bounded, but many large ones at once, each waiting for its
    turn, would otherwise hold memory without bound. With ``client_limit``, the bodies one client (one peer
    address) is still sending hold at most that many bytes of it (``client_busy`` past it): a client that
    stalls its uploads cannot take the whole bound and lock every other client out. With ``deadline``, a body
    that does not arrive in time is answered with its ``timed_out`` and its bytes are freed: uvicorn waits for a
    body without end.
    """

    def __init__(self, app: Any, limit: int, too_large: Callable[[], Response],
                 on_reject: Callable[[], None] = lambda: None, total_limit: int | None = None,
                 busy: Callable[[], Response] | None = None, client_limit: int | None = None,
                 client_busy: Callable[[], Response] | None = None, deadline: BodyDeadline | None = None) -> None:
        if (total_limit is None) != (busy is None) or (client_limit is None) != (client_busy is None):
            raise ValueError("a bound on the bodies in flight and its answer go together")
        self.app, self.limit, self.too_large, self.on_reject = app, limit, too_large, on_reject
        self.total_limit, self.busy = total_limit, busy
        self.client_limit, self.client_busy = client_limit, client_busy
        self.deadline = deadline
        self.held = 0
        """Bytes of the bodies in flight (the event loop's one thread counts them)."""
        self.arriving: dict[str, int] = {}
        """Bytes of the bodies still arriving, by client address (one with none is not listed)."""

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self.refuse(scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else ""
        next_part = self._timed(receive)
        chunks, size, more, arriving = [], 0, True, 0
        try:
            while more:
                try:
                    message = await next_part()
                except _Late:
                    assert self.deadline is not None
                    answer = self.deadline.timed_out()
                    answer.headers["connection"] = "close"  # the rest of its body is not read: nothing more to say
                    await answer(scope, receive, send)
                    return
                if message["type"] == "http.disconnect":  # the client went away: nothing to answer
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                self.held += len(chunk)
                arriving += len(chunk)
                self.arriving[client] = self.arriving.get(client, 0) + len(chunk)
                if size > self.limit:
                    await self.refuse(scope, receive, send)
                    return
                if self.client_limit is not None and self.arriving[client] > self.client_limit:
                    assert self.client_busy is not None
                    await self.client_busy()(scope, receive, send)
                    return
                if self.total_limit is not None and self.held > self.total_limit:
                    assert self.busy is not None
                    await self.busy()(scope, receive, send)
                    return
                chunks.append(chunk)
                more = message.get("more_body", False)
            self._arrived(client, arriving)
            arriving = 0
            body, replayed = b"".join(chunks), False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: the disconnect, when the client goes

            await self.app(scope, replay, send)
        finally:
            self.held -= size
            self._arrived(client, arriving)

    def _timed(self, receive: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        """``receive`` within the deadline: raises :class:`_Late` when the next part does not come in time."""
        if self.deadline is None:
            return receive
        deadline = self.deadline
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline.total_s

        async def timed() -> Any:
            wait = min(deadline.stall_s, end - loop.time())
            try:
                return await asyncio.wait_for(receive(), timeout=max(wait, 0.0))
            except asyncio.TimeoutError:
                raise _Late() from None

        return timed

    def _arrived(self, client: str, size: int) -> None:
        """``size`` bytes of ``client``'s no longer arriving (the body is read whole, or its request ended)."""
        left = self.arriving.get(client, 0) - size
        if left > 0:
            self.arriving[client] = left
        else:
            self.arriving.pop(client, None)

    async def refuse(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                     send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        self.on_reject()
        await self.too_large()(scope, receive, send)


def check_token(token: str | None) -> None:
    """Refuse a token no client could send: the ``Authorization`` header carries printable ASCII (HTTP reads
    other bytes as latin-1, so a key with other characters never matches) without spaces at its ends (they are
    stripped from what a client sends).

    Raises:
        ValueError: one line saying what the token may hold.
    """
    if token is not None and not (token and token.isascii() and token.isprintable() and token.strip() == token):
        raise ValueError("the token must be printable ASCII, without spaces at its ends (it travels in the "
                         "Authorization header): pick another, e.g. `python -c 'import secrets; "
                         "print(secrets.token_urlsafe())'`")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
