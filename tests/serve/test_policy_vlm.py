"""The policy server serving a VLM: image_url parts in, the rollout over HTTP with image observations,
the same tokens as the in-process context, clear 400s for images it cannot take."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.serve.running import running
from turnrl.config import AgentConfig, EnvConfig, ModelConfig, SamplingConfig
from turnrl.envs import make
from turnrl.eval_config import EvalConfig
from turnrl.evaluate import run_eval
from turnrl.models.vision import content_digest
from turnrl.policy.engine import EnginePolicy
from turnrl.policy.hf import HFPolicy
from turnrl.policy.openai_http import image_data_url
from turnrl.serve.chat_schema import ChatCompletionRequest
from turnrl.serve.policy import create_app, load_policy, prepare

MODEL = "tiny-vlm"


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm_dir):
    policy = HFPolicy.from_config(ModelConfig(device="cpu"), str(tiny_vlm_dir), max_batch_size=8)
    with running(create_app(policy, MODEL)) as url:
        yield url, policy


def frame() -> np.ndarray:
    obs, _ = make("FrozenLake", mode="image").reset(seed=0)
    return obs["image"]


def image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "Where are you?"}]}]


def test_a_chat_with_an_image_is_answered(vlm_server):
    base_url, _ = vlm_server
    client = openai.OpenAI(base_url=base_url, api_key="x")
    reply = client.chat.completions.create(model=MODEL, messages=image_message(image_data_url(frame())),
                                           max_tokens=6, logprobs=True)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.prompt_tokens > 16


def test_the_server_expands_each_image_as_the_rollout_context_does(vlm_server):
    _, policy = vlm_server
    body = ChatCompletionRequest(model=MODEL, messages=image_message(image_data_url(frame())) * 1)
    prepared = prepare(body, policy, MODEL, 16)
    pad = policy.image_encoder.image_token_id
    features = int(prepared.model_inputs["image_grid_thw"].prod(-1).sum()) // 4
    assert prepared.prompt_ids.count(pad) == features == 16
    assert prepared.image_digests == [content_digest([frame()])]  # the engine's cache key for the image


@pytest.mark.parametrize(
    ("url", "words"),
    [("https://example.com/a.png", "data URLs"), ("data:image/png;base64,AAAA", "cannot be read"),
     ("data:image/png,raw", "cannot be read")],
)
def test_images_it_cannot_take_get_a_400(vlm_server, url, words):
    base_url, _ = vlm_server
    reply = httpx.post(f"{base_url}/chat/completions", json={"model": MODEL, "messages": image_message(url)})
    assert reply.status_code == 400 and words in reply.json()["error"]["message"]
    assert httpx.get(f"{base_url.removesuffix('/v1')}/health").status_code == 200  # still serving


def test_images_the_processor_refuses_get_a_400(vlm_server):
    base_url, _ = vlm_server
    sliver = image_data_url(np.zeros((5, 2000, 3), dtype=np.uint8))  # an aspect ratio Qwen-VL refuses
    messages = [image_message(sliver)[0],
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url(frame())}},
                                             {"type": "text", "text": "<|image_pad|> is not an image"}]}]
    for body in ({"model": MODEL, "messages": messages[:1]}, {"model": MODEL, "messages": messages[1:]}):
        reply = httpx.post(f"{base_url}/chat/completions", json=body)
        assert reply.status_code == 400 and "images cannot be used" in reply.json()["error"]["message"]
    assert httpx.get(f"{base_url.removesuffix('/v1')}/health").status_code == 200


def test_eval_of_image_observations_over_http(vlm_server, tmp_path):
    base_url, _ = vlm_server
    config = EvalConfig(env=EnvConfig(id="FrozenLake", settings={"mode": "image"}), agent=AgentConfig(max_turns=2),
                        sampling=SamplingConfig(max_new_tokens=8), policy=f"openai:{MODEL}", base_url=base_url,
                        concurrency=2, episodes=2, out=str(tmp_path))
    summary = run_eval(config)
    assert summary["episodes"] == 2 and summary["errors"] == 0
    assert len(list((tmp_path / "images").glob("*.png"))) >= 2


def test_the_engine_serves_the_vlm_with_the_transformers_backends_tokens(vlm_server, tiny_vlm_dir):
    hf_url, _ = vlm_server
    engine, _ = load_policy(str(tiny_vlm_dir), model_config=ModelConfig(device="cpu", backend="engine"))
    assert isinstance(engine, EnginePolicy) and engine.accepts_images
    messages = image_message(image_data_url(frame()))
    with running(create_app(engine, MODEL)) as engine_url:
        replies = [openai.OpenAI(base_url=url, api_key="x").chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True) for url in (hf_url, engine_url)]
    (hf_choice,), (engine_choice,) = (reply.choices for reply in replies)
    assert hf_choice.logprobs.content  # tokens were generated
    assert engine_choice.message.content == hf_choice.message.content
    assert [t.token for t in engine_choice.logprobs.content] == [t.token for t in hf_choice.logprobs.content]
    np.testing.assert_allclose([t.logprob for t in engine_choice.logprobs.content],
                               [t.logprob for t in hf_choice.logprobs.content], atol=1e-4)


def test_load_policy_builds_a_builtin_vlm(tiny_vlm_dir, monkeypatch):
    monkeypatch.setattr("turnrl.models.builtin.default_cache_dir", lambda: tiny_vlm_dir.parent)
    policy, name = load_policy("builtin:vlm-tiny", device="cpu")
    assert name == "builtin:vlm-tiny" and policy.accepts_images


def test_data_url_round_trip():
    image = frame()
    url = image_data_url(image)
    from turnrl.models.vision import load_image

    assert np.array_equal(load_image(url), image) and url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1])[:4] == b"\x89PNG"


def png_of(width: int, height: int, rows: int | None = None) -> bytes:
    """A grayscale PNG of ``width`` x ``height`` zeros, written by hand so that its pixels are never held:
    ``rows`` of them in its data (None: all, a valid image; 0: a header and no data at all)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor, row = zlib.compressobj(9), bytes(1 + width)  # filter byte 0, then the row's pixels
    data = b"".join(compressor.compress(row) for _ in range(height if rows is None else rows)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + (chunk(b"IDAT", data) if rows != 0 else b"")
            + chunk(b"IEND", b""))


