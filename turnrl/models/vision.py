"""Images for a token-exact context: the image half of a VLM's processor.

A chat template writes one placeholder token per image (Qwen-VL:
``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>``); the
model needs that placeholder repeated once per visual token of the image.
:class:`ImageEncoder` runs the processor's image processor on each new image
once, when its observation arrives, and says how many placeholders the image
takes and what the model's forward needs for it (``pixel_values``,
``image_grid_thw``). The token context expands the placeholder itself
(:mod:`turnrl.rollout.context`), so images are never re-processed and earlier
turns never re-tokenized. Each encoded image also carries its digest, the
number that stands for it in the engine's cache keys, hashed once from the
image rather than from its pixel values at every turn that shows it again.
The encoder keeps the images it encoded by that digest (a bounded cache), so
a picture seen again (the same start in every episode of a group, a move
that changes nothing, the episodes of a settled policy that play alike) is
not processed again.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL processors are supported: their image
processors return ``image_grid_thw`` and an image takes
``t * h * w / merge_size**2`` placeholders.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import io
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import unquote

import numpy as np
import torch


@dataclass(frozen=True)
class EncodedImage:
    """One image, ready for the model."""

    model_inputs: dict[str, torch.Tensor]
    """What the model's forward takes for this image: ``pixel_values`` (patches, dim), ``image_grid_thw`` (1, 3)."""
    placeholder_tokens: int
    """How many image placeholder tokens stand for it in the context."""
    digest: int
    """:func:`content_digest` of the source image: what stands for it in the engine's cache keys."""


class MessageImages(NamedTuple):
    """A message's images as a token context takes them (``EpisodeTokens.start`` / ``add_observation``)."""

    token_counts: list[int]
    """Each image's placeholder count."""
    model_inputs: dict[str, torch.Tensor]
    """Their model inputs, concatenated along dim 0 (empty for none)."""
    digests: list[int]
    """Each image's :attr:`EncodedImage.digest` (empty where only the counts were made)."""


def content_digest(arrays: Sequence[np.ndarray]) -> int:
    """A negative number that stands for the arrays' contents (dtypes, shapes and bytes) in the engine's cache
    keys, among token ids (never negative). A collision would hand one image's cached keys and values to
    another, so it is 63 bits of a cryptographic hash, not a checksum's 32: SHA-256, which processors with SHA
    instructions (recent x86 and Arm server chips) compute at over 1 GB/s: a 225 x 225 frame in 0.085 ms
    against BLAKE2b's 0.160 ms on a 2-core AMD EPYC VM, a cost every observation's picture pays."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.data)
    return -1 - (int.from_bytes(digest.digest()[:8], "little") >> 1)


ENCODED_CACHE_BYTES = 256 * 2**20
"""What :class:`ImageEncoder` keeps of the images it encoded, at most: about 1,100 of visual Sokoban's 150x150
frames in bf16 (100 patches each), or 100 of VisGym's 448x448 ones."""


def encoded_bytes(image: EncodedImage) -> int:
    """The bytes of an encoded image's model inputs."""
    return sum(tensor.numel() * tensor.element_size() for tensor in image.model_inputs.values())


