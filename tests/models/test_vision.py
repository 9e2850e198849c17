"""Reading images as a user, a client or an env hands them over: data URLs as clients write their base64, encoded
images as a viewer shows them, and arrays that are not ``HxWx3`` uint8 refused with what to do, never turned into
other pixels."""

from __future__ import annotations

import base64
import io
import re
import textwrap
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from PIL import Image

from turnrl.models.loading import load_processor
from turnrl.models.vision import ImageEncoder, data_url_bytes, load_image


def encoded(image: Image.Image, format: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=format, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def picture() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)


PNG = encoded(Image.fromarray(picture()))
BASE64 = base64.b64encode(PNG).decode()


@pytest.mark.parametrize("url", [
    "data:image/png;base64," + "\n".join(textwrap.wrap(BASE64, 76)),  # MIME encoders (Python's encodebytes)
    "data:image/png;base64," + "\r\n".join(textwrap.wrap(BASE64, 76)),
    "data:image/png;base64,\n    " + "\n    ".join(textwrap.wrap(BASE64, 60)) + "\n",  # indented
    "data:image/png;base64," + base64.urlsafe_b64encode(PNG).decode(),
    "data:image/png;base64," + BASE64.rstrip("="),
    "data:image/png;base64," + quote(BASE64, safe=""),  # percent-encoded, as RFC 2397 allows
    "data:image/png;BASE64," + BASE64,
    "  DATA:image/png;base64," + BASE64,
], ids=["wrapped", "crlf", "indented", "url-safe", "unpadded", "percent-encoded", "upper-case", "spaced"])
def test_a_data_url_reads_however_a_client_wraps_or_spells_its_base64(url):
    assert np.array_equal(load_image(url), picture())


@pytest.mark.parametrize("data", ["iVBORw0K!!!!", "iVBORw0K\x00", "iVBORw0K0", "iVBORw0K\u00e9"],
                         ids=["punctuation", "nul", "length", "not ascii"])
def test_a_data_url_whose_data_is_not_base64_says_so(data):
    with pytest.raises(ValueError, match=r"data URL's data is not base64 \(.*\): encode the file's bytes"):
        load_image("data:image/png;base64," + data)


_BASE64_TEXT = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/-_=% \n\t")


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(), st.text("data:image/pngbase64;, "),
                 st.one_of(_BASE64_TEXT, st.text()).map(lambda data: "data:image/png;base64," + data)))
def test_any_data_url_text_is_its_bytes_or_a_value_error(url):
    try:
        data = data_url_bytes(url)
    except ValueError as error:
        assert "data URL" in str(error), error
        return
    assert isinstance(data, bytes)


# Small files of each format Pillow reads most, whose bytes a test spoils: a decoder's every check is reached.
_ENCODED = [encoded(Image.fromarray(picture()[:6, :5]), format) for format in ("PNG", "GIF", "BMP", "TIFF", "JPEG",
                                                                                "WEBP", "ICO", "PPM")]


@st.composite
def spoiled_files(draw) -> bytes:
    """A small image file with some bytes changed, cut short or with bytes after it."""
    data = bytearray(draw(st.sampled_from(_ENCODED)))
    for _ in range(draw(st.integers(0, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))]) + draw(st.binary(max_size=16))


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow warns of the corrupt TIFF tags it skips
@settings(max_examples=100, deadline=None)
@given(st.one_of(spoiled_files(), st.binary()), st.sampled_from(["image/png", "image/gif", "application/octet-stream"]))
@example(b"P6\n\xff 5\n255\n", "image/png")  # was Pillow's own ValueError: "invalid literal for int() with base 10"
@example(b"P6 5", "image/png")  # was Pillow's own ValueError: "Reached EOF while reading header"
@example(  # was Pillow's TypeError from load(): a TIFF whose strip offsets (tag 273) are text
    b"II*\x00\x08\x00\x00\x00\n\x00\x00\x01\x04\x00\x01\x00\x00\x00\x05\x00\x00\x00\x01\x01\x04\x00\x01\x00\x00\x00\x06"
    b"\x00\x00\x00\x02\x01\x03\x00\x03\x00\x00\x00\x86\x00\x00\x00\x03\x01\x03\x00\x01\x00\x00\x00\x01\x00\x00\x00\x06"
    b"\x01\x03\x00\x01\x00\x00\x00\x02\x00\x00\x00\x11\x01\x02\x00\x01\x00\x00\x00\x8c\x00\x00\x00\x15\x01\x03\x00\x01"
    b"\x00\x00\x00\x03\x00\x00\x00\x16\x01\x04\x00\x01\x00\x00\x00\x06\x00\x00\x00\x17\x01\x04\x00\x01\x00\x00\x00Z\x00"
    b"\x00\x00\x1c\x01\x03\x00\x01\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x08\x00\x08\x00\x08\x00", "image/png")
