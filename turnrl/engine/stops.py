"""Stop strings without decoding every sequence at every step.

A stop string ends a sequence at the token that completes it: the engine
decodes the last few generated tokens and searches the text
(:func:`stop_string_in_tail`). Decoding costs tens of microseconds per
sequence with a real tokenizer, so at every step only the sequences whose
new token *can* complete a stop string are checked: the new token's text
must contain the stop string's last character (a match that ended before
it was found at an earlier step).

A token's text in context can differ from its text decoded alone: a
SentencePiece word piece loses its leading space at the start of a text,
and a byte-level piece holding part of a multi-byte character decodes to
U+FFFD alone. So a token's characters are taken from its lone decoding and
from its decoding twice in a row (``"▁bar"`` gives ``"bar bar"``), and a token
whose text holds U+FFFD, or that fails to decode, is always checked.
The filter is exact for decoders where appending tokens only appends text
(apart from completing a broken character), as byte-level BPE and
SentencePiece decoders do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

REPLACEMENT = "\ufffd"
"""What a decoder prints for bytes that are not (yet) a whole UTF-8 character."""

KEPT_MASKS = 64
"""Sets of stop strings whose masks are kept (the latest used): a server's requests may each bring their own, and
a mask is a vocabulary's booleans."""

TAIL_SLACK_TOKENS = 8
"""Tokens decoded beyond the longest stop string's length in UTF-8 bytes (the tokens before it may end in part of
a character, which decodes to the replacement character)."""


def tail_tokens(stop_strings: Sequence[str]) -> int:
    """How many of the last generated tokens to decode so that a stop string ending in the newest one lies within
    them: its length in UTF-8 bytes (every token adds a byte or more; counted in characters, a stop of CJK
    characters or emoji, each of two to four byte-level tokens, was never found), and :data:`TAIL_SLACK_TOKENS`."""
    return max(len(stop.encode("utf-8")) for stop in stop_strings) + TAIL_SLACK_TOKENS


def stop_string_in_tail(generated: Sequence[int], stop_strings: Sequence[str], decode: Callable[[list[int]], str]
                        ) -> bool:
    """Whether the text of the last generated tokens holds a stop string (the check run after a candidate token).

    Only the last :func:`tail_tokens` tokens are decoded: a stop string that ends in the newest token lies
    within them.
    """
    tail = decode(list(generated[-tail_tokens(stop_strings) :]))
    return any(stop in tail for stop in stop_strings)


def token_characters(decode: Callable[[list[int]], str], token: int) -> str | None:
    """The characters ``token`` can add to a text: its lone decoding and its decoding twice in a row; None when
    it can add any (a broken multi-byte character, or a decoder error)."""
    try:
        text = decode([token]) + decode([token, token])
    except Exception:  # an id the tokenizer lacks (a padded vocabulary): check it like any unknown text
        return None
    return None if REPLACEMENT in text else text


class StopStringFilter:
    """Which sampled tokens can complete a stop string, per set of stop strings.

    Args:
        decode: token ids to text, as the engine searches it.
        vocab_size: the model's vocabulary (sampled ids are below it).
    """

    def __init__(self, decode: Callable[[list[int]], str], vocab_size: int) -> None:
        self.decode = decode
        self.vocab_size = vocab_size
        self._characters: list[str | None] | None = None
        self._masks: dict[tuple[str, ...], np.ndarray] = {}

    def characters(self) -> list[str | None]:
        """Every token's :func:`token_characters`, computed once (a decode or two per token of the vocabulary)."""
        if self._characters is None:
            self._characters = [token_characters(self.decode, token) for token in range(self.vocab_size)]
        return self._characters

    def candidates(self, stop_strings: tuple[str, ...]) -> np.ndarray:
        """Shape (vocab,) bool: True for the tokens after which the text must be searched for ``stop_strings``.
        The masks of the :data:`KEPT_MASKS` sets used last are kept."""
        mask = self._masks.pop(stop_strings, None)
        if mask is None:
            last = {stop[-1] for stop in stop_strings if stop}
            if "" in stop_strings:  # the empty string is in every text: the first token completes it
                mask = np.ones(self.vocab_size, dtype=bool)
            else:
                mask = np.array([text is None or any(c in text for c in last) for text in self.characters()],
                                dtype=bool)
            if len(self._masks) >= KEPT_MASKS:
                del self._masks[next(iter(self._masks))]  # the one used longest ago
        self._masks[stop_strings] = mask  # last in the order: the latest used
        return mask
