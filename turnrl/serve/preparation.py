"""Preparing a request of ``turnrl serve-policy`` for the policy: what pydantic cannot check (the model's name,
unsupported options, the context's length), the chat template and the images, into a :class:`PreparedRequest`.

A prompt that cannot fit the context is refused before it is tokenized where that is cheap to know: more messages
than the context has tokens, or more characters of text than its tokens could span (:func:`longest_token_chars`).
Tokenizing 30 MB of text took 40 seconds of a preparation thread and left gigabytes held, only to find it too long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from turnrl.chat.template_deltas import ChatTemplateDeltas, TemplateDeltaError, expand_placeholders, fold_system
from turnrl.config import SamplingConfig
from turnrl.models.loading import context_window
from turnrl.models.vision import ImageTooLarge, load_image
from turnrl.policy.interface import Policy
from turnrl.serve.chat_schema import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    ImagePart,
    TextPart,
    quoted,
    shortened,
)

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
"""Pixels an image may have (from its header) to be decoded: 48 MiB as RGB, beyond what any served VLM's
processor keeps (Qwen2-VL resizes to at most 12.8 M pixels)."""

IMAGES_PIXELS_PER_REQUEST = 4
"""A request's images together may have this many times ``--max-image-pixels``: each image alone is bounded,
but a body of hundreds of small PNGs of one colour would otherwise decode to gigabytes."""


@dataclass
class PreparedRequest:
    """A validated request as the policy sees it."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    model_inputs: dict[str, Any] | None = None
    """A VLM's inputs for the prompt's images."""
    image_digests: list[int] | None = None
    """Their digests (the engine's cache keys for them)."""


