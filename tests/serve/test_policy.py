"""The OpenAI-compatible policy server: a real uvicorn server with the tiny built-in model.

The official ``openai`` client talks to it over localhost; batching and error
isolation are also checked on the batcher alone, in ``test_batching.py``.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from tests.serve.running import running
from turnrl.config import ModelConfig
from turnrl.models.builtin import builtin_model_path
from turnrl.policy.hf import HFPolicy
from turnrl.policy.interface import Policy
from turnrl.serve.policy import _cut_at_stop, bearer_error, create_app, load_policy

MODEL = "tiny"
HI = [{"role": "user", "content": "Hello there"}]


class CountingPolicy(Policy):
    """Wraps a policy and records the size of every ``generate`` call."""

    def __init__(self, policy: HFPolicy) -> None:
        self.inner = policy
        self.tokenizer = policy.tokenizer
        self.model = policy.model
        self.eos_ids = policy.eos_ids
        self.max_batch_size = policy.max_batch_size
        self.calls: list[int] = []

    def generate(self, requests, sampling):
        self.calls.append(len(requests))
        return self.inner.generate(requests, sampling)


@dataclass
class Served:
    base_url: str
    policy: CountingPolicy
    path: str


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    config = ModelConfig(builtin_preset="tiny", builtin_dir=str(tmp_path_factory.mktemp("models")))
    return str(builtin_model_path(config))


@pytest.fixture(scope="module")
def served(tiny_path):
    policy = CountingPolicy(HFPolicy.from_config(ModelConfig(device="cpu"), tiny_path, max_batch_size=16))
    with running(create_app(policy, MODEL)) as url:
        yield Served(base_url=url, policy=policy, path=tiny_path)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0)


# --------------------------------------------------------------------------- through the openai client
def test_chat_completion_text_usage_and_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=12, logprobs=True, temperature=1.0)
    choice = response.choices[0]
    assert response.model == MODEL and response.object == "chat.completion"
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    entries = choice.logprobs.content
    # The end-of-turn token is sampled (and counted) but not listed, as OpenAI does.
    assert len(entries) == usage.completion_tokens - (1 if choice.finish_reason == "stop" else 0)
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)
    # A sampled special token (the random tiny model samples any id) is listed with its text, as vLLM lists it,
    # while the content leaves special tokens out: the other entries' bytes spell the content.
    spelled = [e for e in entries if not re.fullmatch(r"<\|[a-z_]+\|>", e.token)]
    assert b"".join(bytes(e.bytes) for e in spelled).decode("utf-8", errors="replace") == choice.message.content


def test_n_choices_and_stop_strings(client):
    response = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=10, n=3, stop=["e"])
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert "e" not in choice.message.content  # OpenAI cuts the stop string from the text
        extra = choice.model_extra or {}
        if extra.get("stop_reason") is not None:
            assert extra["stop_reason"] == "e" and choice.finish_reason == "stop"
    assert response.usage.completion_tokens <= 30


def test_streaming_is_one_chunk_per_part(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 6
    assert isinstance(text, str)


def test_models_and_health(client, served):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # A call of its own: the module's other tests may run in another worker (pytest-xdist), with another server.
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    health = httpx.get(served.base_url.removesuffix("/v1") + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL and health["generate_calls"] >= 1


# --------------------------------------------------------------------------- batching, for real
def test_concurrent_requests_share_generate_calls(served):
    policy = served.policy
    before = len(policy.calls)
    requests = 8

    def post(i: int) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 8 + i}
        return httpx.post(served.base_url + "/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(requests) as pool:
        responses = list(pool.map(post, range(requests)))
    assert all(r.status_code == 200 for r in responses)
    for i, response in enumerate(responses):
        assert response.json()["usage"]["completion_tokens"] <= 8 + i  # each keeps its own max_tokens
    calls = policy.calls[before:]
    assert sum(calls) == requests
    assert len(calls) < requests, f"no batching: {calls}"


# --------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"model": MODEL}, 400, ["messages", "required"]),
        ({"model": MODEL, "messages": []}, 400, ["messages"]),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, ["role", "'user'"]),
        ({"model": MODEL, "messages": [{"role": "user"}]}, 400, ["content is required"]),
        ({"model": MODEL, "messages": HI, "max_tokens": -3}, 400, ["max_tokens", "greater than or equal to 1"]),
        ({"model": MODEL, "messages": HI, "temperature": -1}, 400, ["temperature"]),
        ({"model": MODEL, "messages": HI, "top_p": 0}, 400, ["top_p"]),
        ({"model": MODEL, "messages": HI, "stop": [""]}, 400, ["stop strings must not be empty"]),
        ({"model": "gpt-nothing", "messages": HI}, 404, ["'gpt-nothing' does not exist", "'tiny'"]),
        ({"model": MODEL, "messages": HI, "max_tokens": 100_000}, 400, ["context is"]),
        ({"model": MODEL, "messages": [{"role": "user", "content": "go " * 3000}]}, 400, ["context is"]),
        ({"model": MODEL, "messages": HI, "top_logprobs": 3, "logprobs": True}, 400, ["top_logprobs"]),
        ({"model": MODEL, "messages": HI, "presence_penalty": 0.5}, 400, ["presence_penalty"]),
        (
            {"model": MODEL,
             "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            400,
            ["text-only"],
        ),
    ],
)
def test_bad_requests_get_clear_errors(served, body, status, words):
    response = httpx.post(served.base_url + "/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for word in words:
        assert word in message


def test_malformed_json_and_server_keeps_serving(served, client):
    response = httpx.post(
        served.base_url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "invalid request" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=HI)
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices


def test_a_fault_of_the_server_is_a_500_in_openai_s_shape_and_it_keeps_serving(served, client, monkeypatch):
    """An error no handler expected (here: building the answer) is answered as every other error is, in one
    line of OpenAI's shape, not starlette's plain-text page; the next request is served."""
    import turnrl.serve.policy as server

    def broken(*args, **kwargs):
        raise KeyError("choices\nsecond line")

    monkeypatch.setattr(server, "build_response", broken)
    response = httpx.post(served.base_url + "/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": HI, "max_tokens": 2})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "\n" not in error["message"]
    assert error["message"] == "internal error (KeyError); the server's log has the traceback"
    monkeypatch.undo()
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices


def test_load_policy_serves_under_the_given_name(served):
    policy, name = load_policy(served.path, device="cpu", max_batch_size=4)
    assert name == served.path and policy.max_batch_size == 4 and policy.tokenizer is not None
    policy, name = load_policy(served.path, max_batch_size=4, served_model_name="my-model",
                               model_config=ModelConfig(device="cpu", dtype="bfloat16"))
    assert name == "my-model" and next(policy.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("method", "path", "status", "words"),
    [("GET", "/chat/completions", 405, ["GET is not allowed", "POST /v1/chat/completions"]),
     ("POST", "/nothing", 404, ["no endpoint /v1/nothing"]),
     ("DELETE", "/models", 405, ["DELETE is not allowed"])],
)
def test_routing_errors_come_in_openai_s_shape(served, method, path, status, words):
    response = httpx.request(method, served.base_url + path, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert all(word in error["message"] for word in words)
    if status == 405:
        assert "POST" in response.headers["allow"] or "GET" in response.headers["allow"]


def readme_command(*words: str) -> list[str]:
    """The arguments of the README's ``turnrl`` command line that holds every one of ``words``."""
    lines = (Path(__file__).resolve().parents[2] / "README.md").read_text().splitlines()
    line = next(line for line in lines if line.startswith("turnrl ") and all(word in line for word in words))
    return line.split("  #")[0].split()[1:]


