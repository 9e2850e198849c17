"""The key/value cache: a pool of fixed-size pages, and per row (a sequence's slot) the pages that hold it.

Notation: R rows, P positions a page (:data:`PAGE_TOKENS`), N pages in the pool, Hkv key/value heads, D head dim.

A row's position p lives in page ``table[row, p // P]`` at offset ``p % P``. A row holds only the pages its
sequence needs (its prompt and its generation budget), not a whole ``max_seq_len``: sequences of a multi-turn
episode are short at first and long only at the end, and a cache of rows reserved at full length held a few of
them at a time (14 of 64 episodes a process at the Qwen3-VL-8B maze recipe's size, docs/benchmarks.md). Page 0 is
scratch: a row's table entries past its pages point there, and so does the column past its last page, where
padding tokens write (position ``capacity``), so a stray write never lands in another row's page.

Hand-written because the engine's attention kernels address the cache themselves (:mod:`turnrl.engine.attention`);
the page arithmetic here is what they read.
"""

from __future__ import annotations

import numpy as np
import torch

from turnrl.engine.weights import DecoderShape
from turnrl.models.devices import to_device

PAGE_TOKENS = 128
"""Positions a page: a multiple of every key block the attention kernel reads (a block never crosses a page), and
small enough that a sequence wastes at most one partly used page."""

SCRATCH_PAGE = 0

INITIAL_PAGES = 64
"""Pages allocated at first (with the scratch page); the pool doubles, up to the budget, as sequences need more."""