def _template_messages(
    messages: list[ChatMessage], model_name: str, sees_images: bool, max_image_pixels: int
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Messages for the chat template and the images of their image parts, in order.

    A text model gets string contents (text parts joined by newlines) and refuses image parts; a VLM
    keeps the parts, each image as ``{"type": "image"}`` where its template writes the placeholder.
    Images must be data URLs: the server fetches nothing.
    """
    out, images = [], []
    pixels_left = IMAGES_PIXELS_PER_REQUEST * max_image_pixels
    for index, message in enumerate(messages):
        content: Any = message.content
        if isinstance(content, list):
            if not sees_images and any(isinstance(part, ImagePart) for part in content):
                raise APIError(400, f"model {model_name!r} is text-only: messages[{index}] has an image part",
                               param=f"messages.{index}.content")
            if sees_images:
                parts = []
                for part in content:
                    if isinstance(part, ImagePart):
                        image = _image(part, index, max_image_pixels, pixels_left)
                        pixels_left -= image.shape[0] * image.shape[1]
                        images.append(image)
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": part.text})
                content = parts
            else:
                content = "\n".join(part.text for part in content if isinstance(part, TextPart))
        role = "system" if message.role == "developer" else message.role
        out.append({"role": role, "content": content or ""})
    return out, images


def _image(part: ImagePart, index: int, max_pixels: int, pixels_left: int) -> np.ndarray:
    """The image of ``part``, refused (undecoded, from its header) over ``max_pixels`` or over the
    ``pixels_left`` of its request's images together."""
    url = part.image_url.url
    if not url.startswith("data:"):
        raise APIError(400, f"messages[{index}]: images must be data URLs (data:image/png;base64,...); "
                            "this server fetches nothing", param=f"messages.{index}.content")
    try:
        return load_image(url, max_pixels=min(max_pixels, pixels_left))
    except ImageTooLarge as error:
        if error.pixels is not None and error.pixels <= max_pixels:  # within the bound alone, not with the others
            bound = IMAGES_PIXELS_PER_REQUEST * max_pixels
            raise APIError(400, f"messages[{index}]: the request's images together have more than the {bound:,} "
                                f"pixels accepted by this server ({IMAGES_PIXELS_PER_REQUEST} x --max-image-pixels); "
                                "send fewer or smaller images", param=f"messages.{index}.content",
                           code="image_too_large") from None
        if pixels_left < max_pixels:  # the refusal named what the request had left: name the option's bound
            error = _refusal_at(url, max_pixels, error)
        raise APIError(400, f"messages[{index}]: {error} by this server (--max-image-pixels); send a smaller "
                            "image (the model resizes large ones down anyway)",
                       param=f"messages.{index}.content", code="image_too_large") from None
    except Exception as error:  # a broken image is the client's error, never the server's
        raise APIError(400, f"messages[{index}]: the image cannot be read: {shortened(str(error))}",
                       param=f"messages.{index}.content") from None


def _refusal_at(url: str, max_pixels: int, refused: ImageTooLarge) -> ImageTooLarge:
    """The refusal of an image over ``max_pixels`` in the words of that bound (its header read again, undecoded),
    where it was first refused at the smaller bound its request had left; ``refused`` if that reads otherwise."""
    try:
        load_image(url, max_pixels=max_pixels)
    except ImageTooLarge as error:
        return error
    except Exception:  # read once already: the first refusal stands
        return refused
    return refused


def with_system_folded(messages: list[dict[str, str]], tokenizer: Any) -> list[dict[str, str]]:
    """A leading system message folded into the first user message where the template has no system role
    (Gemma 2 raises on one), as the rollout's token context does: a client may always send one."""
    if len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user":
        return messages
    try:
        system_role = ChatTemplateDeltas.for_tokenizer(tokenizer).system_role
    except TemplateDeltaError:  # a template the rollout cannot use incrementally; leave it to render as it can
        return messages
    return messages if system_role else [fold_system(messages[0], messages[1]), *messages[2:]]


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs:
        raise APIError(400, "top_logprobs > 0 is not supported: only the sampled tokens' logprobs are returned",
                       param="top_logprobs")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise APIError(400, f"{name} is not supported (use 0)", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
    if body.tools:
        raise APIError(400, "tools are not supported by this server", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")


def context_length(policy: Policy) -> int | None:
    """Tokens a prompt and its completion may hold together: the model's context window
    (``max_position_embeddings``) or the policy's own bound on a sequence (the engine's
    ``model.engine.max_seq_len``), the smaller; None if neither says. Past the engine's bound a prompt fails
    and a completion is cut short, so a request that would pass it is refused instead."""
    bounds = [bound for bound in (model_positions(policy), policy.max_sequence_tokens) if bound is not None]
    return min(bounds, default=None)


def model_positions(policy: Policy) -> int | None:
    """The model's context window (``max_position_embeddings``), if it says."""
    return None if policy.model is None else context_window(policy.model)


def prepare(body: ChatCompletionRequest, policy: Policy, model_name: str, default_max_tokens: int,
            max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, max_token_chars: int | None = None) -> PreparedRequest:
    """Validate what pydantic cannot (model, unsupported options, context length) and tokenize the prompt.

    Blocking (the chat template, image decoding, the image processor): the app runs it on its preparation
    threads, never on the event loop.

    Args:
        max_token_chars: the most characters of text one token of ``policy``'s tokenizer spans
            (:func:`longest_token_chars`); None: the text is not measured before it is tokenized.
    """
    if body.model != model_name:
        raise APIError(404, f"model {quoted(body.model)} does not exist; this server serves {quoted(model_name)}",
                       param="model", code="model_not_found")
    _refuse_unsupported(body)
    limit = context_length(policy)
    if limit is not None:
        refuse_what_cannot_fit(body.messages, limit, max_token_chars, policy.tokenizer)
    encoder = policy.image_encoder
    messages, images = _template_messages(body.messages, model_name, sees_images=encoder is not None,
                                          max_image_pixels=max_image_pixels)
    messages = with_system_folded(messages, policy.tokenizer)
    try:
        ids = policy.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as error:  # e.g. a template that insists on alternating roles
        raise APIError(400, f"the chat template rejected the messages: {shortened(str(error))}",
                       param="messages") from None
    prompt_ids = [int(i) for i in ids]
    model_inputs, digests = None, None
    if images and encoder is not None:  # each placeholder expanded to its image's visual tokens, as in the rollout
        try:
            counts, model_inputs, digests = encoder.message_inputs(images)
            prompt_ids = expand_placeholders(prompt_ids, encoder.image_token_id, counts)
        except ValueError as error:  # an image the processor refuses, or a text that writes image placeholders
            raise APIError(400, f"the images cannot be used: {shortened(str(error))}", param="messages") from None
    room = default_max_tokens if limit is None else min(default_max_tokens, limit - len(prompt_ids))
    max_tokens = body.max_completion_tokens or body.max_tokens or max(room, 1)
    if limit is not None and len(prompt_ids) + max_tokens > limit:
        asked = len(prompt_ids) + max_tokens
        raise APIError(400, f"this model's context is {limit} tokens; the request asks for {asked} "
                            f"({len(prompt_ids)} in the messages, {max_tokens} for the completion)"
                            f"{context_bound_note(policy, limit)}",
                       param="messages", code="context_length_exceeded")
    top_k = body.top_k if body.top_k and body.top_k > 0 else 0
    sampling = SamplingConfig(temperature=body.temperature, top_p=body.top_p, top_k=top_k,
                              max_new_tokens=max_tokens, stop=body.stop_list())
    return PreparedRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling, model_inputs=model_inputs,
                           image_digests=digests)


def context_bound_note(policy: Policy, limit: int) -> str:
    """Where the bound comes from when it is the server's setting rather than the model's: the one an operator
    can raise."""
    if policy.max_sequence_tokens == limit and model_positions(policy) != limit:
        return " (the server's bound on a sequence, model.engine.max_seq_len)"
    return ""



# --------------------------------------------------------------------------- prompts too long to tokenize
def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token of ``tokenizer`` spans, from its vocabulary (computed once, at the
    server's start); None where no such bound holds.

    It holds for byte-level BPE (Qwen, Llama-3, GPT-2: every token is at most as many bytes as its vocabulary
    entry has characters, and a character is at least a byte) and for BPE with byte fallback (Llama-2, Gemma:
    an entry is the characters it spans, ``▁`` for a space, or one byte). Not for a tokenizer with an unknown
    token, which spans a whole unknown word or run, nor one whose pre-tokenizer drops spaces (WordPiece).
    """
    from tokenizers import decoders, models

    backend = getattr(tokenizer, "backend_tokenizer", None)  # a slow (Python) tokenizer has none
    if backend is None or not isinstance(backend.model, models.BPE):
        return None
    if not (isinstance(backend.decoder, decoders.ByteLevel) or backend.model.byte_fallback):
        return None
    return max((len(token) for token in tokenizer.get_vocab()), default=None)


def refuse_what_cannot_fit(messages: list[ChatMessage], limit: int, max_token_chars: int | None,
                           tokenizer: Any) -> None:
    """Refuse, before the chat template and the tokenizer, messages that take more than ``limit`` tokens
    whatever their tokens: more messages than that (every chat template writes at least one token a message),
    or more characters of text than ``limit`` tokens of at most ``max_token_chars`` characters span.

    The characters are counted as the tokenizer sees them, after its normalizer (NFC composes some pairs of
    characters into one), which runs only on text the plain count would refuse, and no further than the count
    needs (:func:`normalized_chars_past`).
    """
    if len(messages) > limit:
        raise APIError(400, f"this model's context is {limit} tokens; the request has {len(messages):,} messages, "
                            "and a chat template writes at least one token a message", param="messages",
                       code="context_length_exceeded")
    if max_token_chars is None:
        return
    texts = [text for message in messages for text in message_texts(message)]
    bound, chars = limit * max_token_chars, sum(map(len, texts))
    if chars <= bound:
        return
    normalizer = tokenizer.backend_tokenizer.normalizer
    if normalizer is None or normalized_chars_past(texts, normalizer, bound) > bound:
        raise APIError(400, f"this model's context is {limit} tokens; the messages have {chars:,} characters of "
                            f"text, and no token of this model spans more than {max_token_chars}, so they take "
                            f"more than {limit} tokens", param="messages", code="context_length_exceeded")


def normalized_chars_past(texts: list[str], normalizer: Any, enough: int) -> int:
    """At most the characters ``texts`` have once ``normalizer`` ran on them, counted until the count passes
    ``enough`` (normalizing 30 MB took over a second) or the texts end.

    Each text, cut where the count would pass, is normalized alone and counted one character short: its last
    character may compose with the next (an accent that followed the cut, or began the next text).
    """
    count = 0
    for text in texts:
        if count > enough:
            break
        count += len(normalizer.normalize_str(text[: enough - count + 2])) - 1
    return count


def message_texts(message: ChatMessage) -> list[str]:
    """The texts of a message's content: the string, or its text parts."""
    if isinstance(message.content, str):
        return [message.content]
    return [part.text for part in message.content or [] if isinstance(part, TextPart)]