def test_the_readme_s_eval_against_serve_policy_works_as_written(served, tmp_path, capsys, monkeypatch):
    """The README's ``turnrl serve-policy ... --served-model-name my-model`` then its ``turnrl eval ...
    --policy openai:my-model ...`` with the server's URL: episodes play, none errors; a wrong model name
    errors every episode and the summary says why."""
    from turnrl.cli import main

    serve = readme_command("serve-policy", "--served-model-name")
    name = serve[serve.index("--served-model-name") + 1]
    evaluate = readme_command("eval", f"openai:{name}")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the README's paths are the repository's
    with running(create_app(served.policy, name)) as url:
        for model, errors in ((name, 0), ("other-model", 2)):
            out = tmp_path / model
            argv = [word.replace(f"openai:{name}", f"openai:{model}") for word in evaluate]
            argv = [f"base_url={url}" if word.startswith("base_url=") else word for word in argv]
            assert main([*argv, "--episodes", "2", "--out", str(out)]) == 0
            summary = json.loads((out / "summary.json").read_text())
            assert summary["errors"] == errors, summary["first_errors"]
            if errors == 0:
                assert summary["episodes"] == 2 and summary["mean_turns"] > 0
    assert f"model 'other-model' does not exist; this server serves '{name}'" in summary["first_errors"][0]
    assert "model 'other-model' does not exist" in " ".join(capsys.readouterr().out.split())  # wrapped to 80