def pages_for(positions: int, page: int = PAGE_TOKENS) -> int:
    """Pages that hold ``positions`` positions of a row."""
    return -(-positions // page)


class KVCache:
    """Keys and values of every layer in pages, each layer Shape (2, N, Hkv, P, D): keys then values, so that one
    indexed write stores both; and the page table, Shape (R, capacity / P + 1) int32 on the device.

    Args:
        shape: the decoder's (layers, key/value heads, head dim).
        rows: sequences held at once at most (slots; a row holds no memory until it takes pages).
        max_len: the longest sequence; ``capacity`` is it rounded up to whole pages.
        max_pages: the pool's size at most, scratch page included (the budget: :meth:`pages_in`).
    """

    def __init__(self, shape: DecoderShape, rows: int, max_len: int, max_pages: int, dtype: torch.dtype,
                 device: torch.device, page: int = PAGE_TOKENS) -> None:
        self.shape, self.rows, self.dtype, self.device, self.page = shape, rows, dtype, device, page
        self.capacity = pages_for(max_len, page) * page
        """Positions a row may hold; position ``capacity`` is the scratch column (padding writes there)."""
        self.row_pages = self.capacity // page
        if max_pages < self.row_pages + 1:
            raise ValueError(f"a cache of {max_pages} pages of {page} positions cannot hold one sequence of "
                             f"{max_len} tokens and the scratch page ({self.row_pages + 1} pages)")
        self.max_pages = max_pages
        self.kv: list[torch.Tensor] = []
        """Per layer, Shape (2, N, Hkv, P, D): keys then values."""
        self.pages = 0
        """N, the pages allocated (the pool grows to ``max_pages``)."""
        self._free: list[int] = []
        self._held: list[list[int]] = [[] for _ in range(rows)]
        self._host_table = np.full((rows, self.row_pages + 1), SCRATCH_PAGE, dtype=np.int32)
        self.table = torch.full((rows, self.row_pages + 1), SCRATCH_PAGE, dtype=torch.int32, device=device)
        """Each row's pages in order, then scratch, Shape (R, capacity / P + 1); read by the attention kernels
        and, in place, by the CUDA graphs captured on it."""
        self._table_stale = False
        self.arrivals = torch.zeros(rows * shape.num_kv_heads, dtype=torch.int32, device=device)
        """A counter per (row, key/value head) with which a decode step's split attention combines its key
        stretches in its own kernel (:func:`~turnrl.engine.attention.cached_attention`); zero between calls."""
        self.grown = False
        """The pool's tensors were replaced since the engine last looked (graphs captured on them are stale)."""

    @staticmethod
    def pages_in(budget_bytes: float, bytes_per_token: int, page: int = PAGE_TOKENS) -> int:
        """Pages (scratch included) that ``budget_bytes`` holds."""
        return int(budget_bytes // (bytes_per_token * page))

    @staticmethod
    def bytes_per_token(key_width: int, dtype: torch.dtype) -> int:
        """A token's keys and values in ``dtype``, ``key_width`` of each (:attr:`DecoderShape.key_width`)."""
        return 2 * key_width * torch.tensor([], dtype=dtype).element_size()

    @property
    def free_pages(self) -> int:
        """Pages a row can take: free in the pool, or not yet allocated within the budget."""
        return len(self._free) + self.max_pages - max(self.pages, 1)

    def held(self, row: int) -> int:
        return len(self._held[row])

    def resize(self, row: int, positions: int) -> bool:
        """Make ``row`` hold the pages of its first ``positions`` positions (its pages past them go back to the
        pool); False, changing nothing, when the pool cannot give the pages it lacks."""
        held, needed = self._held[row], pages_for(positions, self.page)
        if needed > len(held):
            missing = needed - len(held)
            if missing > self.free_pages:
                return False
            while len(self._free) < missing:
                self._grow(missing - len(self._free))
            taken, self._free = self._free[-missing:], self._free[:-missing]
            self._host_table[row, len(held) : needed] = taken
            held.extend(taken)
        elif needed < len(held):
            self._free.extend(held[needed:])
            del held[needed:]
            self._host_table[row, needed : self.row_pages] = SCRATCH_PAGE
        else:
            return True
        self._table_stale = True
        return True

    def sync(self) -> None:
        """Copy the page table to the device if it changed (in stream order: a step already launched reads the
        old one, the next the new one)."""
        if self._table_stale:
            self.table.copy_(torch.from_numpy(self._host_table))
            self._table_stale = False

    def _grow(self, at_least: int) -> None:
        """Double the pool (at least ``at_least`` more pages, at most ``max_pages``), keeping every page.

        Layer by layer: each layer's larger tensor takes the place of its old one before the next is made, so the
        pool holds its new size and one old layer at most while it grows. Made all at once beside the old ones,
        the last growth (from just under the budget to the budget, where doubling stops) held the cache twice:
        19.1 GiB of a 10 GB cache at the rollout's peak of VisGym's maze at ``vlm-3b`` (docs/benchmarks.md).
        """
        old = self.pages
        pages = min(self.max_pages, max(INITIAL_PAGES + 1, 2 * old, old + at_least))
        size = (2, pages, self.shape.num_kv_heads, self.page, self.shape.head_dim)
        for index in range(self.shape.num_layers):
            # Zeros, not empty: a padding query may attend to never-written positions, which must be finite.
            layer = torch.zeros(size, dtype=self.dtype, device=self.device)
            if index < len(self.kv):
                layer[:, :old].copy_(self.kv[index])
                self.kv[index] = layer  # the old layer's last reference: freed in stream order
            else:
                self.kv.append(layer)
        self._free.extend(range(max(old, SCRATCH_PAGE + 1), pages))
        self.pages, self.grown = pages, True

    def reserve_scratch(self) -> None:
        """Allocate the pool's first pages (the scratch page among them) if it has none: a decode or prefill
        before any row took pages (a graph's warm-up) writes to scratch."""
        if self.pages == 0:
            self._grow(1)

    def release(self) -> None:
        """Free every layer's pages; every row then holds none (the caller has ended or dropped its sequences)."""
        self.kv, self.pages, self._free = [], 0, []
        self._held = [[] for _ in range(self.rows)]
        self._host_table[:] = SCRATCH_PAGE
        self._table_stale = True

    def copy_rows(self, sources: np.ndarray, targets: np.ndarray, length: int) -> None:
        """Copy the first ``length`` positions of rows ``sources`` into rows ``targets`` (each Shape (n,)), in every
        layer, whole pages at a time (the targets hold at least those pages): an identical prompt's keys and
        values, computed once."""
        n = pages_for(length, self.page)
        source_pages = to_device(self._host_table[sources, :n].astype(np.int64).ravel(), self.device)
        target_pages = to_device(self._host_table[targets, :n].astype(np.int64).ravel(), self.device)
        for layer in self.kv:
            layer[:, target_pages] = layer[:, source_pages]

    def gather(self, layer: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
        """The first ``length`` positions of ``rows`` (Shape (b,)) in one layer, Shape (2, b, Hkv, length, D): a copy,
        for torch's attention (the Triton kernel reads the pages in place)."""
        n = pages_for(length, self.page)
        pages = self.table[rows, :n].long()  # (b, n)
        two, _, heads, page, dim = layer.shape
        # Indexed with the heads in front, the one copy comes out as (2, Hkv, b, n, P, D): its pages merge into
        # positions without a second copy, and the heads go back to their place as a view.
        gathered = layer.transpose(1, 2)[:, :, pages]
        return gathered.view(two, heads, len(pages), n * page, dim).transpose(1, 2)[:, :, :, :length]

    def write(self, layer: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor) -> None:
        """Store keys and values ``kv`` (Shape (b, t, 2, Hkv, D)) of ``rows`` (Shape (b, t)) at ``positions``
        (Shape (b, t); ``capacity`` writes to scratch)."""
        pages = self.table[rows, positions // self.page].long()
        layer[:, pages, :, positions % self.page] = kv