class ImageEncoder:
    """Encodes images with a VLM processor's image processor.

    Images are kept by their :func:`content_digest`, the least recently used dropped past ``cache_bytes``, and
    an image met again is not processed again: its encoding is the one made the first time (the processor
    makes the same pixels from the same image). What :meth:`encode` returns is shared with the cache and later
    calls, and so is what :meth:`message_inputs` returns for a message of one image: it is read, never written
    (:func:`join_inputs` makes new tensors for several images). The encoder may be used from several threads (a
    rollout's env workers, a server's requests).

    Args:
        processor: a ``transformers`` processor with ``image_processor``, ``tokenizer`` and an image
            token (Qwen-VL's ``<|image_pad|>``).
        pixel_dtype: the dtype ``pixel_values`` are kept in: the dtype the vision tower computes in. A Qwen-VL
            tower's first step casts its pixels to that dtype, so keeping them in it gives the same features
            from half the bytes of the processor's float32 (what a rollout's trajectories carry, gather across
            processes and move to the GPU).
        cache_bytes: the most bytes of encoded images kept (0: none kept, every image processed).
    """

    def __init__(self, processor: Any, pixel_dtype: torch.dtype = torch.float32,
                 cache_bytes: int = ENCODED_CACHE_BYTES) -> None:
        image_processor = getattr(processor, "image_processor", None)
        if image_processor is None:
            raise ValueError(f"{type(processor).__name__} has no image processor: it cannot take images")
        self.image_processor = image_processor
        self.tokenizer = processor.tokenizer
        self.image_token: str = getattr(processor, "image_token", None) or "<|image_pad|>"
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))
        self.merge_size = int(getattr(image_processor, "merge_size", 1))
        self.pixel_dtype = pixel_dtype
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[int, EncodedImage] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.images_processed = 0
        """Images the processor encoded (each image :meth:`encode` was given, less those found in the cache)."""
        self.images_reused = 0
        """Images :meth:`encode` found in the cache, or earlier in the same call."""

    @property
    def special_token_ids(self) -> list[int]:
        """Vision tokens a response must never contain: the model would read a sampled one as an image slot
        (a sampled ``<|image_pad|>`` breaks the next forward), so generation suppresses them."""
        names = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", self.image_token]
        vocab = self.tokenizer.get_vocab()
        return sorted({vocab[name] for name in names if name in vocab})

    def encode(self, images: Sequence[np.ndarray]) -> list[EncodedImage]:
        """Each ``HxWx3`` uint8 image as model inputs and its placeholder count; images met before come from
        the cache, the others are processed together.

        Raises:
            ValueError: an image is not an ``HxWx3`` uint8 array (:func:`check_image`), or the processor refuses it.
        """
        if not images:
            return []
        images = [check_image(image) for image in images]
        digests = [content_digest([image]) for image in images]
        with self._lock:
            found = {digest: self._cache[digest] for digest in set(digests) if digest in self._cache}
            for digest in found:
                self._cache.move_to_end(digest)
        new = {digest: index for index, digest in enumerate(digests) if digest not in found}  # first of each
        made = self._process([images[index] for index in new.values()], list(new)) if new else []
        found.update(zip(new, made))
        self._keep(made, reused=len(images) - len(new))
        return [found[digest] for digest in digests]

    def _keep(self, made: list[EncodedImage], reused: int) -> None:
        """Cache ``made``, then drop the least recently used images past :attr:`cache_bytes`; count them."""
        with self._lock:
            self.images_processed += len(made)
            self.images_reused += reused
            for image in made:
                if image.digest not in self._cache:
                    self._cache[image.digest] = image
                    self._cached_bytes += encoded_bytes(image)
            while self._cached_bytes > self.cache_bytes and self._cache:
                self._cached_bytes -= encoded_bytes(self._cache.popitem(last=False)[1])

    def _process(self, images: Sequence[np.ndarray], digests: Sequence[int]) -> list[EncodedImage]:
        """``images`` through the image processor, in one call; ``digests`` are theirs."""
        # Channels last, always: a 3-pixel-high frame must not pass for a channels-first one.
        out = self.image_processor(images=list(images), return_tensors="pt", input_data_format="channels_last")
        if "image_grid_thw" not in out:
            raise ValueError(
                f"{type(self.image_processor).__name__} gives no image_grid_thw: token contexts take "
                "Qwen2-VL, Qwen2.5-VL and Qwen3-VL style processors"
            )
        grids = out["image_grid_thw"]
        pixels = out["pixel_values"].to(self.pixel_dtype)
        patches = grids.prod(-1)
        starts = torch.cumsum(patches, 0) - patches
        encoded = []
        for index in range(len(images)):
            rows = slice(int(starts[index]), int(starts[index] + patches[index]))
            inputs = {"pixel_values": pixels[rows], "image_grid_thw": grids[index : index + 1]}
            if len(images) > 1:  # its own rows: views would keep the whole call's pixels alive in the cache
                inputs = {key: tensor.clone() for key, tensor in inputs.items()}
            encoded.append(EncodedImage(
                model_inputs=inputs,
                placeholder_tokens=int(patches[index]) // self.merge_size**2,
                # The image, not its pixel values: the processor makes the same pixels from the same image, and
                # the image is a fraction of their bytes (uint8 against one bf16 or float32 number a channel
                # of each patch, and each patch twice, the processor's temporal pair).
                digest=digests[index],
            ))
        return encoded

    def placeholder_counts(self, images: Sequence[np.ndarray]) -> list[int]:
        """Each ``HxWx3`` image's placeholder count, as :meth:`encode` counts it, from its size alone: the
        processor's own patch arithmetic (``get_number_of_image_patches``), no pixels made. Counting by making
        pixels was most of the time to tokenize a VLM's SFT chats, and many times more on a host whose cores
        other processes hold (torch's small tensor operations wait on threads they share)."""
        shapes = [check_image(image).shape for image in images]
        return [int(self.image_processor.get_number_of_image_patches(height, width)) // self.merge_size**2
                for height, width, _ in shapes]

    def message_inputs(self, images: Sequence[np.ndarray]) -> MessageImages:
        """A message's images encoded: their placeholder counts, model inputs and digests."""
        encoded = self.encode(images)
        return MessageImages([image.placeholder_tokens for image in encoded], join_inputs(encoded),
                             [image.digest for image in encoded])