def test_a_system_message_is_folded_for_a_template_without_a_system_role(tiny_path):
    from transformers import AutoTokenizer

    from tests.rollout.test_context import GEMMA2
    from turnrl.serve.preparation import with_system_folded

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert with_system_folded(chat, tokenizer) == chat  # ChatML has a system role
    tokenizer.chat_template = GEMMA2
    folded = with_system_folded(chat, tokenizer)
    assert folded == [{"role": "user", "content": "Be brief.\n\nhi"}]
    tokenizer.apply_chat_template(folded, add_generation_prompt=True, tokenize=False)  # renders, where chat raises
    with pytest.raises(Exception, match="System role not supported"):
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def test_the_engine_serves_like_transformers_and_keeps_its_cache_between_requests(tiny_path):
    from turnrl.policy.factory import load_model_policy

    hf = HFPolicy.from_config(ModelConfig(device="cpu"), tiny_path)
    engine = load_model_policy(ModelConfig(device="cpu", backend="engine"), tiny_path, max_batch_size=8)
    first = [{"role": "user", "content": "You are playing Sokoban. Push the box onto the target."}]
    answers = {}
    for name, policy in (("hf", hf), ("engine", engine)):
        with running(create_app(policy, MODEL)) as url:
            client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
            reply = client.chat.completions.create(model=MODEL, messages=first, max_tokens=8, temperature=0)
            follow_up = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Turn 2. Where is the box now?"}]
            again = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=8, temperature=0)
            answers[name] = (reply.choices[0].message.content, again.choices[0].message.content)
            if name == "engine":
                # The same conversation again: its prompt is found in the cache (a client's retry, or a
                # second sample), not prefilled again. A follow-up reuses the cache only where the
                # re-rendered text tokenizes as sampled, which a text API cannot promise.
                before = engine.engine.stats.reused_tokens
                client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=8, temperature=0)
                assert engine.engine.stats.reused_tokens > before
    assert answers["engine"] == answers["hf"]


