"""The engine's device timer's helpers."""

from __future__ import annotations

import pytest

from turnrl.engine.timing import causal_pairs


@pytest.mark.parametrize(("cached", "new"), [(0, 1), (0, 7), (5, 1), (12, 4)])
def test_causal_pairs_count_each_new_query_against_the_cached_keys_and_the_new_ones_up_to_itself(cached, new):
    pairs = sum(1 for query in range(cached, cached + new) for key in range(query + 1))
    assert causal_pairs(cached, new) == pairs