def join_inputs(encoded: Sequence[EncodedImage]) -> dict[str, torch.Tensor]:
    """The model inputs of several images, concatenated along dim 0 in order (empty for no image); one image's
    own tensors, not a copy of them (an observation is most often one frame, and the episode copies it into the
    prompts' buffers anyway: :class:`~turnrl.rollout.context.InputRows`)."""
    if not encoded:
        return {}
    if len(encoded) == 1:
        return dict(encoded[0].model_inputs)
    return {key: torch.cat([image.model_inputs[key] for image in encoded]) for key in encoded[0].model_inputs}


class ImageTooLarge(ValueError):
    """An encoded image whose header gives more pixels than the reader accepts (refused before decoding)."""

    def __init__(self, message: str, pixels: int | None = None) -> None:
        super().__init__(message)
        self.pixels = pixels
        """Its pixels, where its header was read (None: Pillow refused it as a decompression bomb)."""


def load_image(value: Any, max_pixels: int | None = None) -> np.ndarray:
    """An image part's image as an ``HxWx3`` uint8 array: an array, a Pillow image, a file path, or a
    ``data:image/...;base64,`` URL (OpenAI's ``image_url``).

    An encoded image reads as a viewer shows it (:func:`rgb_array`): upright by its EXIF orientation,
    transparent pixels on white, 16-bit grayscale in 8 bits; an animated one is its first frame.

    Args:
        max_pixels: refuse an encoded image (path or URL) whose width x height exceeds it, from its header
            alone: Pillow's ``open`` reads only the header, so a small file that decodes to gigabytes (a
            12000 x 12000 PNG of one colour is 580 KB) is refused before any pixel is made. None: no bound.

    Raises:
        ImageTooLarge: the image has more than ``max_pixels`` pixels.
        ValueError: the value is no image, or a truncated or corrupt one.
    """
    from PIL import Image

    if isinstance(value, np.ndarray):
        return check_image(value)
    if isinstance(value, Image.Image):
        return check_image(rgb_array(value))
    if not isinstance(value, str):
        raise ValueError(f"cannot read an image from a {type(value).__name__}")
    source: Any = io.BytesIO(data_url_bytes(value)) if is_data_url(value) else value
    try:
        opened = Image.open(source)
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError):
        raise
    except Image.DecompressionBombError:  # over twice Pillow's own bound: refused by Image.open, from the header
        pillows = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        if max_pixels is not None and max_pixels <= pillows:
            raise ImageTooLarge(f"the image has more than {pillows:,} pixels, more than the {max_pixels:,} "
                                "accepted") from None
        raise ImageTooLarge(f"the image has more than {pillows:,} pixels, which Pillow refuses (twice its "
                            "PIL.Image.MAX_IMAGE_PIXELS) before any bound of turnrl's is applied; raise that to "
                            "take larger images") from None
    except Image.UnidentifiedImageError:
        raise ValueError("it is in no image format Pillow reads (PNG, JPEG, GIF, WebP, BMP, TIFF, ...)") from None
    except MemoryError:
        raise
    except Exception as error:  # corrupt bytes: see _undecodable
        raise ValueError(f"the image file is truncated or corrupt ({_undecodable(error)}); give the whole "
                         "file") from None
    with opened as image:
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageTooLarge(f"the image is {width} x {height} = {width * height:,} pixels, more than the "
                                f"{max_pixels:,} accepted", pixels=width * height)
        try:
            array = rgb_array(image)
        except MemoryError:
            raise
        except Exception as error:  # corrupt bytes: see _undecodable
            raise ValueError(f"the {image.format or 'image'} file is truncated or corrupt ({_undecodable(error)}): "
                             "its header reads but its pixels do not; give the whole file") from None
    return check_image(array)