# --------------------------------------------------------------------------- hostile requests
def post_raw(base_url: str, text: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST a JSON body as written (JSON's escapes reach the server as they are, lone surrogates included)."""
    return httpx.post(base_url + "/chat/completions", content=text.encode(), timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def test_a_temperature_below_the_greedy_bound_answers_greedily(served):
    """1e-40 made every tempered logit infinite (a 500): it is greedy, as vLLM treats it."""
    answers = []
    for temperature in (0, 1e-40):
        body = {"model": MODEL, "messages": HI, "max_tokens": 8, "temperature": temperature, "logprobs": True}
        response = httpx.post(served.base_url + "/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        answers.append((choice["message"]["content"], [e["token"] for e in choice["logprobs"]["content"]]))
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    ("body", "where"),
    [('"stop": ["\\udfff"]', "stop"), ('"stop": "a\\ud800"', "stop"),
     ('"messages": [{"role": "user", "content": "hi \\udfff"}]', "messages.0.content"),
     ('"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}]', "messages.0.content")],
)
def test_a_lone_surrogate_in_a_request_string_is_a_400_that_names_the_field(served, client, body, where):
    """A lone surrogate cannot be encoded: it broke the tokenizer with a UnicodeEncodeError (a 500)."""
    fields = {"model": f'"{MODEL}"', "messages": json.dumps(HI), "max_tokens": "4"}
    name = body.split('"')[1]
    fields[name] = body.split(":", 1)[1].strip()
    response = post_raw(served.base_url, "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}")
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert where in message and "lone surrogate" in message and "valid Unicode" in message
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices  # still serving


def test_health_answers_while_a_preparation_is_blocked_and_preparations_are_bounded(served, monkeypatch):
    """Preparing a request (chat template, image decoding) ran on the event loop: one slow image stalled
    ``/health`` and every client. Here the first preparation blocks until released: ``/health`` still answers,
    and a second request waits for the one preparation thread instead of starting a preparation of its own."""
    import threading

    import turnrl.serve.policy as server

    real_prepare, started, release = server.prepare, [], threading.Event()

    def blocking_prepare(*args, **kwargs):
        started.append(args[0].messages[0].content)
        assert release.wait(60), "the test never released the preparation"
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(server, "prepare", blocking_prepare)
    with running(create_app(served.policy, MODEL, prepare_threads=1)) as url, ThreadPoolExecutor(2) as pool:
        health_url = url.removesuffix("/v1") + "/health"

        def post(text: str) -> httpx.Response:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
            return httpx.post(url + "/chat/completions", json=body, timeout=120)

        def health_when(condition) -> dict:
            for _ in range(3000):  # the requests are in flight on other threads: wait until the server has them
                health = httpx.get(health_url, timeout=30).json()
                if condition(health):
                    return health
                threading.Event().wait(0.01)
            raise AssertionError(f"the server never reached the state; last /health: {health}")

        first = pool.submit(post, "first")
        health_when(lambda health: health["preparing"] == 1 and started == ["first"])
        second = pool.submit(post, "second")
        health = health_when(lambda health: health["preparing"] == 2)
        # /health answered while "first" is blocked in its preparation, and "second" waits for the thread.
        assert started == ["first"] and not first.done() and health["status"] == "ok"
        release.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
        assert started == ["first", "second"]
        assert httpx.get(health_url, timeout=30).json()["preparing"] == 0


@pytest.fixture(scope="module")
def keyed(served):
    with running(create_app(served.policy, MODEL, token="s3cret")) as url:
        yield url


@pytest.mark.parametrize("token", ["clé", "", " padded", "tab\tin"])
def test_a_token_no_client_could_send_is_refused_before_serving(served, token):
    """HTTP reads a header's bytes as latin-1 and strips its ends: such a key could never match."""
    with pytest.raises(ValueError, match="the token must be printable ASCII"):
        create_app(served.policy, MODEL, token=token)


def test_a_server_with_a_token_refuses_requests_without_it(keyed):
    """``serve-policy --token``: every path but /health needs ``Authorization: Bearer <key>`` (as serve-env)."""
    client = openai.OpenAI(base_url=keyed, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="wrong API key"):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    bare = httpx.post(keyed + "/chat/completions", content=b"{not json", timeout=30)  # refused before the body
    assert bare.status_code == 401
    error = bare.json()["error"]
    assert error["code"] == "invalid_api_key" and "Authorization: Bearer <key>" in error["message"]
    wrong = httpx.get(keyed + "/models", headers={"Authorization": "Bearer nope"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "wrong API key"
    assert httpx.get(keyed.removesuffix("/v1") + "/health", timeout=30).status_code == 200  # open, as serve-env
    client = openai.OpenAI(base_url=keyed, api_key="s3cret", max_retries=0)
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_eval_s_http_policy_sends_the_key_from_its_variable(keyed, tmp_path, monkeypatch):
    """``turnrl eval --policy openai:...`` sends ``$OPENAI_API_KEY`` (``api_key_env``) as the bearer key."""
    from turnrl.cli import main

    argv = ["eval", "--env", "Bandit", "--policy", f"openai:{MODEL}", f"base_url={keyed}", "--episodes", "1"]
    for key, errors in (("s3cret", 0), ("wrong", 1)):
        monkeypatch.setenv("OPENAI_API_KEY", key)
        assert main([*argv, "--out", str(tmp_path / key)]) == 0
        summary = json.loads((tmp_path / key / "summary.json").read_text())
        assert summary["errors"] == errors, summary["first_errors"]


# --------------------------------------------------------------------------- body size, shutdown, clients that leave
def test_a_body_over_the_limit_is_a_413_read_no_further():
    """A body is counted as it arrives: an endless chunked body (or one whose Content-Length lies) is cut off once
    the limit is passed, never held whole; a Content-Length over the limit is refused before any of it is read."""
    from turnrl.envservice.http_guards import BodyLimit
    from turnrl.serve.policy import request_too_large

    async def never_called(scope, receive, send):
        raise AssertionError("the app got a body over the limit")

    def endless(chunk_bytes: int):
        read = []

        async def receive():
            read.append(chunk_bytes)
            return {"type": "http.request", "body": b"x" * chunk_bytes, "more_body": True}

        return receive, read

    async def call(limit: int, headers: list, receive):
        sent = []

        async def send(message):
            sent.append(message)

        limited = BodyLimit(never_called, limit=limit, too_large=lambda: request_too_large(limit))
        await limited({"type": "http", "headers": headers}, receive, send)
        return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))

    receive, read = endless(1000)
    status, body = asyncio.run(call(10_500, [(b"transfer-encoding", b"chunked")], receive))
    assert status == 413 and sum(read) == 11_000  # the chunk that passed the limit, and not one more
    assert body["error"]["code"] == "request_too_large" and "--max-request-mb" in body["error"]["message"]
    receive, read = endless(1000)
    status, _ = asyncio.run(call(10_500, [(b"content-length", b"10000000000")], receive))
    assert status == 413 and read == []


def test_the_bodies_in_flight_together_are_bounded_and_a_request_past_it_is_a_503_read_no_further():
    """Each body under the limit, but many held at once (waiting for a preparation thread) would hold memory
    without bound: past the total, a request is refused with a 503 to retry; once the first is answered, the
    bytes it held are free again."""
    from turnrl.envservice.http_guards import BodyLimit
    from turnrl.serve.policy import request_too_large, server_busy

    async def scenario():
        release, entered = asyncio.Event(), []

        async def app(scope, receive, send):
            entered.append((await receive())["body"])
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        limited = BodyLimit(app, limit=800, too_large=lambda: request_too_large(800), total_limit=1000,
                            busy=lambda: server_busy(1000))

        async def request(size: int, read: list):
            sent = []

            async def receive():
                read.append(size)
                return {"type": "http.request", "body": b"x" * size, "more_body": False}

            async def send(message):
                sent.append(message)

            await limited({"type": "http", "headers": []}, receive, send)
            return sent

        first = asyncio.create_task(request(600, []))
        while not entered:
            await asyncio.sleep(0)
        read: list[int] = []
        refused = await request(600, read)
        assert refused[0]["status"] == 503 and read == [600] and len(entered) == 1
        message = json.loads(refused[1]["body"])["error"]
        assert message["code"] == "server_busy" and "send the request again" in message["message"]
        assert limited.held == 600
        release.set()
        assert (await first)[0]["status"] == 200 and limited.held == 0
        assert (await request(600, []))[0]["status"] == 200 and limited.held == 0

    asyncio.run(scenario())


def test_the_server_refuses_a_large_body_with_one_line_and_keeps_serving(served, client):
    with running(create_app(served.policy, MODEL, max_request_mb=1)) as url:
        too_large = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": HI, "pad": "x" * (2 << 20)},
                               timeout=60)
        assert too_large.status_code == 413
        error = too_large.json()["error"]
        assert error["message"] == ("the request body is over this server's limit of 1 MiB; send fewer or smaller "
                                    "images, or start the server with a larger --max-request-mb")
        small = httpx.post(url + "/chat/completions", json={"model": MODEL, "messages": HI, "max_tokens": 2},
                           timeout=60)
        assert small.status_code == 200, small.text


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
         ["temperature", "finite number"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}',
         ["temperature", "finite number"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "NaN"}',
         ["temperature", "finite number"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
         ["top_p", "finite number"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": ' + json.dumps(
            [f"s{i}" for i in range(1000)]) + "}", ["1000 stop strings", "at most 32"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stop": "' + "a" * 10_000 + '"}',
         ["10000 characters", "at most 256"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 100}}',
         ["logit_bias is not supported"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} trailing',
         ["not valid JSON", "Extra data at character"]),
        ("[" * 100_000 + "]" * 100_000, ["cannot be read as JSON", "RecursionError"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": ' + "9" * 5000 + "}",
         ["cannot be read as JSON", "digits"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + "9" * 4300 + "}",
         ["max_tokens", "less than or equal to 2147483647"]),
        ('{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 1e300}',
         ["temperature", "less than or equal to 10000"]),
    ],
    ids=["infinity", "overflowing-float", "nan-string", "nan-top-p", "thousand-stops", "long-stop", "logit-bias",
         "trailing-garbage", "deeply-nested", "huge-integer", "max-tokens-of-4300-digits", "temperature-1e300"],
)
def test_hostile_bodies_get_a_400_that_says_what_is_wrong(served, client, text, words):
    """Each hostile body gets one line naming its fault: a temperature or top_p that is not a finite number (an
    infinite one would sample uniformly), more or longer stop strings than the bound (each is matched against
    the vocabulary on the one generation thread), a logit_bias (not supported, so not dropped silently), a
    body that is not JSON, with where it fails, a max_tokens of 4300 digits (the context check's sum of it had
    more digits than Python will write: a 500) and a temperature of 1e300 (infinite in float32: NaN
    probabilities, a 500 with the tiny VLM)."""
    response = post_raw(served.base_url, text)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(word in message for word in words), message
    assert "\n" not in message
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices  # still serving


class GatedPolicy(CountingPolicy):
    """The tiny model, whose ``generate`` waits for ``release`` once ``hold`` is set (the model kept busy)."""

    def __init__(self, policy: HFPolicy) -> None:
        import threading

        super().__init__(policy)
        self.hold, self.release, self.entered = threading.Event(), threading.Event(), threading.Event()
        self.prompts: list[str] = []

    def generate(self, requests, sampling):
        self.prompts += [self.tokenizer.decode(r.prompt_ids) for r in requests]
        if self.hold.is_set():
            self.entered.set()
            assert self.release.wait(60), "the test never released generation"
        return super().generate(requests, sampling)


@pytest.fixture
def gated(served):
    policy = GatedPolicy(served.policy.inner)
    yield policy
    policy.release.set()


def test_a_request_whose_client_left_is_not_generated(gated):
    """A request whose client hung up while the model was busy is dropped from the batch, not generated up to its
    max_tokens while everyone queued behind it waits."""
    import socket

    with running(create_app(gated, MODEL, batch_window_s=0.0)) as url:
        port, health = int(url.split(":")[-1].split("/")[0]), url.removesuffix("/v1") + "/health"
        gated.hold.set()
        with ThreadPoolExecutor(1) as pool:
            busy_body = {"model": MODEL, "messages": [{"role": "user", "content": "busy"}], "max_tokens": 2}
            busy = pool.submit(httpx.post, url + "/chat/completions", json=busy_body, timeout=120)
            assert gated.entered.wait(60)
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "gone"}], "max_tokens": 64})
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
                assert wait_for_pending(health, 1), "the server never held the request"
            assert wait_for_pending(health, 0), "the server never noticed the client had hung up"
            gated.hold.clear()
            gated.release.set()
            assert busy.result().status_code == 200
        after = httpx.post(url + "/chat/completions", timeout=120,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "after"}], "max_tokens": 2})
        assert after.status_code == 200
    assert not any("gone" in prompt for prompt in gated.prompts), gated.prompts
    assert any("after" in prompt for prompt in gated.prompts)


