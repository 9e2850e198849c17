"""The policy server against clients that would hold it: stalled uploads, prompts too long to tokenize, clients
that leave mid-generation, names too long to echo. A real uvicorn server with the tiny built-in model."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest

from tests.serve.running import running
from tests.serve.test_policy import HI, MODEL, GatedPolicy
from turnrl.config import ModelConfig
from turnrl.models.builtin import builtin_model_path
from turnrl.policy.hf import HFPolicy
from turnrl.serve.chat_schema import MAX_MESSAGES, APIError, ChatCompletionRequest
from turnrl.serve.policy import create_app
from turnrl.serve.preparation import context_length, longest_token_chars, prepare

LIMIT_MB = 1 / 64
"""A small --max-request-mb (16 KiB): stalled bodies of its size fill the bounds at once."""


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> HFPolicy:
    config = ModelConfig(builtin_preset="tiny", builtin_dir=str(tmp_path_factory.mktemp("models")))
    return HFPolicy.from_config(ModelConfig(device="cpu"), str(builtin_model_path(config)), max_batch_size=16)


def address(url: str) -> tuple[str, int]:
    return "127.0.0.1", int(url.split(":")[-1].split("/")[0])


def open_upload(url: str, length: int, body: bytes, source: str = "127.0.0.1") -> socket.socket:
    """A connection that sent a chat request's headers, saying ``length`` bytes of body, and ``body`` of them."""
    sock = socket.create_connection(address(url), source_address=(source, 0))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode() + body)
    return sock


def answer(sock: socket.socket, timeout_s: float = 10) -> tuple[int, dict]:
    """The status and JSON body of the response on ``sock``."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < content_length(data):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


# --------------------------------------------------------------------------- uploads that stall
def test_a_stalled_upload_is_a_408_and_its_connection_is_closed(policy):
    """uvicorn waits for a body without end: a client that sent part of one and stopped held its bytes (and the
    server's bound on bodies in flight) until it hung up."""
    with running(create_app(policy, MODEL, max_request_mb=LIMIT_MB, body_timeout_s=5, body_stall_s=0.3)) as url:
        with open_upload(url, 1000, b"{" * 500) as sock:
            status, body = answer(sock)
            assert status == 408 and body["error"]["code"] == "request_timeout"
            assert "0.3 s at most for its next bytes" in body["error"]["message"]
            assert sock.recv(10) == b""  # closed: the rest of the body is not waited for


def send_slowly(url: str, body: bytes, pieces: int, pause_s: float) -> tuple[int, dict]:
    """``body`` sent in ``pieces`` parts, ``pause_s`` apart; the answer (given as soon as the server gives one)."""
    with open_upload(url, len(body), b"") as sock:
        size = -(-len(body) // pieces)
        for start in range(0, len(body), size):
            readable, _, _ = select.select([sock], [], [], pause_s)
            if readable:  # answered before the body was whole
                break
            sock.sendall(body[start : start + size])
        return answer(sock)


def test_a_body_sent_slowly_but_steadily_is_read_within_the_deadline_and_not_past_it(policy):
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 2}).encode()
    with running(create_app(policy, MODEL, body_timeout_s=1.5, body_stall_s=0.6)) as url:
        status, answered = send_slowly(url, body, pieces=5, pause_s=0.1)
        assert status == 200, answered
        status, answered = send_slowly(url, body, pieces=10, pause_s=0.3)  # each pause short, all of them not
        assert status == 408 and answered["error"]["code"] == "request_timeout"


def test_one_client_s_stalled_uploads_cannot_lock_the_other_clients_out(policy):
    """Eight uploads of just under --max-request-mb each, stalled, held the server's whole bound on bodies in
    flight (8 x --max-request-mb): every other client got a 503 until they hung up. One client (one address) may
    now be sending twice --max-request-mb at once; its next upload is the 503."""
    limit = int(LIMIT_MB * (1 << 20))
    try:
        socket.create_connection(("127.0.0.1", 1), source_address=("127.0.0.2", 0), timeout=1).close()
    except ConnectionRefusedError:
        pass
    except OSError as error:  # not Linux, where all of 127/8 is this machine
        pytest.skip(f"127.0.0.2 is not an address of this machine: {error}")
    with running(create_app(policy, MODEL, max_request_mb=LIMIT_MB, body_stall_s=30)) as url:
        stalled = [open_upload(url, limit, b" " * (limit - 10), source="127.0.0.2") for _ in range(8)]
        try:
            deadline = time.monotonic() + 3
            answered: list[socket.socket] = []
            while len(answered) < 6 and time.monotonic() < deadline:
                readable, _, _ = select.select([s for s in stalled if s not in answered], [], [], 0.1)
                answered += readable
            other = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2},
                               timeout=60)
            assert other.status_code == 200, other.text
            assert len(answered) == 6
            status, refused = answer(answered[0])
            assert status == 503 and refused["error"]["code"] == "server_busy"
            assert "this client is sending 0.03125 MiB of requests at once" in refused["error"]["message"]
        finally:
            for sock in stalled:
                sock.close()


# --------------------------------------------------------------------------- prompts too long to tokenize
def test_the_longest_token_bounds_the_characters_every_token_spans(policy):
    longest = longest_token_chars(policy.tokenizer)
    assert longest == max(len(token) for token in policy.tokenizer.get_vocab())
    assert all(len(policy.tokenizer.decode([i])) <= longest for i in range(len(policy.tokenizer)))