def _undecodable(error: Exception) -> str:
    """What Pillow raised on bytes it cannot decode, for the message. Its decoders raise whatever the corrupt data
    leads them to, and Pillow's own fuzz tests catch ``Exception`` for that reason: ``OSError``, ``EOFError``,
    ``SyntaxError`` and ``struct.error`` for a file cut short or a corrupt chunk, ``ValueError`` for a PPM header
    whose size is no number, ``TypeError`` for a TIFF whose strip offsets are text. A missing or unreadable file
    (``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``) is raised as it is before this, and
    ``MemoryError`` is never folded into a ValueError."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def is_data_url(value: str) -> bool:
    """Whether ``value`` is a ``data:`` URL (the scheme is case-insensitive; a client may leave spaces before it)."""
    return value.lstrip()[:5].lower() == "data:"


def data_url_bytes(url: str) -> bytes:
    """The bytes of a ``data:[<media type>][;base64],<data>`` URL's base64 data.

    Clients do not all send base64 as ``b64decode(validate=True)`` takes it: MIME encoders wrap it every 76
    characters, JSON writers indent it, a data URL may be percent-encoded (RFC 2397), and some encoders use the
    URL-safe alphabet (``-_``) or drop the padding. None of these is ambiguous, so each is read; any other
    character is refused rather than skipped, as a non-validating decoder would, silently, into garbage.

    Raises:
        ValueError: the URL is not base64, or its data is not base64.
    """
    header, comma, data = url.strip().partition(",")
    if not comma or "base64" not in (parameter.strip().lower() for parameter in header.split(";")[1:]):
        raise ValueError("an image data URL must be base64-encoded (data:image/png;base64,...)")
    text = "".join(unquote(data).split()).translate(_URL_SAFE_BASE64)
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as error:  # binascii.Error, or a character outside ASCII (which b64decode refuses first)
        raise ValueError(f"the image data URL's data is not base64 ({error}): encode the file's bytes with "
                         "base64 (standard or URL-safe alphabet) after 'base64,'") from None


_URL_SAFE_BASE64 = str.maketrans("-_", "+/")
"""The URL-safe base64 alphabet's two letters as the standard alphabet writes them."""