def wait_for_pending(health: str, count: int, tries: int = 3000) -> bool:
    """Whether ``/health`` says ``count`` requests are pending within ``tries`` polls, 10 ms apart."""
    import threading

    for _ in range(tries):
        if httpx.get(health, timeout=30).json()["pending"] == count:
            return True
        threading.Event().wait(0.01)
    return False


def test_requests_in_flight_or_arriving_at_shutdown_get_a_503(gated):
    """A request being generated when the server shuts down, and one arriving after, get a 503 that says the
    server is shutting down (not a wait without end, nor an error of the stopped preparation threads)."""
    app = create_app(gated, MODEL)
    transport = httpx.ASGITransport(app=app)
    body = {"model": MODEL, "messages": HI, "max_tokens": 2}

    async def main():
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            async with app.router.lifespan_context(app):
                gated.hold.set()
                in_flight = asyncio.create_task(http.post("/v1/chat/completions", json=body))
                while not gated.entered.is_set():
                    await asyncio.sleep(0.01)
            answers = [await asyncio.wait_for(in_flight, 60)]
            gated.release.set()
            answers.append(await asyncio.wait_for(http.post("/v1/chat/completions", json=body), 60))
            return answers

    for answer in asyncio.run(main()):
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["message"].startswith("the server is shutting down")


