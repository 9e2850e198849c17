"""OpenAIPolicy against broken and hostile servers: a real HTTP server on a free localhost port answers each request
as the test says (bytes as they go on the wire, a reset, a drip). Each bad answer must end its own request with an
error naming the server and what was wrong, within bounded time, and leave the others whole."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import count

import httpx
import pytest

from turnrl.config import AgentConfig, EnvConfig, SamplingConfig
from turnrl.eval_config import EvalConfig
from turnrl.evaluate import run_eval
from turnrl.policy.interface import GenerationRequest
from turnrl.policy.openai_http import OpenAIPolicy, parse_retry_after

Answer = Callable[[socket.socket], None]
"""What the server does with a connection whose request it has read."""


def ask(text: str = "hi") -> GenerationRequest:
    return GenerationRequest(prompt_ids=None, messages=[{"role": "user", "content": text}])


def wire(status: int, body: bytes, content_type: str = "application/json", *headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} Status", f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
             "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def completion(text: object = "hello", finish_reason: object = "stop", usage: str = '{"prompt_tokens": 3}') -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
              "stop_reason": None}
    return f'{{"choices": [{json.dumps(choice)}], "usage": {usage}}}'.encode()


def sends(data: bytes) -> Answer:
    return lambda conn: conn.sendall(data)


def read_request(conn: socket.socket) -> bytes:
    """The request's body (the head read up to its blank line, then Content-Length bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return body


def accept_each(listener: socket.socket, handle: Callable[[socket.socket], None]) -> None:
    """``handle`` each connection ``listener`` accepts, on a thread of its own, until the listener is closed."""
    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()


@contextmanager
def serving(answer: Callable[[bytes], Answer]) -> Iterator[tuple[str, list[bytes]]]:
    """A server that answers each request's body with ``answer(body)``; yields its base URL and the bodies asked."""
    listener = socket.create_server(("127.0.0.1", 0))
    asked: list[bytes] = []

    def handle(conn: socket.socket) -> None:
        with conn:
            try:
                body = read_request(conn)
                asked.append(body)
                answer(body)(conn)
            except OSError:  # the client hung up first: its side of the test says what it saw
                pass

    accept_each(listener, handle)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1", asked
    finally:
        listener.close()


def against(answer: Answer, *requests: GenerationRequest, **options):
    """The completions of ``requests`` (one by default) from a server that answers every request with ``answer``,
    the policy's usage, and how many requests the server read."""
    options = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.001, "max_backoff_s": 0.01, **options}
    with serving(lambda body: answer) as (url, asked):
        policy = OpenAIPolicy(url, "m", **options)
        out = policy.generate(list(requests) or [ask()], SamplingConfig(max_new_tokens=4))
    return out, policy, len(asked)


