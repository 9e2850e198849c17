"""The paged key/value cache: which pages a row holds, the table the kernels read, and the pool's growth."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from turnrl.engine.cache import INITIAL_PAGES, SCRATCH_PAGE, KVCache, pages_for
from turnrl.engine.weights import DecoderShape

SHAPE = DecoderShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=10, rms_eps=1e-6)


def cache(max_pages: int = 200, rows: int = 4, max_len: int = 300, page: int = 16) -> KVCache:
    built = KVCache(SHAPE, rows, max_len, max_pages, torch.float32, torch.device("cpu"), page=page)
    built.reserve_scratch()
    return built


def test_a_row_takes_and_gives_back_the_pages_of_its_positions():
    kv = cache()
    assert kv.capacity == 304 and kv.row_pages == 19  # 300 rounded up to whole pages of 16
    assert kv.resize(1, 40) and kv.held(1) == 3
    assert kv.resize(1, 33) and kv.held(1) == 3  # positions 32 and 33 share the third page
    assert kv.resize(1, 16) and kv.held(1) == 1
    kv.sync()
    table = kv.table[1].tolist()
    assert table[0] != SCRATCH_PAGE and table[1:] == [SCRATCH_PAGE] * 19  # past its pages, and the scratch column
    assert kv.resize(1, 0) and kv.held(1) == 0


def test_rows_never_share_a_page_and_pages_come_back_to_the_pool():
    kv = cache(max_pages=11, max_len=64)  # scratch + 10
    assert kv.resize(0, 64) and kv.resize(1, 64)  # 4 pages each
    assert kv.free_pages == 2
    assert not kv.resize(2, 48)  # 3 pages: refused, nothing taken
    assert kv.held(2) == 0 and kv.free_pages == 2
    kv.sync()
    held = set(kv.table[0, :4].tolist()) | set(kv.table[1, :4].tolist())
    assert len(held) == 8 and SCRATCH_PAGE not in held
    assert kv.resize(0, 16) and kv.resize(2, 48)
    kv.sync()
    assert set(kv.table[2, :3].tolist()).isdisjoint(kv.table[0, :1].tolist()) and kv.free_pages == 2


def test_the_pool_doubles_up_to_the_budget_keeping_what_its_pages_hold():
    kv = cache(max_pages=400, rows=8, max_len=2000, page=16)
    assert kv.pages == INITIAL_PAGES + 1
    assert kv.resize(0, 16 * 60)
    kv.sync()
    first = kv.table[0, :60].long()
    kv.kv[1][:, first] = torch.arange(60.0).view(1, 60, 1, 1, 1)
    kv.grown = False
    assert kv.resize(1, 16 * 100)  # 160 pages in use: 65 + the 96 missing (more than doubling)
    assert kv.grown and kv.pages == 161
    assert torch.equal(kv.kv[1][0, first, 0, 0, 0], torch.arange(60.0))
    assert not kv.resize(2, 2000) or kv.pages <= 400


def test_the_pool_grows_layer_by_layer_holding_one_old_layer_at_most(monkeypatch):
    """Each layer's larger tensor replaces its old one before the next is made: while the pool grows it never
    holds the old pool beside the new (the last growth, from just under the budget to it, held the cache twice)."""
    shape = DecoderShape(num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=10, rms_eps=1e-6)
    kv = KVCache(shape, 4, 2000, 400, torch.float32, torch.device("cpu"), page=16)
    kv.reserve_scratch()
    held: list[int] = []  # bytes of the pool's tensors alive at each new layer's allocation
    tracked: list = []
    zeros = torch.zeros

    def counted_zeros(*args, **kwargs):
        held.append(sum(t.untyped_storage().nbytes() for ref in tracked if (t := ref()) is not None))
        layer = zeros(*args, **kwargs)
        tracked.append(weakref.ref(layer))
        return layer

    tracked.extend(weakref.ref(layer) for layer in kv.kv)
    old_layer = kv.kv[0].untyped_storage().nbytes()
    monkeypatch.setattr(torch, "zeros", counted_zeros)
    assert kv.resize(0, 16 * 100)  # past the first 65 pages: one growth
    new_layer = kv.kv[0].untyped_storage().nbytes()
    assert new_layer > old_layer and len(held) == 6
    # Before layer i's new tensor: the i new ones made and the 6 - i old ones not yet replaced.
    assert held == [i * new_layer + (6 - i) * old_layer for i in range(6)]
    assert max(held) + new_layer <= 6 * new_layer + old_layer


def test_a_budget_below_one_sequence_is_refused():
    with pytest.raises(ValueError, match="cannot hold one sequence of 300 tokens"):
        cache(max_pages=10)


def test_writes_and_gathers_through_the_table_equal_a_plain_row():
    """The torch path's write and gather: positions land in the row's pages, padding in scratch."""
    kv = cache(page=16)
    assert kv.resize(2, 50) and kv.resize(0, 20)
    kv.sync()
    layer = kv.kv[0]
    rows = torch.tensor([[2, 2, 2], [0, 0, 0]])
    positions = torch.tensor([[3, 17, 49], [0, 19, kv.capacity]])
    values = torch.randn(2, 3, 2, SHAPE.num_kv_heads, SHAPE.head_dim)
    kv.write(layer, rows, positions, values)
    gathered = kv.gather(layer, torch.tensor([2, 0]), 50)
    assert gathered.shape == (2, 2, SHAPE.num_kv_heads, 50, SHAPE.head_dim)
    for i, position in enumerate([3, 17, 49]):
        torch.testing.assert_close(gathered[:, 0, :, position], values[0, i])
    torch.testing.assert_close(gathered[:, 1, :, 19], values[1, 1])
    torch.testing.assert_close(layer[:, SCRATCH_PAGE, :, 0], values[1, 2])  # the padding token


def test_copied_rows_hold_the_source_rows_positions():
    kv = cache(page=16)
    for row, positions in ((0, 40), (3, 48)):
        assert kv.resize(row, positions)
    kv.sync()
    for layer in kv.kv:
        layer.normal_()
    before = [kv.gather(layer, torch.tensor([0]), 40) for layer in kv.kv]
    kv.copy_rows(np.array([0]), np.array([3]), 40)
    for layer, source in zip(kv.kv, before):
        torch.testing.assert_close(kv.gather(layer, torch.tensor([3]), 40), source)


def test_pages_for_rounds_up():
    assert [pages_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 300)), max_size=40))
def test_any_sequence_of_resizes_keeps_every_page_in_one_place(operations):
    """Whatever rows ask for, in any order: a page is held by one row or free, never both or twice; a row's
    table lists its pages then scratch; a refused resize changes nothing; the pool stays within its budget."""
    kv = cache(max_pages=45, rows=6, max_len=300, page=16)  # 19 pages a full row: two full rows and change
    for row, positions in operations:
        before = [kv.held(r) for r in range(6)], kv.free_pages
        if not kv.resize(row, positions):
            assert ([kv.held(r) for r in range(6)], kv.free_pages) == before
            assert pages_for(positions, 16) - kv.held(row) > kv.free_pages
        kv.sync()
        table = kv.table.tolist()
        held = [page for r in range(6) for page in table[r][: kv.held(r)]]
        assert len(held) == len(set(held)) and SCRATCH_PAGE not in held
        assert all(set(table[r][kv.held(r):]) == {SCRATCH_PAGE} for r in range(6))
        assert kv.pages <= kv.max_pages
        assert len(held) + kv.free_pages == kv.max_pages - 1


def test_a_budget_of_one_sequence_and_the_scratch_page_is_enough():
    assert cache(max_pages=20).row_pages == 19  # 300 positions in pages of 16, and scratch
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        cache(max_pages=19)


def test_pages_in_a_budget_count_whole_pages_only():
    assert KVCache.pages_in(10_000, 10, page=16) == 62  # 10,000 bytes in pages of 160
    assert KVCache.pages_in(159, 10, page=16) == 0


def test_a_tokens_keys_and_values_take_two_widths_of_the_dtype():
    assert KVCache.bytes_per_token(64, torch.bfloat16) == 256
    assert KVCache.bytes_per_token(64, torch.float32) == 512


def test_a_cache_with_no_pool_yet_offers_every_page_but_scratch():
    kv = KVCache(SHAPE, 4, 300, 40, torch.float32, torch.device("cpu"), page=16)
    assert kv.pages == 0 and kv.free_pages == 39
    assert kv.resize(0, 300) and kv.resize(1, 300) and kv.free_pages == 1


def test_the_pool_doubles_when_doubling_gives_the_pages_a_row_lacks():
    kv = cache(max_pages=400, rows=8, max_len=2000, page=16)
    assert kv.resize(0, 16 * 70)  # 6 pages more than the first 64
    assert kv.pages == 2 * (INITIAL_PAGES + 1)


def test_after_release_every_row_points_to_scratch_and_the_pool_comes_back():
    kv = cache(rows=3)
    for row in range(3):
        assert kv.resize(row, 300)
    kv.sync()
    kv.release()
    kv.sync()
    assert set(kv.table.flatten().tolist()) == {SCRATCH_PAGE}
    kv.reserve_scratch()
    assert kv.pages == INITIAL_PAGES + 1 and len(kv.kv) == SHAPE.num_layers