def test_the_engine_s_bound_on_a_sequence_is_the_context_the_server_checks(tiny_path):
    """The engine holds ``model.engine.max_seq_len`` tokens a sequence, fewer than the model's positions: a longer
    prompt was answered 200 with empty content and ``finish_reason: "error"``, and a completion that would pass it
    was cut there and reported as ``length``, whatever max_tokens asked. Both are the 400 of a context exceeded."""
    from turnrl.config import EngineConfig
    from turnrl.policy.factory import load_model_policy

    config = ModelConfig(device="cpu", backend="engine", engine=EngineConfig(max_seq_len=64, kv_cache_gb=0.01))
    engine = load_model_policy(config, tiny_path, max_batch_size=4)
    with running(create_app(engine, MODEL)) as url:
        def ask(content: str, **options) -> httpx.Response:
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **options}
            return httpx.post(url + "/chat/completions", json=body, timeout=120)

        for response in (ask("hello " * 40, max_tokens=4), ask("hello", max_tokens=50)):
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert error["message"].startswith("this model's context is 64 tokens")
            assert error["message"].endswith("(the server's bound on a sequence, model.engine.max_seq_len)")
        fits = ask("hello", temperature=0)  # no max_tokens: what the engine's bound leaves
        assert fits.status_code == 200, fits.text
        usage = fits.json()["usage"]
        assert usage["total_tokens"] <= 64