def test_an_image_of_too_many_pixels_is_refused_before_it_is_decoded(vlm_server):
    """A 9000 x 9000 PNG is 80 KB on the wire and 243 MB decoded (as RGB): the server reads its size from the
    header and answers 400 without decoding it, then keeps serving."""
    from turnrl.models.vision import ImageTooLarge, load_image

    base_url, _ = vlm_server
    png = png_of(9000, 9000)
    assert len(png) < 200_000
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    reply = httpx.post(f"{base_url}/chat/completions", json={"model": MODEL, "messages": image_message(url)},
                       timeout=120)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "image_too_large" and "9000 x 9000" in error["message"]
    assert "--max-image-pixels" in error["message"]
    assert httpx.get(f"{base_url.removesuffix('/v1')}/health").status_code == 200
    # Refused from the header alone: a PNG with no pixel data at all (decoding it would fail otherwise).
    header_only = "data:image/png;base64," + base64.b64encode(png_of(9000, 9000, rows=0)).decode()
    with pytest.raises(ImageTooLarge, match="9000 x 9000"):
        load_image(header_only, max_pixels=4096 * 4096)
    with pytest.raises(Exception) as decoded:
        load_image(header_only)
    assert not isinstance(decoded.value, ImageTooLarge)
    small = "data:image/png;base64," + base64.b64encode(png_of(64, 32)).decode()
    assert load_image(small, max_pixels=64 * 32).shape == (32, 64, 3)  # at the bound: decoded