def rgb_array(image: Any) -> np.ndarray:
    """A Pillow image's pixels as an ``HxWx3`` uint8 array, as an image viewer shows them (and as transformers'
    ``load_image`` and ``convert_to_rgb`` make them).

    - Turned upright by its EXIF orientation: a phone's photo is stored sideways with a tag that says so.
    - Transparent pixels composited on white: dropping the alpha channel shows the colour stored under them,
      most often black, so a dark drawing on a transparent background would read as an all-black picture.
    - 16-bit grayscale scaled to 8 bits: Pillow's conversion clips it, so all but its darkest 1/256 is white.
    """
    from PIL import ExifTags, Image, ImageOps

    image.load()  # a PNG's EXIF may follow its pixels
    if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:  # transposed, else no copy made
        image = ImageOps.exif_transpose(image)
    if image.mode in _SIXTEEN_BIT_GRAY:
        gray = (np.asarray(image).astype(np.uint16) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if {"A", "a"} & set(image.getbands()) or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.array(image.convert("RGB"))  # a writable copy (torch warns on read-only arrays)


_SIXTEEN_BIT_GRAY = ("I;16", "I;16L", "I;16B", "I;16N")
"""Pillow's modes of 16-bit grayscale (a 16-bit PNG's)."""


def check_image(image: Any) -> np.ndarray:
    """``image`` as the ``HxWx3`` uint8 array it must be (RGB, 0-255, at least one pixel), else a ValueError
    saying what it is and how to make it one. A processor takes other arrays without a word and makes other
    pixels of them: floats in [0, 1] are divided by 255 again (a black picture), a grayscale or channels-first
    array fails deep in its code with a message about tensor sizes."""
    array = np.asarray(image)
    if array.ndim == 3 and array.shape[2] == 3 and array.dtype == np.uint8 and array.size:
        return array
    found = f"got shape {array.shape} and dtype {array.dtype}"
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[2] not in (1, 3, 4):
        hint = "; for a channels-first array, pass image.transpose(1, 2, 0)"
    elif array.ndim == 2:
        hint = "; for grayscale, pass np.stack([image] * 3, axis=2)"
    elif array.ndim == 3 and array.shape[2] == 1:
        hint = "; for grayscale, pass np.repeat(image, 3, axis=2)"
    elif array.ndim == 3 and array.shape[2] == 4:
        hint = "; for RGBA, drop or composite the alpha channel (image[..., :3])"
    elif np.issubdtype(array.dtype, np.floating):
        hint = ("; for floats, pass (image * 255).round().astype(np.uint8) from [0, 1], "
                "image.round().astype(np.uint8) from [0, 255]")
    elif array.ndim == 3 and array.shape[2] == 3 and array.size:
        hint = "; for values in 0-255, pass image.astype(np.uint8)"
    else:
        hint = ""
    raise ValueError(f"an image must be an HxWx3 uint8 array (RGB, values 0-255, at least 1 x 1), {found}{hint}")


def part_images(content: Any) -> list[Any]:
    """The images of a message's content parts, in order: ``{"type": "image", "image": ...}`` and OpenAI's
    ``{"type": "image_url", "image_url": {"url": ...}}`` (values as they are; see :func:`load_image`).

    Raises:
        ValueError: a part that is no object, or an ``image_url`` part without its url (with what was given).
    """
    if not isinstance(content, list):
        return []
    images = []
    for index, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"content part {index} is a {type(part).__name__}, not an object like "
                             '{"type": "text", "text": ...} or {"type": "image_url", "image_url": {"url": ...}}')
        if part.get("type") == "image" and "image" in part:
            images.append(part["image"])
        elif part.get("type") == "image_url":
            given = part.get("image_url")
            url = given.get("url") if isinstance(given, dict) else given
            if not url:
                raise ValueError(f"content part {index} is an image_url part without its url: give "
                                 '{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}')
            images.append(url)
    return images


def position_inputs(model: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a VLM's forward needs, besides the pixels, to give its image tokens their own positions.

    Qwen2-VL/2.5-VL/3-VL place image tokens with 3D rotary positions (M-RoPE). Recent transformers
    compute them only when ``mm_token_type_ids`` (1 on image tokens, 2 on video tokens) is passed, and
    otherwise fall back to 1D positions without a word; processors return it, token contexts do not, so
    it is derived here from the ids. Empty for a model that does not take it (a text model, or a
    transformers version that derives the positions from the ids itself).

    Args:
        model: the model (or its base model) whose forward is called.
        input_ids: Shape (b, s).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft passes it through
    config = getattr(base, "config", None)
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is None or not _takes(base, "mm_token_type_ids"):
        return {}
    types = (input_ids == image_token_id).int()
    video_token_id = getattr(config, "video_token_id", None)
    if video_token_id is not None:
        types = types.masked_fill(input_ids == video_token_id, 2)
    return {"mm_token_type_ids": types}


def _takes(model: Any, argument: str) -> bool:
    """Whether ``model.forward`` names ``argument`` (read from the signature, once per class)."""
    cls = type(model)
    if cls not in _FORWARD_ARGUMENTS:
        _FORWARD_ARGUMENTS[cls] = frozenset(inspect.signature(model.forward).parameters)
    return argument in _FORWARD_ARGUMENTS[cls]


_FORWARD_ARGUMENTS: dict[type, frozenset[str]] = {}