def test_optional_parameters_sent_as_null_take_their_defaults(served):
    """OpenAI's API marks its optional parameters nullable, and clients that write every field of a request send
    the ones left unset as null: ``"temperature": null`` was a 400 ("Input should be a valid number")."""
    nulls = dict.fromkeys(["temperature", "top_p", "n", "stream", "logprobs", "presence_penalty", "frequency_penalty",
                           "top_logprobs", "stop", "seed", "max_completion_tokens", "stream_options", "logit_bias",
                           "tools", "response_format", "user"])
    response = httpx.post(served.base_url + "/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": HI, "max_tokens": 3, **nulls})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert len(answer["choices"]) == 1 and answer["choices"][0]["logprobs"] is None
    assert answer["usage"]["completion_tokens"] <= 3
    required = httpx.post(served.base_url + "/chat/completions", timeout=60, json={"model": None, "messages": HI})
    assert required.status_code == 400
    assert "model: Input should be a valid string" in required.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "headers", "words"),
    [(json.dumps({"model": MODEL, "messages": HI}), {"content-type": "application/x-www-form-urlencoded"},
      "the body was not read as JSON: send it with the header 'Content-Type: application/json'"),
     (json.dumps({"model": MODEL, "messages": HI}), {}, "the body was not read as JSON"),
     ("", {"content-type": "application/json"}, "the request has no body; send one JSON object"),
     ("[1, 2]", {"content-type": "application/json"}, "the body must be one JSON object (model, messages, ...)"),
     ('"hi"', {"content-type": "application/json"}, "the body must be one JSON object (model, messages, ...)")],
    ids=["form-content-type", "no-content-type", "empty", "array", "string"],
)
def test_a_body_that_is_no_json_object_says_what_to_send(served, content, headers, words):
    """``curl -d '{...}'`` sends a JSON object as a form: FastAPI does not parse it, and the answer was "body: Input
    should be a valid dictionary or object to extract fields from", which never names the header to fix; an empty
    body was "body: Field required"."""
    response = httpx.post(served.base_url + "/chat/completions", content=content.encode(), headers=headers,
                          timeout=60)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert words in message, message


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)


@given(ANY_TEXT, st.lists(ANY_TEXT.filter(bool), max_size=4))
def test_a_completion_of_any_text_is_cut_before_its_earliest_stop_string(text, stops):
    kept, stop = _cut_at_stop(text, stops)
    assert text.startswith(kept) and not any(s in kept for s in stops)
    assert (stop is None) == (kept == text and not any(s in text for s in stops))
    assert stop is None or text[len(kept):].startswith(stop)


@given(st.text(st.characters(max_codepoint=255), max_size=40))  # a header's value, as latin-1 decodes it
@example("Bearer key-1")
@example("bearer  key-1\t")
@example("Bearer key-2")
def test_any_authorization_header_is_accepted_only_with_the_key(header):
    error = bearer_error(header, "key-1")
    assert (error is None) == (header.partition(" ")[0].lower() == "bearer" and header.partition(" ")[2].strip()
                               == "key-1")
    assert error is None or len(error.splitlines()) == 1