def test_any_bytes_in_a_data_url_are_an_image_or_a_value_error(data, media_type):
    """What a client sends as an image: any bytes decode to an image, or are refused with a ValueError that says
    why (ImageTooLarge is one), never Pillow's own exceptions nor its words alone."""
    try:
        array = load_image(data_url(data, media_type), max_pixels=10_000)
    except ValueError as error:
        assert re.search("no image format|truncated or corrupt|pixels", str(error)), error
        return
    assert array.ndim == 3 and array.shape[2] == 3 and array.dtype == np.uint8 and array.size


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_read_as_white_as_a_viewer_shows_them(mode):
    """A dark drawing on a transparent background (what is stored under transparent pixels is most often black)
    read as all black when the alpha channel was dropped."""
    rgba = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    rgba.putpixel((2, 3), (0, 0, 0, 255))
    if mode == "P":
        image = Image.new("P", (8, 8), 0)
        image.putpalette([0, 0, 0] * 256)
        image.putpixel((2, 3), 1)
        data = encoded(image, transparency=0)
    else:
        data = encoded(rgba.convert(mode))
    array = load_image(data_url(data))
    expected = np.full((8, 8, 3), 255, dtype=np.uint8)
    expected[3, 2] = 0
    assert np.array_equal(array, expected)
    assert np.array_equal(load_image(Image.open(io.BytesIO(data))), expected)


def test_a_photo_reads_upright_by_its_exif_orientation():
    """A phone stores a portrait photo sideways with EXIF orientation 6 (turn it 90 degrees clockwise)."""
    stored = np.zeros((20, 40, 3), dtype=np.uint8)
    stored[:, :20] = (255, 0, 0)  # left half red: the top once turned clockwise
    stored[:, 20:] = (0, 0, 255)
    image = Image.fromarray(stored)
    exif = image.getexif()
    exif[0x0112] = 6
    array = load_image(data_url(encoded(image, "JPEG", exif=exif.tobytes(), quality=95), "image/jpeg"))
    assert array.shape == (40, 20, 3)
    assert array[:15, :, 0].min() > 200 and array[:15, :, 2].max() < 60  # red on top
    assert array[25:, :, 2].min() > 200 and array[25:, :, 0].max() < 60  # blue below


def test_sixteen_bit_grayscale_is_scaled_to_eight_bits_not_clipped_to_white():
    levels = np.array([[0, 128 * 257, 65535, 1000]], dtype=np.uint16)
    image = Image.fromarray(levels)
    assert image.mode == "I;16"
    array = load_image(data_url(encoded(image)))
    assert array.shape == (1, 4, 3) and array[0, :, 0].tolist() == [0, 128, 255, 3]
    assert np.array_equal(load_image(image), array)


def test_an_animated_gif_reads_as_its_first_frame():
    frames = [Image.new("RGB", (6, 4), colour) for colour in ((255, 0, 0), (0, 255, 0))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    array = load_image(data_url(out.getvalue(), "image/gif"))
    assert array.shape == (4, 6, 3) and array[0, 0].tolist() == [255, 0, 0]


@pytest.mark.parametrize("data", [PNG[: len(PNG) // 2], PNG[:20]], ids=["pixels cut", "header cut"])
def test_a_truncated_file_is_refused_as_truncated(data, tmp_path):
    path = tmp_path / "cut.png"
    path.write_bytes(data)
    for source in (data_url(data), str(path)):
        with pytest.raises(ValueError, match="truncated or corrupt.*give the whole file"):
            load_image(source)


def test_a_missing_file_is_still_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_image(str(tmp_path / "none.png"))


NOT_IMAGES = {
    "floats in [0, 1]": (np.full((4, 4, 3), 0.5, dtype=np.float32), r"\(image \* 255\).round\(\).astype"),
    "int64": (np.full((4, 4, 3), 7, dtype=np.int64), r"image.astype\(np.uint8\)"),
    "grayscale": (np.zeros((4, 4), dtype=np.uint8), "for grayscale"),
    "channels first": (np.zeros((3, 8, 8), dtype=np.uint8), r"transpose\(1, 2, 0\)"),
    "RGBA": (np.zeros((4, 4, 4), dtype=np.uint8), "alpha channel"),
    "empty": (np.zeros((0, 4, 3), dtype=np.uint8), "at least 1 x 1"),
}


@pytest.mark.parametrize("name", NOT_IMAGES)
def test_an_array_that_is_no_rgb_image_is_refused_with_what_to_do(name):
    array, advice = NOT_IMAGES[name]
    with pytest.raises(ValueError, match=f"must be an HxWx3 uint8 array.*{advice}"):
        load_image(array)


@pytest.fixture(scope="module")
def encoder(tiny_vlm_dir):
    return ImageEncoder(load_processor(tiny_vlm_dir))


@pytest.mark.parametrize("name", NOT_IMAGES)
def test_the_encoder_refuses_what_the_processor_would_turn_into_other_pixels(name, encoder):
    """An env's float frame in [0, 1] was rescaled by 1/255 once more (a black picture, trained on without a
    word); a grayscale, channels-first or empty one failed deep in the processor (tensor sizes, a division by
    zero) with nothing said of the image."""
    array, advice = NOT_IMAGES[name]
    with pytest.raises(ValueError, match=f"must be an HxWx3 uint8 array.*{advice}"):
        encoder.encode([picture(), array])
    with pytest.raises(ValueError, match=f"must be an HxWx3 uint8 array.*{advice}"):
        encoder.placeholder_counts([array])
    (image,) = encoder.encode([picture()])
    assert image.placeholder_tokens == encoder.placeholder_counts([picture()])[0]
