"""The stop-string filter against the plain reference: searching only after candidate tokens stops every sequence
at the same token as searching after every token, on a byte-level BPE tokenizer and a SentencePiece-style decoder
(word pieces that lose their leading space at the start of a text, byte pieces of multi-byte characters)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnrl.engine.stops import KEPT_MASKS, TAIL_SLACK_TOKENS, StopStringFilter, stop_string_in_tail

Decode = Callable[[list[int]], str]


def first_stop(tokens: list[int], stop_strings: tuple[str, ...], decode: Decode,
               candidates: np.ndarray | None = None) -> int | None:
    """How many tokens a sequence keeps: the first step whose tail holds a stop string, searched after every token
    (``candidates`` None: the reference) or after candidate tokens only."""
    for end in range(1, len(tokens) + 1):
        if candidates is not None and not candidates[tokens[end - 1]]:
            continue
        if stop_string_in_tail(tokens[:end], stop_strings, decode):
            return end
    return None


# A SentencePiece-style vocabulary: "▁" is a space, <0x..> pieces are bytes, a text's first space is dropped.
PIECES = ["▁the", "▁a", "b", "c", "▁", ".", "'s", "\n", "▁b", "ab", "<0xE2>", "<0x82>", "<0xAC>", "€", "▁€", "a"]


def sentencepiece_decode(ids: list[int]) -> str:
    data = bytearray()
    for piece in (PIECES[i] for i in ids):
        data += bytes([int(piece[3:5], 16)]) if piece.startswith("<0x") else piece.replace("▁", " ").encode()
    text = data.decode("utf-8", errors="replace")
    return text[1:] if text.startswith(" ") else text


def stop_strings_for(data: st.DataObject, text: str, alphabet: str) -> tuple[str, ...]:
    """One to three stop strings: pieces of the sequence's own text (so that they match) or random short ones."""
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if text and data.draw(st.booleans()):
            start = data.draw(st.integers(0, len(text) - 1))
            stops.append(text[start : start + data.draw(st.integers(1, 4))])
        else:
            stops.append(data.draw(st.text(alphabet, min_size=1, max_size=3)))
    return tuple(stops)


def check_filter(data: st.DataObject, decode: Decode, vocab: int, alphabet: str) -> None:
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24))
    stops = stop_strings_for(data, decode(tokens), alphabet)
    candidates = StopStringFilter(decode, vocab).candidates(stops)
    assert first_stop(tokens, stops, decode, candidates) == first_stop(tokens, stops, decode)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_filter_stops_where_the_reference_does_with_sentencepiece_pieces(data):
    check_filter(data, sentencepiece_decode, len(PIECES), "abc. '\n€s")


@pytest.fixture(scope="module")
def bpe_decode(tiny_tokenizer) -> Decode:
    return lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_filter_stops_where_the_reference_does_with_byte_level_bpe(data, bpe_decode, tiny_tokenizer):
    check_filter(data, bpe_decode, len(tiny_tokenizer), "abcdeilnorst .,!\n")


def test_only_tokens_that_can_end_a_stop_string_are_candidates():
    candidates = StopStringFilter(sentencepiece_decode, len(PIECES)).candidates(("a b",))
    chosen = {PIECES[i] for i in np.flatnonzero(candidates)}
    # Pieces holding a "b", and the byte pieces (their text alone is a broken character).
    assert chosen == {"b", "▁b", "ab", "<0xE2>", "<0x82>", "<0xAC>"}
    # A stop string that ends in a space: a word piece adds one in the middle of a text.
    assert StopStringFilter(sentencepiece_decode, len(PIECES)).candidates(("c ",))[PIECES.index("▁the")]


def test_an_id_the_decoder_cannot_decode_is_always_a_candidate():
    decode = lambda ids: "".join("xy"[i] for i in ids)  # noqa: E731  ids above 1 raise
    candidates = StopStringFilter(decode, 4).candidates(("y",))
    assert candidates.tolist() == [False, True, True, True]


@pytest.mark.parametrize("stop", ["日本語です", "🙂🙂", "déjà vu, déjà"])
def test_a_stop_string_of_multi_byte_characters_is_found_where_its_last_byte_is_sampled(stop):
    """A byte-level vocabulary (one token a byte): a character takes up to four tokens, so the tail decoded
    must be counted in bytes, not characters."""
    decode: Decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    tokens = list("ok ".encode()) + list(stop.encode()) + list(" and on".encode())
    assert first_stop(tokens, (stop,), decode) == len("ok ".encode()) + len(stop.encode())


def test_the_filter_keeps_the_masks_of_the_latest_stop_strings_only():
    """A server's requests may each bring their own stop strings: the masks kept are bounded (here well under the
    500 sets asked for), the latest used among them."""
    from tests.engine.test_running import array_bytes

    stop_filter = StopStringFilter(sentencepiece_decode, len(PIECES))
    kept = stop_filter.candidates(("a b",))
    for i in range(500):
        stop_filter.candidates((f"x{i}",))
        assert stop_filter.candidates(("a b",)) is kept  # used again each time: never dropped
    assert array_bytes(stop_filter) <= 100 * len(PIECES)
    fresh = StopStringFilter(sentencepiece_decode, len(PIECES))
    assert stop_filter.candidates(("x0",)).tolist() == fresh.candidates(("x0",)).tolist()  # dropped: made again


def test_the_tail_decoded_is_the_longest_stop_in_bytes_and_the_slack():
    """Only the last tokens are decoded: as many as the longest stop string's UTF-8 bytes ("€!" is four), and the
    slack."""
    decoded: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        decoded.append(ids)
        return bytes(ids).decode("utf-8", errors="replace")

    tokens = list(range(97, 123)) * 2
    assert not stop_string_in_tail(tokens, ("ab", "€!"), decode)
    assert decoded == [tokens[-(4 + TAIL_SLACK_TOKENS) :]]


def test_any_one_of_the_stop_strings_in_the_tail_stops():
    decode: Decode = lambda ids: bytes(ids).decode()  # noqa: E731
    assert stop_string_in_tail(list(b"it is done"), ("done", "never"), decode)
    assert stop_string_in_tail(list(b"it is done"), ("never", "done"), decode)
    assert not stop_string_in_tail(list(b"it is done"), ("never", "nor"), decode)


def test_the_filter_drops_the_mask_used_longest_ago_beyond_the_kept_number():
    stop_filter = StopStringFilter(sentencepiece_decode, len(PIECES))
    masks = [stop_filter.candidates((f"x{i}",)) for i in range(KEPT_MASKS + 1)]
    assert stop_filter.candidates(("x1",)) is masks[1]  # among the latest KEPT_MASKS: kept
    assert stop_filter.candidates(("x0",)) is not masks[0]  # used longest ago: dropped, made again
