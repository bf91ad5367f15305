"""The cyclic garbage collector's pace during a search.

A search on a large pool keeps millions of long-lived objects (layout, KV-edge and score caches)
and allocates many short-lived ones per candidate; at the interpreter's default first threshold
(700 allocations) the collector runs tens of thousands of times and walks the long-lived objects
in every full pass. ``fewer_collections`` raises that threshold for the search and restores it
after; a search creates few reference cycles, so memory grows by little.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager

FIRST_THRESHOLD = 100_000


@contextmanager
def fewer_collections(threshold: int = FIRST_THRESHOLD):
    """Run the body with the collector's first threshold at least ``threshold``."""
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], threshold), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


def with_fewer_collections(fn):
    """``fn`` run inside ``fewer_collections``."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with fewer_collections():
            return fn(*args, **kwargs)
    return wrapped