def refusing_tokenizer(policy: HFPolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the prompt was tokenized")

    monkeypatch.setattr(policy.tokenizer, "apply_chat_template", never)


def ask(content: str | list, **options) -> ChatCompletionRequest:
    messages = content if isinstance(content, list) else [{"role": "user", "content": content}]
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, **options})


def test_a_text_longer_than_the_context_s_tokens_can_span_is_refused_before_it_is_tokenized(policy, monkeypatch):
    """A 30 MB message was tokenized whole (15.7M tokens, 39 s of a preparation thread, 9 GB held after) before
    the context check refused it."""
    longest, limit = longest_token_chars(policy.tokenizer), context_length(policy)
    assert longest is not None and limit is not None
    refusing_tokenizer(policy, monkeypatch)
    half = {"type": "text", "text": "x" * (limit * longest // 2 + 2)}
    for body in [ask("x" * (limit * longest + 2), max_tokens=2),
                 ask([{"role": "system", "content": [half]}, {"role": "user", "content": [half]}])]:
        with pytest.raises(APIError) as refused:
            prepare(body, policy, MODEL, 16, max_token_chars=longest)
        assert refused.value.code == "context_length_exceeded", refused.value
        assert f"no token of this model spans more than {longest}" in refused.value.message
    many = [{"role": "user", "content": "hi"}] * (limit + 1)
    with pytest.raises(APIError) as refused:
        prepare(ask(many), policy, MODEL, 16)
    assert refused.value.code == "context_length_exceeded", refused.value
    assert f"the request has {limit + 1:,} messages" in refused.value.message


def test_characters_are_counted_as_the_tokenizer_normalizes_them(policy):
    """NFC composes ``e`` and a combining accent into one character: a text that the plain count would refuse
    may fit once normalized, and is then tokenized and measured in tokens."""
    longest, limit = longest_token_chars(policy.tokenizer), context_length(policy)
    assert longest is not None and limit is not None
    decomposed = "e\u0301" * (limit * longest * 3 // 4)  # over the bound as written, under it composed
    with pytest.raises(APIError) as refused:
        prepare(ask(decomposed, max_tokens=2), policy, MODEL, 16, max_token_chars=longest)
    assert refused.value.code == "context_length_exceeded"
    assert "in the messages" in refused.value.message  # counted in tokens, not refused by its characters


def test_the_server_refuses_a_text_too_long_for_the_context_by_its_characters(policy):
    limit, longest = context_length(policy), longest_token_chars(policy.tokenizer)
    assert limit is not None and longest is not None
    with running(create_app(policy, MODEL)) as url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * (limit * longest // 6 + 2)}]}
        response = httpx.post(url + "/chat/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "characters of text" in error["message"]


def test_a_request_of_more_messages_than_accepted_is_refused_by_its_schema():
    with pytest.raises(ValueError, match=f"at most {MAX_MESSAGES} items"):
        ask([{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1))


# --------------------------------------------------------------------------- clients that leave mid-generation
def test_a_request_whose_client_left_mid_generation_is_generated_no_further_than_the_call_in_progress(policy):
    """A request of ``n`` 128 whose client hung up kept generating all of its choices while the next request
    waited: it is generated in calls of the batch size, and no call starts once its client has left."""
    gated = GatedPolicy(policy)
    try:
        with running(create_app(gated, MODEL, max_batch_size=2, batch_window_s=0.0)) as url:
            health = url.removesuffix("/v1") + "/health"
            gated.hold.set()
            body = json.dumps({"model": MODEL, "messages": HI, "n": 6, "max_tokens": 2}).encode()
            with open_upload(url, len(body), body):
                assert gated.entered.wait(60)
                assert httpx.get(health, timeout=30).json()["generating"] == 1
            assert wait_until(lambda: httpx.get(health, timeout=30).json()["generating"] == 0), \
                "the server never noticed the client had hung up"
            gated.hold.clear()
            gated.release.set()
            after = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2},
                               timeout=60)
            assert after.status_code == 200
        assert gated.calls == [2, 1]  # the first call of the request that left, then the next request's
    finally:
        gated.release.set()


def wait_until(condition, tries: int = 3000) -> bool:
    for _ in range(tries):
        if condition():
            return True
        threading.Event().wait(0.01)
    return False


# --------------------------------------------------------------------------- what the server echoes, HEAD
def test_a_client_s_long_name_or_path_is_quoted_cut_short(policy):
    """A 5 MB model name came back whole in the 404 (and a 60 KB one in ``GET /v1/models/<id>``)."""
    with running(create_app(policy, MODEL)) as url:
        answers = [
            httpx.post(url + "/chat/completions", json={"model": "m" * 100_000, "messages": HI}, timeout=60),
            httpx.get(url + "/models/" + "m" * 60_000, timeout=60),
            httpx.post(url + "/" + "p" * 60_000, json={}, timeout=60),
            httpx.post(url + "/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": [{"type": "t" * 60_000, "text": "x"}]}]}),
        ]
    for response, status in zip(answers, [404, 404, 404, 400]):
        assert response.status_code == status
        message = response.json()["error"]["message"]
        assert len(message) < 1000 and "characters)" in message, message
    assert answers[0].json()["error"]["message"].startswith("model 'mmm")
    assert "... (100,000 characters) does not exist" in answers[0].json()["error"]["message"]


def test_head_on_health_answers_as_get(policy):
    with running(create_app(policy, MODEL, token="key")) as url:
        response = httpx.head(url.removesuffix("/v1") + "/health", timeout=30)
    assert response.status_code == 200 and response.content == b""
