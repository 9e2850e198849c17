"""The built-in model's tokenizer corpus: what turnrl ships, whatever a user has registered."""

from __future__ import annotations

import numpy as np

from turnrl.agent.formats import BUILTIN_FORMATS, FORMATS, Tag, TaggedFormat, format_names
from turnrl.envs import make
from turnrl.models.builtin import _corpus, _env_texts, builtin_corpus, image_mode_corpus


def test_a_users_registered_format_leaves_the_builtin_corpus_as_it_was(monkeypatch):
    """A run that registers a format of its own must build (and reuse from the cache) the same built-in model
    as one that does not: the corpus covers the built-in formats only."""
    def texts() -> list[str]:
        return _env_texts(make("Bandit"), 2, np.random.default_rng(0))

    before = texts()
    monkeypatch.setitem(FORMATS._entries, "user_plan", TaggedFormat("user_plan", (Tag("plan"), Tag("answer"))))
    assert "user_plan" in format_names() and "user_plan" not in BUILTIN_FORMATS
    assert texts() == before


def test_the_corpus_is_made_once_a_process_and_each_caller_gets_its_own_list():
    """Every start of a run checks the built model's key against the corpus (about a second to make): made once,
    immutable, and a caller that changes its list changes no other caller's."""
    assert builtin_corpus() is builtin_corpus() and isinstance(builtin_corpus(), tuple)
    mine = _corpus("tiny")
    mine.append("a text of mine")
    assert _corpus("tiny") == list(builtin_corpus())
    assert _corpus("vlm-tiny") == [*builtin_corpus(), *image_mode_corpus()]
