"""The Python heap of a long run: what the cyclic garbage collector walks.

A run's models, compiled graphs and caches are hundreds of thousands of Python objects on a CPU (570,000 with the
built-in `vlm-tiny`) and millions on a GPU with compiled graphs. They live until the run ends, yet a full
collection walks all of them every time one starts, and a rollout's allocations (token lists, messages, turn
records) start one every few steps: 0.27 s each with `vlm-tiny` on a 2-core CPU, host time in the middle of a
step. :func:`settle` leaves the objects alive at that moment out of later collections (``gc.freeze``), as
serving engines do once their graphs are captured; :func:`release` puts them back for a process that goes on.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect the young garbage, then leave every object that survives out of the collector's later passes.
    Objects left out are still freed when nothing refers to them; only reference cycles among them wait for
    :func:`release`. The old generation is not collected first: that would be the very walk this saves (0.23 s
    over the 520,000 objects of a process that has imported turnrl), and its garbage, cycles that outlived two
    younger collections, waits for :func:`release` too."""
    gc.collect(1)
    gc.freeze()


def release() -> None:
    """Every object :func:`settle` left out is collectable again (a run that ends in a process that goes on)."""
    gc.unfreeze()