def test_an_image_pillow_refuses_under_a_larger_bound_says_which_bound_refused_it(monkeypatch):
    """A bound above twice Pillow's own cannot take an image Pillow's ``Image.open`` refuses: the message says that
    Pillow's bound refused it, and which setting raises it, not that the image is over the bound given."""
    from PIL import Image

    from turnrl.models.vision import ImageTooLarge, load_image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4096 * 4096)
    header_only = "data:image/png;base64," + base64.b64encode(png_of(9000, 9000, rows=0)).decode()
    with pytest.raises(ImageTooLarge, match="more than 33,554,432 pixels, which Pillow refuses .*MAX_IMAGE_PIXELS"):
        load_image(header_only, max_pixels=100_000_000)
    with pytest.raises(ImageTooLarge, match="more than 33,554,432 pixels, more than the 20,000,000 accepted"):
        load_image(header_only, max_pixels=20_000_000)


def test_an_image_over_twice_pillow_s_bound_is_refused_as_too_large(vlm_server, monkeypatch):
    """``serve`` lowers Pillow's bound to ``--max-image-pixels``; an image over twice that bound was refused by
    ``Image.open`` itself as a "decompression bomb DOS attack", not as too large, with no word of the option."""
    from PIL import Image

    base_url, _ = vlm_server
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4096 * 4096)  # as serve() sets it
    url = "data:image/png;base64," + base64.b64encode(png_of(9000, 9000, rows=0)).decode()
    reply = httpx.post(f"{base_url}/chat/completions", json={"model": MODEL, "messages": image_message(url)},
                       timeout=120)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "image_too_large" and "--max-image-pixels" in error["message"]
    assert "more than 33,554,432 pixels" in error["message"]


@pytest.mark.parametrize("data", [b"hello", b"%PDF-1.4", b'<svg xmlns="http://www.w3.org/2000/svg"/>', b""],
                         ids=["text", "pdf", "svg", "empty"])
def test_data_that_is_no_image_is_named_so(vlm_server, data):
    """Pillow's "cannot identify image file <_io.BytesIO object at 0x7f...>" said nothing a client could act on."""
    base_url, _ = vlm_server
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    reply = httpx.post(f"{base_url}/chat/completions", json={"model": MODEL, "messages": image_message(url)},
                       timeout=120)
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert "in no image format Pillow reads (PNG, JPEG" in message and "BytesIO" not in message


def test_an_image_over_the_bound_is_refused_naming_the_bound_whatever_the_request_had_left(tiny_vlm_dir):
    """Refused at the smaller budget its request's earlier images left, it was said to be over that budget, as if
    that were --max-image-pixels."""
    policy = HFPolicy.from_config(ModelConfig(device="cpu"), str(tiny_vlm_dir), max_batch_size=8)

    def part(width: int, height: int) -> dict:
        url = "data:image/png;base64," + base64.b64encode(png_of(width, height)).decode()
        return {"type": "image_url", "image_url": {"url": url}}

    with running(create_app(policy, MODEL, max_image_pixels=64 * 64)) as base_url:
        content = [part(64, 64)] * 3 + [part(32, 32), part(100, 100), {"type": "text", "text": "?"}]
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
        refused = httpx.post(f"{base_url}/chat/completions", json=body, timeout=120)
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "100 x 100 = 10,000 pixels, more than the 4,096 accepted by this server (--max-image-pixels)" in message


def test_a_request_s_images_together_are_bounded_before_they_are_decoded(tiny_vlm_dir):
    """Each image under --max-image-pixels, but hundreds of them (small PNGs of one colour) would decode to
    gigabytes: a request's images together may have 4 times the bound, the image past it is refused undecoded."""
    policy = HFPolicy.from_config(ModelConfig(device="cpu"), str(tiny_vlm_dir), max_batch_size=8)
    url = "data:image/png;base64," + base64.b64encode(png_of(64, 64)).decode()
    with running(create_app(policy, MODEL, max_image_pixels=64 * 64)) as base_url:
        def ask(images: int) -> httpx.Response:
            content = [{"type": "image_url", "image_url": {"url": url}}] * images + [{"type": "text", "text": "?"}]
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}
            return httpx.post(f"{base_url}/chat/completions", json=body, timeout=120)

        assert ask(4).status_code == 200
        refused = ask(5)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"] == (
            "messages[0]: the request's images together have more than the 16,384 pixels accepted by this server "
            "(4 x --max-image-pixels); send fewer or smaller images")
