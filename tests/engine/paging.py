"""Rectangular test caches as the engine's pages: the kernels' tests build a cache of rows, Shape (2, R, Hkv, C + 1,
D) with column C as scratch, and run the kernels on the same keys and values scattered over shuffled pages."""

from __future__ import annotations

import torch

from turnrl.engine.cache import KVCache, pages_for
from turnrl.engine.weights import DecoderShape


def paged(kv: torch.Tensor, page: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv``'s rows in pages of ``page`` positions, in a shuffled order: the pages, Shape (2, R * C / P + 1, Hkv,
    P, D), and the table, Shape (R, C / P + 1) int32. Page 0 is scratch (zeros); every row's last table column
    points to it."""
    two, rows, heads, columns, dim = kv.shape
    capacity = columns - 1
    per_row = capacity // page
    assert per_row * page == capacity, "the capacity must be whole pages"
    order = torch.randperm(rows * per_row, generator=torch.Generator().manual_seed(seed)) + 1
    pages = torch.zeros(two, rows * per_row + 1, heads, page, dim, dtype=kv.dtype, device=kv.device)
    table = torch.zeros(rows, per_row + 1, dtype=torch.int32)
    for row in range(rows):
        for j in range(per_row):
            index = int(order[row * per_row + j])
            table[row, j] = index
            pages[:, index] = kv[:, row, :, j * page : (j + 1) * page]
    return pages, table.to(kv.device)


def unpaged(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The rows of a paged cache, Shape (2, R, Hkv, C + 1, D); column C is the scratch page's first position."""
    two, _, heads, page, dim = pages.shape
    rows, columns = table.shape
    gathered = pages[:, table.long()]  # (2, R, C / P + 1, Hkv, P, D)
    flat = gathered.permute(0, 1, 3, 2, 4, 5).reshape(two, rows, heads, columns * page, dim)
    return flat[:, :, :, : (columns - 1) * page + 1]


def filled_cache(shape: DecoderShape, rows: int, max_len: int, dtype: torch.dtype = torch.float32) -> KVCache:
    """A cache whose ``rows`` each hold the pages of ``max_len`` positions (the engine gives a row its pages when a
    sequence is admitted; a test of the forward pass alone takes them all)."""
    cache = KVCache(shape, rows, max_len, rows * pages_for(max_len) + 1, dtype, torch.device("cpu"))
    for row in range(rows):
        assert cache.resize(row, cache.capacity)
    cache.sync()
    return cache