# --------------------------------------------------------------------------- what a 200 may hold
@pytest.mark.parametrize(("body", "said"), [
    (b'{"choices": [,', "not JSON (content-type application/json)"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # nested past Python's stack: was a RecursionError
    (b'{"id": "x"}', "no choices[0].message"),
    (b'{"choices": []}', "no choices[0].message"),
    (b'{"choices": [{"message": null}]}', "no choices[0].message"),
    (b"[1, 2]", "no choices[0].message"),
    (completion(3), "content is not text"),
    (completion([1, 2]), "content is not text"),
    (completion("x", ["stop"]), "finish_reason=['stop']"),  # unhashable: was "TypeError: unhashable type"
    (completion("x", {"why": 1}), "finish_reason={'why': 1}"),
    (completion("x", "banana"), "finish_reason='banana'"),
    (b'{"error": {"message": "provider down", "code": 502}}', "answered 200 with an error: provider down"),
], ids=["bad-json", "deep-json", "no-choices", "empty-choices", "null-message", "a-list", "number-content",
        "list-content", "list-finish", "dict-finish", "unknown-finish", "error-body"])
def test_a_200_that_is_no_chat_completion_errors_once_naming_the_server_and_what_was_wrong(body, said):
    (out,), policy, asked = against(sends(wire(200, body)))
    assert out.finish_reason == "error" and said in out.error
    assert out.error.startswith(policy.url + ": ") and asked == 1  # not retried: the same answer would come back


@pytest.mark.parametrize(("content_type", "body", "said"), [
    ("text/html", b"<html><body>Log in first</body></html>", "(content-type text/html): '<html><body>Log in"),
    ("text/event-stream", b'data: {"choices": []}\n\ndata: [DONE]\n\n', "a stream, though none was asked"),
])
def test_a_200_that_is_a_page_or_a_stream_says_its_content_type(content_type, body, said):
    (out,), _, _ = against(sends(wire(200, body, content_type)))
    assert out.finish_reason == "error" and "not JSON" in out.error and said in out.error


def test_an_infinite_token_count_in_usage_keeps_the_answer_and_the_batch():
    """JSON's 1e400 is float infinity: int() of it raised OverflowError out of generate, failing the whole batch."""
    answer = sends(wire(200, completion("fine", usage='{"prompt_tokens": 1e400, "completion_tokens": 2}')))
    out, policy, _ = against(answer, ask("a"), ask("b"))
    assert [(c.text, c.finish_reason) for c in out] == [("fine", "stop")] * 2
    assert (policy.usage.prompt_tokens, policy.usage.completion_tokens) == (0, 4)


def test_a_server_message_is_clipped():
    (out,), _, _ = against(sends(wire(400, json.dumps({"detail": "x" * 100_000}).encode())))
    assert out.error.count("x") < 400 and "(100000 characters)" in out.error


def test_a_400_nested_past_python_s_stack_errors_once_as_any_400():
    """Whether a 400 says the context is full reads its body as JSON too: a body nested deeper than the parser
    follows raised RecursionError there, and the episode's error was Python's words instead of the server's."""
    (out,), _, asked = against(sends(wire(400, b"[" * 100_000)))
    assert out.finish_reason == "error" and "HTTP 400: [[[" in out.error and "(100000 characters)" in out.error
    assert asked == 1


# --------------------------------------------------------------------------- statuses
def test_a_redirect_is_not_followed_and_says_where_it_led():
    answer = sends(wire(307, b"", "text/plain", "Location: /elsewhere/v1/chat/completions"))
    (out,), _, asked = against(answer)
    assert out.finish_reason == "error" and asked == 1
    assert "HTTP 307: redirected to /elsewhere/v1/chat/completions" in out.error and "base_url" in out.error


@pytest.mark.parametrize(("status", "attempts"), [(500, 3), (502, 3), (503, 3), (501, 1), (505, 1)])
def test_server_errors_are_retried_but_those_that_say_never(status, attempts):
    (out,), policy, asked = against(sends(wire(status, b'{"error": {"message": "no luck"}}')))
    assert out.finish_reason == "error" and f"HTTP {status}: no luck" in out.error
    assert asked == attempts and policy.usage.retries == attempts - 1


@pytest.mark.parametrize("retry_after", ["1e9", "inf", "-5", "nan", "Wed, 21 Oct 2099 07:28:00 GMT", "soon"])
def test_an_absurd_retry_after_waits_at_most_the_cap(retry_after):
    waits = []
    policy = OpenAIPolicy("http://x/v1", "m", max_retry_after_s=0.05, max_backoff_s=0.05)
    for attempt in range(3):
        waits.append(policy._delay(attempt, parse_retry_after(httpx.Headers({"retry-after": retry_after}))))
    assert all(0 <= wait <= 0.05 for wait in waits), waits
    (out,), _, asked = against(sends(wire(429, b"{}", "application/json", f"Retry-After: {retry_after}")),
                               max_retry_after_s=0.05)
    assert "gave up after 3 attempts; last error: HTTP 429" in out.error and asked == 3


# --------------------------------------------------------------------------- connections
def reset_mid_body(conn: socket.socket) -> None:
    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"choi')
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close with a RST


def test_a_connection_reset_mid_body_is_retried_and_not_called_a_timeout():
    (out,), _, asked = against(reset_mid_body)
    assert asked == 3 and "gave up after 3 attempts" in out.error
    assert "timed out" not in out.error and "broke mid-answer" in out.error  # the judge counts "timed out"


def drip(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    for _ in range(200):
        conn.sendall(b" ")
        time.sleep(0.02)


def test_a_body_that_never_ends_is_cut_at_the_attempts_timeout():
    """Each byte comes before httpx's read timeout: only the whole attempt's limit ends it."""
    (out,), _, asked = against(drip, timeout_s=0.3, max_retries=1)
    assert out.finish_reason == "error" and "TimeoutError: timed out" in out.error and asked == 2


def stream_endless_body(chunked: bool) -> Answer:
    def answer(conn: socket.socket) -> None:
        block = b" " * 65536
        if chunked:
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(1600):  # 100 MiB, unless the client hangs up first
                conn.sendall(b"10000\r\n" + block + b"\r\n")
        else:
            conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {100 * 2**20}\r\n\r\n".encode())
            for _ in range(1600):
                conn.sendall(block)
    return answer


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_huge_body_is_not_read_past_the_cap(chunked):
    (out,), _, asked = against(stream_endless_body(chunked), max_response_bytes=100_000)
    assert out.finish_reason == "error" and "max_response_bytes" in out.error and "100000" in out.error
    assert asked == 1


def test_a_tls_failure_is_not_retried():
    """An https URL to a plain HTTP server (which answers the TLS hello with an HTTP error): every attempt would
    fail the same handshake."""
    listener = socket.create_server(("127.0.0.1", 0))
    hellos = []

    def answer_plainly(conn: socket.socket) -> None:
        with conn:
            hellos.append(conn.recv(4096))
            conn.sendall(wire(400, b""))

    accept_each(listener, answer_plainly)
    try:
        url = f"https://127.0.0.1:{listener.getsockname()[1]}/v1"
        policy = OpenAIPolicy(url, "m", timeout_s=5.0, max_retries=2, backoff_s=0.001)
        [out] = policy.generate([ask()], SamplingConfig(max_new_tokens=4))
    finally:
        listener.close()
    assert out.finish_reason == "error" and "TLS failed (not retried)" in out.error
    assert out.error.startswith(url) and policy.usage.retries == 0 and len(hellos) == 1


# --------------------------------------------------------------------------- a whole evaluation
BROKEN = [  # (what the server sends, what the episode's error says)
    (wire(200, b'{"choices": [,'), "not JSON"),
    (wire(200, b"<html>Log in</html>", "text/html"), "content-type text/html"),
    (wire(200, b'{"choices": []}'), "no choices[0].message"),
    (wire(200, completion(7)), "content is not text"),
    (wire(200, completion("x", ["stop"])), "finish_reason=['stop']"),
    (wire(307, b"", "text/plain", "Location: /v2"), "redirected to /v2"),
    (wire(501, b"nope", "text/plain"), "HTTP 501: nope"),
]


def test_an_evaluation_against_a_server_whose_every_third_answer_is_broken_errors_those_episodes_only(tmp_path):
    """Each broken answer (none worth a retry) ends its own episode, with an error that names the server and says
    what was wrong; every other episode is whole. A good answer now and then reports an infinite token count,
    which used to raise out of the batch and fail every episode in it."""
    numbers = count()
    lock = threading.Lock()
    broken_said: list[str] = []

    def answer(body: bytes) -> Answer:
        with lock:
            number = next(numbers)
            if number % 3 == 2:
                data, said = BROKEN[(number // 3) % len(BROKEN)]
                broken_said.append(said)
                return sends(data)
        usage = '{"prompt_tokens": 1e400}' if number % 4 == 0 else '{"prompt_tokens": 5}'
        return sends(wire(200, completion("<think>wait</think><answer>Left</answer>", usage=usage)))

    with serving(answer) as (url, asked):
        summary = run_eval(EvalConfig(
            env=EnvConfig(id="FrozenLake"), agent=AgentConfig(max_turns=4), policy="openai:m", base_url=url,
            sampling=SamplingConfig(max_new_tokens=16), concurrency=3, episodes=9, out=str(tmp_path),
        ))
    trajectories = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajectories) == 9 and len(asked) > 9
    errors = [t["error"] for t in trajectories if t["error"] is not None]
    assert summary["errors"] == len(errors) == len(broken_said) > 0
    assert all(error.count(url + "/chat/completions") == 1 for error in errors), errors
    for said in broken_said:  # each broken answer is said by the error of the episode it ended
        assert any(said in error for error in errors), (said, errors)
    for whole in (t for t in trajectories if t["error"] is None):
        assert whole["turns"] and all(turn["finish_reason"] == "stop" for turn in whole["turns"])
