"""The chat-completions request schema and its errors, fuzzed through the app: any body is answered, in OpenAI's
shape, with one line that says what is wrong; none is a 500. (The server with a real model: test_policy.py.)"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from turnrl.models import build_tokenizer
from turnrl.policy.interface import Completion, Policy
from turnrl.serve.chat_schema import one_line
from turnrl.serve.policy import create_app

MODEL = "tiny"
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class FixedPolicy(Policy):
    """Answers every prompt with the same completion: the requests are under test, not the model."""

    def __init__(self) -> None:
        self.tokenizer = build_tokenizer(["Hello there. <answer>Up</answer>"] * 10, vocab_size=300)
        self.eos_ids = [self.tokenizer.eos_token_id]
        self.max_sequence_tokens = 4096

    def generate(self, requests, sampling):
        return [Completion(text="Up", token_ids=[5, 6], logprobs=[-0.1, -0.2]) for _ in requests]


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(FixedPolicy(), MODEL, batch_window_s=0.0), raise_server_exceptions=False) as client:
        yield client


TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
"""Every code point: control characters, line separators, lone surrogates (JSON's ``"\\udfff"``)."""
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=12,
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | JSON}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
        {"url": st.sampled_from(["data:,", "data:image/png;base64,AAAA", "https://example.com/a.png"]) | TEXT})}),
    st.fixed_dictionaries({"type": TEXT}),
    JSON,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | TEXT},
    optional={"content": TEXT | st.lists(PART, max_size=3) | JSON},
)
OPTIONS = {name: JSON for name in ("temperature", "top_p", "top_k", "n", "logprobs", "top_logprobs", "stream",
                                   "stream_options", "seed", "presence_penalty", "logit_bias", "tools",
                                   "response_format", "max_completion_tokens")}
BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL) | TEXT | JSON, "messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={**OPTIONS, "max_tokens": st.integers(-2, 50) | JSON,
              "stop": TEXT | st.lists(TEXT, max_size=3) | JSON,
              "response_format": st.fixed_dictionaries({"type": TEXT}) | JSON},
)


def assert_answered(response) -> None:
    """A 200, or an error in OpenAI's shape with a message of one line; never the server's fault."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        message = response.json()["error"]["message"]
        assert message and len(message.splitlines()) == 1, message


@FUZZ
@given(body=st.one_of(BODY, JSON))
@example(body={"model": MODEL, "messages": [{"role": "user", "content": [{"type": "a\nb", "text": "x"}]}]})
@example(body={"model": MODEL, "messages": [{"role": "user", "content": [{"type": "\udfff", "text": "x"}]}]})
@example(body={"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}], "stop": "\n\udfff"})
def test_any_json_body_is_answered_with_one_line_in_openai_s_shape(client, body):
    content = json.dumps(body).encode()  # ASCII: a lone surrogate travels as JSON's escape, as a client sends it
    assert_answered(client.post("/v1/chat/completions", content=content,
                                headers={"content-type": "application/json"}))


@FUZZ
@given(body=st.binary(max_size=200) | TEXT.map(lambda text: text.encode("utf-8", "surrogatepass")))
@example(body=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]')
def test_any_bytes_are_answered_with_one_line_in_openai_s_shape(client, body):
    assert_answered(client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}))


def test_a_part_type_that_quotes_a_line_break_is_named_in_one_line(client):
    """Pydantic's message quotes the client's part type: a line break in it made the error two lines."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "a\nb", "text": "x"}]}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "Input tag 'a\\nb' found using 'type' does not match" in response.json()["error"]["message"]


@given(TEXT)
def test_one_line_escapes_every_line_break_and_nothing_else(text):
    breaks = {char for char in text if len(f"a{char}a".splitlines()) == 2}
    assert one_line(text) == "".join(char.encode("unicode_escape").decode() if char in breaks else char
                                     for char in text)
    assert len(one_line(text).splitlines()) <= 1
